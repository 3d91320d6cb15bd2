"""Fine-tuning data ([data] format "completion" and "chat"): the loss masks against TRL's
SFTTrainer on the same rows and tokenizers, training that weighs every trained token the
same under every layout and micro-batch size, and bad input refused before launch.

Tokenizers: one BPE trained here on two standard-library files, saved twice with the chat
templates of Llama 3 and Qwen2.5 (the template files TRL ships, which TRL recognises and
swaps for its training versions); conversations of 1-2 turns, a third with a system turn."""

from __future__ import annotations

import json
import math
import random
import re
import sysconfig
from pathlib import Path

import pytest
import torch

from conftest import run_distributed

pytest.importorskip("trl")


def _conversations(n: int, seed: int) -> list[dict]:
    rnd = random.Random(seed)
    words = "alpha beta gamma delta the quick brown fox jumps over a lazy dog import os".split()

    def say(k):
        return " ".join(rnd.choice(words) for _ in range(k))

    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": say(4)}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            messages += [{"role": "user", "content": say(3 + i % 4)},
                         {"role": "assistant", "content": say(4 + i % 5)}]
        rows.append({"messages": messages, "prompt": say(5), "completion": " " + say(3 + i % 3)})
    return rows


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import datasets
    import transformers
    import trl
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tmp = tmp_path_factory.mktemp("sft")
    templates = Path(trl.__file__).parent / "chat_templates"
    stdlib = sysconfig.get_paths()["stdlib"]
    texts = [open(f"{stdlib}/{name}").read()[:30_000] for name in ("os.py", "textwrap.py")]
    special = ["<unk>", "<pad>", "<|begin_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=500, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    for name, template, bos, eos in (("llama3", "llama3.jinja", "<|begin_of_text|>", "<|eot_id|>"),
                                     ("qwen", "qwen2_5.jinja", None, "<|im_end|>")):
        t = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos,
                                                 eos_token=eos, pad_token="<pad>",
                                                 unk_token="<unk>")
        t.chat_template = (templates / template).read_text()
        t.save_pretrained(tmp / name)
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(_conversations(48, 0)),
        "validation": datasets.Dataset.from_list(_conversations(5, 1)),
    }).save_to_disk(tmp / "convs")
    with open(tmp / "rows.jsonl", "w") as fh:
        for row in _conversations(12, 2):
            fh.write(json.dumps(row) + "\n")
    llama = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, num_hidden_layers=2, vocab_size=512,
                                     max_position_embeddings=256)
    torch.manual_seed(7)
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp / "model")
    return tmp


def _trl_masks(folder: Path, rows: list[dict], fmt: str) -> list[tuple[list[int], list[int]]]:
    """(input_ids, mask) of each row as TRL's SFTTrainer prepares it (labels != -100)."""
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    if fmt == "chat":
        ds = datasets.Dataset.from_list([{"messages": r["messages"]} for r in rows])
        extra = {"assistant_only_loss": True}
    else:
        ds = datasets.Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]}
                                         for r in rows])
        extra = {"completion_only_loss": True}
    args = SFTConfig(output_dir=str(folder / "trl-out"), max_length=None, report_to=[],
                     use_cpu=True, bf16=False, **extra)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1,
        vocab_size=len(tok)))
    prepared = SFTTrainer(model=model, args=args, train_dataset=ds,
                          processing_class=tok).train_dataset
    return [(list(r["input_ids"]), [int(x != -100) for x in r["labels"]]) for r in prepared]


@pytest.mark.parametrize("name", ["llama3", "qwen"])
@pytest.mark.parametrize("fmt", ["chat", "completion"])
def test_masks_equal_trl_sft_trainer(files, name, fmt):
    """The same token ids and masks as SFTTrainer (assistant_only_loss /
    completion_only_loss), position by position: 0 differ."""
    import transformers

    from meshfit.data.examples import chat_example, completion_example, training_template

    rows = _conversations(30, 3)
    tok = transformers.AutoTokenizer.from_pretrained(files / name)
    template, how = training_template(tok, None)
    assert how == "TRL's training version of the template"  # both templates are TRL's originals
    differ = total = trained = 0
    for row, (ids, mask) in zip(rows, _trl_masks(files / name, rows, fmt)):
        ours_ids, ours = (chat_example(tok, row["messages"], template=template) if fmt == "chat"
                          else completion_example(tok, row["prompt"], row["completion"]))
        assert ours_ids == ids
        differ += sum(a != b for a, b in zip(ours, mask))
        total, trained = total + len(mask), trained + sum(mask)
    assert differ == 0 and 0 < trained < total


