"""TRL's SFTTrainer, written for TRL (``from trl import SFTConfig, SFTTrainer``); under
meshfit the test suite changes that one import (`driver.py`). A BPE tokenizer trained here on
a standard-library file (no downloads) with TRL's Llama 3 chat template, a tiny Llama, random
conversations; 3 optimizer steps per case.
"""

import random
import sysconfig
from pathlib import Path

import datasets
import torch
import transformers
from trl import SFTConfig, SFTTrainer

from snippets import result

COMMON = dict(per_device_train_batch_size=2, max_steps=3, logging_steps=1, report_to="none",
              use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
              optim="adamw_torch", max_length=64, bf16=False)
CASES = {
    "sft_completion_only": dict(completion_only_loss=True),
    "sft_assistant_only": dict(assistant_only_loss=True),
    "sft_packing": dict(packing=True),
    "sft_padding_free": dict(padding_free=True, max_length=None),
}
_TOKENIZER = []


def tokenizer():
    if _TOKENIZER:
        return _TOKENIZER[0]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import trl

    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()[:20_000]
    special = ["<unk>", "<pad>", "<|begin_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=400, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = (Path(trl.__file__).parent / "chat_templates"
                          / "llama3_training.jinja").read_text()
    _TOKENIZER.append(fast)
    return fast


def rows(case: str, n: int = 24):
    rnd = random.Random(3)
    words = "alpha beta gamma delta the quick brown fox jumps over a lazy dog".split()

    def say(k):
        return " ".join(rnd.choice(words) for _ in range(k))

    if case == "sft_assistant_only":
        return datasets.Dataset.from_list([{"messages": [
            {"role": "user", "content": say(3 + i % 4)},
            {"role": "assistant", "content": say(4 + i % 5)}]} for i in range(n)])
    if case == "sft_completion_only":
        return datasets.Dataset.from_list([{"prompt": say(5), "completion": " " + say(3 + i % 3)}
                                           for i in range(n)])
    return datasets.Dataset.from_list([{"text": say(6 + i % 7)} for i in range(n)])


def model(vocab: int):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


def trainer(case: str, out: str, config=SFTConfig, trainer_class=SFTTrainer, **extra):
    tok = tokenizer()
    args = config(output_dir=out, **{**COMMON, **CASES.get(case, {}), **extra})
    return trainer_class(model=model(len(tok)), args=args, train_dataset=rows(case),
                         processing_class=tok)


def run(case: str, out: str) -> dict:
    job = trainer(case, out)
    job.train()
    return result(job)
