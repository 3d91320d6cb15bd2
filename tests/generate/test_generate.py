"""Using a trained model: the reference GPT's key/value cache, sampling (`generate`), and the
`meshfit generate` / `meshfit eval` commands, in this process on tiny models."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reference import VOCAB, hf_llama, tiny_gpt

from meshfit.data import ByteTokenizer, document_separator, load_tokens
from meshfit.checkpoint.saved import save_model_folder
from meshfit.cli.main import main
from meshfit.train.configfile import build_config, to_toml
from meshfit.generate import evaluate_loss, generate, generate_ids

pytestmark = pytest.mark.usefixtures("one_thread")

LEARNED = {}
ROPE_GQA = dict(pos="rope", n_kv_head=2, mlp="swiglu", norm="rmsnorm", bias=False,
                tie_embeddings=False)
CONFIGS = {"learned": LEARNED, "rope_gqa_swiglu": ROPE_GQA}


def _prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _greedy_reference(model, prompt: torch.Tensor, n: int, ctx: int) -> list[int]:
    """Argmax decoding by a full forward over the window for every new token (no cache).
    The window follows generate's rule: when it would pass the context, it restarts from
    the last ctx // 2 tokens."""
    tokens, start = prompt.tolist(), max(0, len(prompt) - ctx)
    with torch.no_grad():
        for _ in range(n):
            out = model(torch.tensor([tokens[start:]]))
            logits = getattr(out, "logits", out)[0, -1]  # a transformers model's output
            tokens.append(int(logits.argmax()))
            if len(tokens) - start > ctx:
                start = len(tokens) - ctx // 2
    return tokens[len(prompt):]


# ------------------------------------------------------------------------ the KV cache
@pytest.mark.parametrize("name", CONFIGS)
def test_cached_decoding_equals_full_forward(name):
    """Logits of a sequence fed in pieces through the cache (a prefill, then single tokens
    and a chunk, as positions offset by the cache's length) equal one forward's: fp64."""
    model = tiny_gpt(**CONFIGS[name]).eval()
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(2)
        cuts = [0, 5, 6, 7, 19, 20, 21, 30, 31, 32]
        pieces = [model.forward_cached(x[:, a:b], cache) for a, b in zip(cuts, cuts[1:])]
    assert cache.length == 32
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-12)


def test_cache_refuses_to_overflow():
    model = tiny_gpt(max_seq_len=8).eval()
    cache = model.new_cache(1)
    with torch.no_grad():
        model.forward_cached(_prompt(6).view(1, -1), cache)
        with pytest.raises(ValueError, match="max_len=8"):
            model.forward_cached(_prompt(3).view(1, -1), cache)


# ------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_equals_argmax_of_full_forwards(name):
    model = tiny_gpt(**CONFIGS[name]).eval()
    prompt = _prompt(5)
    got = generate_ids(model, prompt, max_new_tokens=20, temperature=0)
    assert got.tolist() == _greedy_reference(model, prompt, 20, ctx=32)


def test_greedy_past_the_context_slides_the_window():
    """40 new tokens after a 12-token prompt on a 16-token context: the cache is rebuilt
    twice from the last 8 tokens, as the no-cache reference does."""
    model = tiny_gpt(max_seq_len=16, **ROPE_GQA).eval()
    prompt = _prompt(12)
    got = generate_ids(model, prompt, max_new_tokens=40, temperature=0)
    assert got.tolist() == _greedy_reference(model, prompt, 40, ctx=16)


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = tiny_gpt(**ROPE_GQA).eval()
    prompt = _prompt(4)
    a = generate_ids(model, prompt, max_new_tokens=24, temperature=1.0, seed=3)
    b = generate_ids(model, prompt, max_new_tokens=24, temperature=1.0, seed=3)
    c = generate_ids(model, prompt, max_new_tokens=24, temperature=1.0, seed=4)
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()  # near-uniform over 256 ids: 24 equal draws ~ 256**-24
    greedy = generate_ids(model, prompt, max_new_tokens=24, temperature=0)
    top1 = generate_ids(model, prompt, max_new_tokens=24, temperature=1.5, top_k=1, seed=9)
    assert top1.tolist() == greedy.tolist()
    # top_k=2: every token is one of the two most likely after its prefix
    two = generate_ids(model, prompt, max_new_tokens=12, temperature=5.0, top_k=2, seed=1)
    seq = prompt.tolist()
    with torch.no_grad():
        for token in two.tolist():
            best = model(torch.tensor([seq]))[0, -1].topk(2).indices.tolist()
            assert token in best
            seq.append(token)