def test_turn_by_turn_masks_equal_trl_where_the_template_allows(files):
    """Without TRL's template swap, the turn-by-turn rule on Llama 3's own template gives
    TRL's masks too (its generation prompt ends where the assistant's text begins)."""
    import transformers

    from meshfit.data.examples import chat_example

    rows = _conversations(30, 4)
    tok = transformers.AutoTokenizer.from_pretrained(files / "llama3")
    for row, (ids, mask) in zip(rows, _trl_masks(files / "llama3", rows, "chat")):
        assert chat_example(tok, row["messages"]) == (ids, mask)


def test_rows_mask_prompt_and_padding_and_count_what_does_not_fit():
    """A row's targets: the next token where it is trained, else -100; examples longer than
    the row truncated, ones without a trained token inside the row left out, both counted."""
    import numpy as np

    from meshfit.data.examples import _rows

    examples = [([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 0, 0, 1, 1]),
                ([12, 13, 14, 15, 16, 17], [0, 1, 1, 1, 1, 1])]
    data, stats = _rows(examples, seq_len=4, pad_id=0, what="training")
    assert (stats["truncated"], stats["dropped"], len(data)) == (2, 1, 2)
    x, y = data[0]
    assert x.tolist() == [1, 2, 3, 4] and y.tolist() == [-100, 3, 4, -100]
    x, y = data[1]
    assert x.tolist() == [12, 13, 14, 15] and y.tolist() == [13, 14, 15, 16]
    assert data.ids.dtype == np.int32
    with pytest.raises(ValueError, match="none of the 1 training examples has a trained token "
                                         "within its first 5 tokens"):
        _rows([([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 1])], seq_len=4, pad_id=0, what="training")


def test_long_examples_are_tokenized_only_as_far_as_the_row_keeps(files, monkeypatch):
    """An example far longer than its row (120,000 characters here; one of 52 MB cut to 33
    tokens took 146 s and 11.8 GiB) gives the first tokens and mask of the whole text --
    transformers' own `apply_chat_template` (the template's {% generation %} spans), the
    turn-by-turn rule and the completion rule on the whole text -- while at most three
    prefixes of 4,096 characters doubling go through the tokenizer, whatever its length."""
    import transformers

    from meshfit.data.examples import chat_example, completion_example, training_template

    rnd = random.Random(5)
    words = "alpha beta gamma delta import os the quick brown fox\n <|eot_id|> {x}".split(" ")

    def text(n):
        return "".join(rnd.choice(words) + rnd.choice(" \n") for _ in range(n // 6))

    tok = transformers.AutoTokenizer.from_pretrained(files / "llama3")
    marked, _ = training_template(tok, None)  # TRL's, with {% generation %} markers
    seen = []
    call = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__", lambda self, t, **kw: (seen.append(len(t)),
                                                                      call(self, t, **kw))[1])
    for short, long in ((text(40), text(60_000)), (text(60_000), text(60_000))):
        messages = [{"role": "user", "content": short}, {"role": "assistant", "content": long},
                    {"role": "user", "content": long}, {"role": "assistant", "content": short}]
        whole = tok.apply_chat_template(messages, chat_template=marked, return_dict=True,
                                        return_assistant_tokens_mask=True)
        by_turns = chat_example(tok, messages)
        by_rule = completion_example(tok, short, long)
        for limit in (9, 33, 300):
            seen.clear()
            assert chat_example(tok, messages, template=marked, limit=limit) == (
                whole["input_ids"][:limit], whole["assistant_masks"][:limit])
            assert chat_example(tok, messages, limit=limit) == tuple(
                x[:limit] for x in by_turns)
            assert completion_example(tok, short, long, limit=limit) == tuple(
                x[:limit] for x in by_rule)
            assert 0 < sum(seen) <= 4 * (4096 + 8192), seen  # 4 calls (completion: 2)


