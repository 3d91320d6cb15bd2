"""Write everything the fine-tuning example of docs/fine-tuning.md needs, offline, into one folder:

    OUT/tokenizer/    a byte-level BPE tokenizer trained on Python's own source, with a
                      ChatML-style chat template (<|im_start|>role ... <|im_end|>) whose
                      {% generation %} markers tell meshfit which tokens are the assistant's
    OUT/model/        a small Llama-shaped model as save_pretrained writes it (2 layers,
                      width 64; random weights standing in for a pretrained checkpoint)
    OUT/chats.jsonl   400 conversations {"messages": [{"role", "content"}, ...]}: a user asks
                      for a colour, a number or a word backwards; the assistant answers

Usage: python examples/chat_data.py OUT
"""

import json
import random
import sys
import sysconfig
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
WORDS = ["model", "tensor", "python", "garden", "silver", "window", "rocket", "planet"]


def conversation(rnd: random.Random) -> dict:
    kind = rnd.randrange(3)
    if kind == 0:
        colour = rnd.choice(COLOURS)
        turns = [f"Name the colour {colour}.", f"The colour is {colour}."]
    elif kind == 1:
        a, b = rnd.randrange(10), rnd.randrange(10)
        turns = [f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."]
    else:
        word = rnd.choice(WORDS)
        turns = [f"Spell {word} backwards.", f"{word} backwards is {word[::-1]}."]
    messages = [{"role": "system", "content": "You answer in one sentence."}] \
        if rnd.random() < 0.3 else []
    messages += [{"role": "user", "content": turns[0]},
                 {"role": "assistant", "content": turns[1]}]
    return {"messages": messages}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text()[:60_000] for name in ("os.py", "textwrap.py",
                                                                 "random.py")]
    rnd = random.Random(0)
    chats = [conversation(rnd) for _ in range(400)]
    texts += [" ".join(m["content"] for m in c["messages"]) for c in chats]
    special = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out / "tokenizer")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=len(tokenizer), max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out / "model")
    with open(out / "chats.jsonl", "w") as fh:
        for chat in chats:
            fh.write(json.dumps(chat) + "\n")
    print(f"wrote {out}/tokenizer, {out}/model and {out}/chats.jsonl ({len(chats)} conversations)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python examples/chat_data.py OUT")
    main(Path(sys.argv[1]))