def test_stops_at_eos():
    model = tiny_gpt().eval()
    prompt = _prompt(5)
    greedy = generate_ids(model, prompt, max_new_tokens=10, temperature=0).tolist()
    eos = greedy[3]
    got = generate_ids(model, prompt, max_new_tokens=10, temperature=0, eos_id=eos)
    assert got.tolist() == greedy[:greedy.index(eos)]


class _FavoursByte(torch.nn.Module):
    """A model that is not the reference GPT: its forward returns logits [B, T, 256] that
    always pick byte 0xFF, which is never valid UTF-8."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, 256) + self.w
        logits[..., 0xFF] = 1.0
        return logits


def test_plain_model_and_invalid_utf8():
    text = generate(_FavoursByte(), ByteTokenizer(), "é", max_new_tokens=3, temperature=0)
    assert text == "\ufffd" * 3
    with pytest.raises(ValueError, match="--prompt"):
        generate(_FavoursByte(), ByteTokenizer(), "", max_new_tokens=3)


# ------------------------------------------------------------------------ the commands
def _out(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 0
    return capsys.readouterr().out


def test_generate_command_on_a_transformers_model(tmp_path, capsys):
    """A tiny Llama in a model folder with the byte tokenizer: greedy output equals argmax
    decoding by full forwards; sampling is seeded; Llama's default eos_token_id (2) is not
    the byte tokenizer's, so it does not stop generation."""
    model = hf_llama(dtype=torch.float32).eval()
    folder = save_model_folder(tmp_path / "llama", model.state_dict(), model,
                               tokenizer=ByteTokenizer())
    out = _out(capsys, ["generate", str(folder), "--prompt", "ab", "--max-new-tokens", "12",
                        "--temperature", "0", "--device", "cpu"])
    expected = _greedy_reference(model, torch.tensor(list(b"ab")), 12, ctx=10**9)
    assert out == "ab" + ByteTokenizer().decode(expected) + "\n"
    sample = ["generate", str(folder), "--prompt", "ab", "--max-new-tokens", "12",
              "--temperature", "1", "--top-k", "50", "--seed", "5", "--device", "cpu"]
    first = _out(capsys, sample)
    assert first == _out(capsys, sample)
    assert first != out