# ---------------------------------------------------------------------------- training
BASE = {"train": {"steps": 3, "eval_every": 0, "log_every": 1, "eval_batches": 2,
                  "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 48,
                  "warmup_steps": 1},
        "optim": {"optimizer": "adamw", "lr": 1e-2}}
RTOL = 1e-4  # fp32, layouts summing in other orders (as tests/train/test_train_models.py)


def _config(files, case: str, nproc: int):
    from meshfit.train.configfile import build_config

    parallel, train = {}, dict(BASE["train"])
    if nproc == 2:
        parallel = {"dp_shard": 2, "dp_replicate": 1, "zero_stage": 3} if case == "zero3" \
            else {"pp": 2, "dp_replicate": 1, "microbatches": 2} if case == "pp" \
            else {"dp_replicate": 2}
    if case == "micro4":
        train["micro_batch_size"] = 4
    packing = case.startswith("packed")
    if case.startswith(("packed", "long")):  # rows long enough to hold several examples
        # (3 steps of 4 rows stay within the first epoch of the packed rows)
        train.update(seq_len=240, global_batch_size=4, micro_batch_size=1,
                     eval_batches=100)  # every validation row: the same examples either way
        if nproc == 2:
            parallel = {"dp_shard": 2, "dp_replicate": 1, "zero_stage": 3} \
                if case.endswith("zero3") else {"dp_replicate": 2}
    peft = {"method": "lora", "r": 4, "merge": True} if case == "lora" else {}
    if case == "lora":
        parallel = {"dp_shard": 2, "dp_replicate": 1, "zero_stage": 3}
    return build_config({**BASE, "train": train, "parallel": parallel, "peft": peft,
                         "model": {"hf_model": str(files / "model")},
                         "data": {"format": "chat", "hf_dataset": str(files / "convs"),
                                  "tokenizer": str(files / "llama3"), "packing": packing,
                                  "cache_dir": str(files / "cache")}})


def _train_two(rank, world_size, files):
    from meshfit.distributed import init
    from meshfit.train.trainer import train

    env = init()
    for case in ("ddp", "zero3", "pp", "lora", "packed-ddp", "packed-zero3"):
        train(_config(files, case, world_size), files / f"{case}-2", env)


def _losses(folder):
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x], [x["val_loss"] for x in lines
                                                        if "val_loss" in x]


@pytest.fixture(scope="module")
def runs(files):
    """Chat fine-tuning of the pretrained folder: DDP and ZeRO-3 on 2 processes, and one
    process with micro-batches of 2 (4 accumulated) and of 4 (2 accumulated)."""
    from meshfit.distributed import init
    from meshfit.train.trainer import train

    run_distributed(_train_two, 2, files, timeout=300)
    for case in ("one", "micro4", "packed", "long"):
        train(_config(files, case, 1), files / f"{case}-1", init())
    return files


def test_packed_rows_train_alike_under_every_layout_and_score_as_unpacked(runs):
    """Packing: one process, DDP and ZeRO-3 log the same losses; before any training the
    validation loss of the packed rows equals that of the same examples one per row (each
    packed example attends to itself only); the rows hold several examples each."""
    from meshfit.train import tokens

    packed, pvals = _losses(runs / "packed-1")
    for case in ("packed-ddp-2", "packed-zero3-2"):
        losses, vals = _losses(runs / case)
        for a, b in zip(packed + pvals, losses + vals):
            assert math.isclose(a, b, rel_tol=RTOL), (case, packed + pvals, losses + vals)
    _, uvals = _losses(runs / "long-1")
    assert pvals[0] == pytest.approx(uvals[0], rel=RTOL)
    splits = tokens.load_tokens(_config(runs, "packed", 1))
    assert splits.stats["packing"] and splits.stats["rows"][0] < splits.stats["train"] / 1.5


def test_every_layout_and_micro_batch_size_weighs_each_trained_token_alike(runs):
    """The runs (one process at two micro-batch sizes, DDP, ZeRO-3, a 2-stage pipeline) log
    the same losses. (A mean of micro-batch means would differ between
    micro-batch sizes by the share of trained tokens each micro-batch holds.) The first
    validation loss is the folder's own model on the validation conversations' assistant
    tokens."""
    import transformers

    from meshfit.train import tokens

    files = runs
    one, val = _losses(files / "one-1")
    assert len(one) == 3 and one[-1] != one[0]
    for case in ("micro4-1", "ddp-2", "zero3-2", "pp-2"):
        losses, vals = _losses(files / case)
        for a, b in zip(one + val, losses + vals):
            assert math.isclose(a, b, rel_tol=RTOL), (case, one + val, losses + vals)
    splits = tokens.load_tokens(_config(files, "one", 1))
    model = transformers.LlamaForCausalLM.from_pretrained(files / "model")
    assert val[0] == pytest.approx(_trained_token_loss(model, splits.val), rel=RTOL)


def _trained_token_loss(model, rows) -> float:
    """A transformers model's mean cross-entropy over the trained targets of `rows`."""
    total = count = 0.0
    with torch.no_grad():
        for i in range(len(rows)):
            x, y = rows[i]
            logits = model(input_ids=x[None]).logits[0]
            total += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
            count += (y != -100).sum().item()
    return total / count


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt-rope", "gpt-learned"])
def test_a_packed_row_computes_each_example_as_alone(family):
    """fp64: the summed loss and the gradients of a row packing three examples (and padding)
    equal the sums over the examples run one by one, for the transformers families and the
    reference GPT (RoPE or learned positions): positions restart per example, no token
    attends across."""
    from meshfit.data.examples import _rows
    from meshfit.train.models import loss_function

    if family.startswith("gpt"):
        from reference import tiny_gpt

        model = tiny_gpt(pos=family.removeprefix("gpt-"))  # fp64
    else:
        import transformers

        cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[family]
        config = cls[0](hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=2, vocab_size=64,
                        max_position_embeddings=64)
        torch.manual_seed(0)
        model = cls[1](config).double()
    g = torch.Generator().manual_seed(1)
    examples = []
    for n in (7, 11, 5):
        ids = torch.randint(0, 64, (n,), generator=g).tolist()
        examples.append((ids, [0, 0] + [1] * (n - 2)))
    packed, _ = _rows(examples, seq_len=30, pad_id=0, what="training", packing=True)
    assert len(packed) == 1  # 23 tokens of examples, 8 of padding
    loss = loss_function(model)
    x, y, pos = (t[None] for t in packed[0])
    total = loss(model, x, y, pos) * (y != -100).sum()
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = 0.0
    for ids, mask in examples:
        row = torch.tensor(ids)[None]
        target = torch.where(torch.tensor(mask[1:]).bool(), row[0, 1:], -100)[None]
        alone = alone + loss(model, row[:, :-1], target) * (target != -100).sum()
    alone.backward()
    assert total.item() == pytest.approx(alone.item(), rel=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("args, match", [
    (["--data.format=chat", "--data.messages_column=turns"],
     "data.messages_column='turns' is not a column of data.hf_dataset"),
    (["--data.format=completion", "--data.completion_column=answer"],
     "data.completion_column='answer' is not a column"),
    (["--data.format=chat", "--data.tokenizer=bytes"], "needs a Hugging Face tokenizer"),
    (["--data.format=chat", "--train.seq_len=8"], "raise train.seq_len"),
    (["--data.format=dialogue"], "data.format='dialogue' must be one of"),
    (["--data.chat_template=x.jinja"], "apply to data.format='completion' or 'chat'"),
    (["--data.format=chat", "--data.packing=true", "--parallel.tp=2",
      "--parallel.dp_replicate=1"], "data.packing=true does not run with parallel.pp=1, tp=2"),
])
def test_bad_fine_tuning_data_is_refused_before_launch(cli_refusal, files, tmp_path, args,
                                                       match):
    tokenizer = [] if any(a.startswith("--data.tokenizer") for a in args) else [
        f"--data.tokenizer={files / 'llama3'}"]
    line = cli_refusal("train", "--nproc", "2", "--out", str(tmp_path / "run"),
                       f"--model.hf_model={files / 'model'}",
                       f"--data.hf_dataset={files / 'rows.jsonl'}", *tokenizer,
                       f"--data.cache_dir={files / 'cache'}", "--train.global_batch_size=4",
                       "--train.micro_batch_size=2", *args)
    assert match in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}],
     "role 'bot' is not one of system, user, assistant, tool"),
    ([{"role": "user", "content": "hi"}], "has no assistant turn"),
    ("hello", "must be a non-empty list"),
    # what the template would render as Python prints it, or fail on with a jinja traceback
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": 4}],
     "message 0: content 3 is int, not text; write it as a string"),
    ([{"role": "user", "content": [{"type": "image", "url": "cat.png"}]},
      {"role": "assistant", "content": "a cat"}], "message 0: content part {'type': 'image'"),
    ([{"role": "user", "content": None}, {"role": "assistant", "content": "b"}],
     "message 0: a 'user' message without content"),
    # Llama 3's template (TRL's training version) leaves tool calls out: the turn would be
    # trained as its (empty) text alone
    ([{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None,
      "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {}}}]},
      {"role": "tool", "content": "sun"}, {"role": "assistant", "content": "sunny"}],
     "message 1: the assistant's tool_calls, which the chat template does not render"),
    # a template that refuses the conversation (raise_exception): its reason, in one line
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
      {"role": "assistant", "content": "c"}], "the chat template cannot render this "
     "conversation (TemplateError: roles must alternate)"),
])
def test_bad_conversations_are_named_by_row(files, tmp_path, messages, match):
    """A conversation the template cannot render as written is one line naming the file,
    the row (and message) and the fix, before anything is trained; not a jinja traceback,
    and not rendered as Python prints the content."""
    from meshfit.data import DataSpec
    from meshfit.data.examples import load_examples
    from meshfit.data.tokenizer import load_tokenizer

    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": messages}) + "\n")
    alternate = ("{% for m in messages %}{% if (m['role'] == 'user') != loop.index0 is even %}"
                 "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['role'] }}: "
                 "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                 "assistant: {% endif %}")
    spec = DataSpec(format="chat", hf_dataset=str(path),
                    chat_template=alternate if "alternate" in match else "")
    with pytest.raises(ValueError, match=re.escape(match)) as err:
        load_examples(spec, tokenizer=load_tokenizer(str(files / "llama3")), seq_len=32,
                      val_fraction=0.02)
    assert str(err.value).startswith(f"data.hf_dataset='{path}', row 1")
    assert "\n" not in str(err.value)


def _rows_of(spec, tokenizer, seq_len=96) -> list[tuple[list[int], list[int]]]:
    """Each training row's (ids, mask) without padding."""
    from meshfit.data.examples import load_examples

    splits = load_examples(spec, tokenizer=tokenizer, seq_len=seq_len, val_fraction=0.02)
    d = splits.train
    return [(d.ids[i, :n].tolist(), d.mask[i, :n].tolist()) for i, n in enumerate(d.lengths)]


def test_chat_content_renders_as_the_template_intends(files, tmp_path):
    """OpenAI-style content parts and tool calls, as the chat template means them: a text
    model's template (Llama 3's, TRL's training version: it concatenates the content) gets the
    parts' texts joined by newlines, the tokens of the same conversation written as strings;
    a template that loops over parts (Qwen2.5-VL's) gets them as they are, its own rendering
    of them; Qwen2.5's template renders the assistant's tool call, and the call is trained."""
    import trl

    from meshfit.data import DataSpec
    from meshfit.data.examples import training_template
    from meshfit.data.tokenizer import load_tokenizer

    def write(name, rows):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [*rows, rows[0]]))
        return str(path)

    parts = [{"role": "user", "content": [{"type": "text", "text": "alpha beta"},
                                          {"type": "text", "text": "gamma"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "delta"}]}]
    strings = [{"role": "user", "content": "alpha beta\ngamma"},
               {"role": "assistant", "content": "delta"}]
    llama3 = load_tokenizer(str(files / "llama3"))
    got = _rows_of(DataSpec(format="chat", hf_dataset=write("parts", [parts])), llama3)
    want = _rows_of(DataSpec(format="chat", hf_dataset=write("strings", [strings])), llama3)
    assert got == want and "alpha beta\ngamma" in llama3.hf.decode(got[0][0])

    qwen = load_tokenizer(str(files / "qwen"))
    vl = Path(trl.__file__).parent / "chat_templates" / "qwen2_5_vl.jinja"
    (ids, mask), = _rows_of(DataSpec(format="chat", hf_dataset=write("vl", [parts]),
                                     chat_template=str(vl)), qwen)
    assert ids == qwen.hf.apply_chat_template(parts, chat_template=vl.read_text(),
                                              tokenize=True, return_dict=False)
    assert qwen.hf.decode([i for i, m in zip(ids, mask) if m]).startswith("delta")

    call = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "sun"}, {"role": "assistant", "content": "sunny"}]
    (ids, mask), = _rows_of(DataSpec(format="chat", hf_dataset=write("call", [call])), qwen,
                            seq_len=256)
    template, _ = training_template(qwen.hf, None)
    assert ids == qwen.hf.apply_chat_template(call, chat_template=template, tokenize=True,
                                              return_dict=False)
    trained = qwen.hf.decode([i for i, m in zip(ids, mask) if m])
    assert '"name": "get_weather"' in trained and "sunny" in trained
    assert "weather?" not in trained