@pytest.fixture
def trained_run(tmp_path):
    """A run folder as `meshfit train` leaves it: config.toml whose [data] is a folder of
    text, and model/ with a tiny GPT trained 30 steps on that text."""
    data = tmp_path / "text"
    data.mkdir()
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "x"]
    for i in range(60):
        (data / f"f{i:02d}.py").write_text(" ".join(rng.choice(words, 80)) + "\n")
    cache = tmp_path / "cache"
    cfg = build_config({"data": {"path": str(data), "cache_dir": str(cache)},
                        "train": {"seq_len": 32}})
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(cfg))
    splits = load_tokens(str(data), cache_dir=str(cache))
    torch.manual_seed(0)
    model = tiny_gpt(max_seq_len=64, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train = torch.from_numpy(np.asarray(splits.train[:4097], dtype=np.int64))
    for step in range(30):
        i = torch.randint(0, 4096 - 32, (8,))
        x = torch.stack([train[j:j + 32] for j in i])
        y = torch.stack([train[j + 1:j + 33] for j in i])
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    save_model_folder(run / "model", model.state_dict(), model, tokenizer=ByteTokenizer())
    return run, model.eval(), splits.val, data


def _reference_loss(model, tokens, seq_len: int, windows: int) -> tuple[float, int]:
    """Mean cross-entropy over the first `windows` non-overlapping windows, by hand."""
    t = torch.from_numpy(np.asarray(tokens[:windows * seq_len + 1], dtype=np.int64))
    x = torch.stack([t[i * seq_len:(i + 1) * seq_len] for i in range(windows)])
    y = torch.stack([t[i * seq_len + 1:(i + 1) * seq_len + 1] for i in range(windows)])
    with torch.no_grad():
        loss = F.cross_entropy(model(x).flatten(0, 1).double(), y.flatten())
    return loss.item(), y.numel()


def _parse(out: str) -> tuple[float, float, int]:
    m = re.fullmatch(r"loss (\S+) perplexity (\S+) on (\d+) tokens\n", out)
    assert m, out
    return float(m[1]), float(m[2]), int(m[3])


def test_eval_command_on_the_runs_validation_split(trained_run, capsys):
    run, model, val, _ = trained_run
    assert val.size > 3 * 32 + 1
    loss, ppl, n = _parse(_out(capsys, ["eval", str(run), "--batches", "3", "--batch-size", "1",
                                        "--device", "cpu"]))
    ref, ref_n = _reference_loss(model, val, 32, 3)  # the run's train.seq_len
    assert n == ref_n == 96
    assert abs(loss - ref) < 2e-6
    assert ppl == pytest.approx(math.exp(ref), rel=1e-5)
    assert loss < math.log(256) - 1.0  # trained: far below the uniform model's ln 256
    # RUN/model names the same run: same split, same numbers
    assert _parse(_out(capsys, ["eval", str(run / "model"), "--batches", "3", "--batch-size",
                                "1", "--device", "cpu"])) == (loss, ppl, n)


def test_eval_command_on_given_text(trained_run, tmp_path, capsys):
    """--data: all of the text, tokenized with the folder's tokenizer; --batches 0: every
    window."""
    run, model, _, _ = trained_run
    text = tmp_path / "held_out.txt"
    text.write_text("for x in self: return x\n" * 20)
    # one document, packed as load_tokens packs every document: followed by the separator
    ids = np.concatenate([np.frombuffer(text.read_bytes(), dtype=np.uint8),
                          np.asarray(document_separator(ByteTokenizer()), dtype=np.uint8)])
    loss, _, n = _parse(_out(capsys, ["eval", str(run / "model"), "--data", str(text),
                                      "--seq-len", "16", "--batches", "0", "--device", "cpu"]))
    windows = (ids.size - 1) // 16
    ref, ref_n = _reference_loss(model, ids, 16, windows)
    assert n == ref_n and abs(loss - ref) < 2e-6
    assert evaluate_loss(model, ids, 16, batches=0)[1] == n


def test_bad_input_is_one_line_naming_the_option(trained_run, tmp_path, cli_refusal):
    run, _, _, _ = trained_run
    model = str(run / "model")
    (tmp_path / "empty").mkdir()
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "config.toml").write_text("")
    cases = [
        (["generate", str(tmp_path / "nope"), "--prompt", "a"], "RUN_OR_MODEL="),
        (["generate", str(tmp_path / "empty"), "--prompt", "a"], "holds no model"),
        (["eval", str(tmp_path / "unfinished")], "without model/"),
        (["generate", model, "--prompt", ""], "--prompt="),
        (["generate", model, "--prompt", "a", "--max-new-tokens", "-1"], "--max-new-tokens=-1"),
        (["generate", model, "--prompt", "a", "--temperature", "-0.5"], "--temperature=-0.5"),
        (["generate", model, "--prompt", "a", "--top-k", "-3"], "--top-k=-3"),
        (["eval", model, "--seq-len", "65"], "--seq-len=65 exceeds the model's context of 64"),
        (["eval", model, "--seq-len", "-2"], "--seq-len=-2"),
        (["eval", model, "--batches", "-1"], "--batches=-1"),
        (["eval", model, "--batch-size", "0"], "--batch-size=0"),
        (["eval", model, "--data", str(tmp_path / "missing.txt")], "--data="),
    ]
    for argv, needle in cases:
        line = cli_refusal(*argv)
        assert needle in line, (argv, line)
        assert line.startswith(f"meshfit {argv[0]}: error: "), line


def test_a_lora_runs_folder_is_named_as_such(tmp_path, capsys):
    """A LoRA run writes adapter/, not model/: eval and generate say so in one line rather
    than "let it finish" (the run did finish)."""
    (tmp_path / "config.toml").write_text("")
    (tmp_path / "adapter").mkdir()
    assert main(["eval", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is a LoRA run: it wrote an adapter (adapter/)" in err, err