def test_a_tokenizer_without_a_chat_template_is_refused(files, tmp_path):
    import transformers

    from meshfit.train.configfile import build_config
    from meshfit.train.tokens import load_tokens

    tok = transformers.AutoTokenizer.from_pretrained(files / "llama3")
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "plain")
    cfg = build_config({"data": {"format": "chat", "hf_dataset": str(files / "rows.jsonl"),
                                 "tokenizer": str(tmp_path / "plain")}})
    with pytest.raises(ValueError, match="has no chat template; give one with "
                                         "data.chat_template"):
        load_tokens(cfg)


def test_lora_chat_fine_tuning_under_zero3_writes_what_peft_and_transformers_load(runs):
    """The example of docs/fine-tuning.md in small: LoRA on the pretrained folder, chat
    data, ZeRO-3 on 2 processes. The adapter (onto the folder) and the merged model both give the run's last
    val_loss on the validation conversations' assistant tokens; the first val_loss is the
    folder's own (the adapters start at zero)."""
    import peft
    import transformers

    from meshfit.train import tokens

    _, vals = _losses(runs / "lora-2")
    _, full = _losses(runs / "one-1")
    assert vals[0] == pytest.approx(full[0], rel=RTOL) and vals[-1] != vals[0]
    splits = tokens.load_tokens(_config(runs, "lora", 2))

    def val_loss(model):
        return _trained_token_loss(model, splits.val)

    base = transformers.LlamaForCausalLM.from_pretrained(runs / "model")
    adapted = peft.PeftModel.from_pretrained(base, runs / "lora-2" / "adapter")
    assert val_loss(adapted) == pytest.approx(vals[-1], rel=RTOL)
    merged = transformers.LlamaForCausalLM.from_pretrained(runs / "lora-2" / "model")
    assert val_loss(merged) == pytest.approx(vals[-1], rel=RTOL)
    assert (runs / "lora-2" / "model" / "chat_template.jinja").is_file() or \
        "chat_template" in (runs / "lora-2" / "model" / "tokenizer_config.json").read_text()


def test_eval_and_generate_chat_on_a_chat_run(runs, capsys):
    """`meshfit eval RUN` gives the run's last val_loss on its validation conversations;
    `meshfit generate RUN --chat` puts the prompt through the saved tokenizer's template as
    the user's turn, the generation prompt last."""
    import transformers

    from meshfit.cli.main import main
    from meshfit.generate import chat_prompt_ids, load_model

    files = runs
    run = files / "one-1"
    assert main(["eval", str(run)]) == 0
    said = capsys.readouterr().out
    _, vals = _losses(run)
    assert float(said.split()[1]) == pytest.approx(vals[-1], rel=1e-5)
    assert main(["generate", str(run), "--chat", "--prompt", "alpha beta",
                 "--max-new-tokens", "4", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("user: alpha beta\nassistant: ")
    _, tokenizer, _, _ = load_model(str(run), "cpu")
    tok = transformers.AutoTokenizer.from_pretrained(files / "llama3")
    expected = tok.apply_chat_template([{"role": "user", "content": "alpha beta"}],
                                       add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
    assert chat_prompt_ids(tokenizer, "alpha beta") == list(expected)
