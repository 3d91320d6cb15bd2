"""A trained model used: text sampled from it (``meshfit generate``) and its loss on held-out
text (``meshfit eval``); `load_model` loads what RUN_OR_MODEL names.

    model, tok = load_model_folder("runs/x/model")
    print(generate(model, tok, "def main(", max_new_tokens=200, temperature=0.8, seed=0))

The reference GPT decodes through its key/value cache (`GPT.forward_cached`; past its
`max_seq_len` the window slides: the cache is rebuilt from the last half-context tokens); a
transformers model through its own ``generate``; any other model by a full forward per new
token. Sampling: temperature 0 is greedy (argmax); otherwise the logits are divided by the
temperature, cut to the `top_k` most likely tokens when `top_k` is set (0 or None: no cut),
and one token is drawn from a generator seeded with `seed`, so the same seed gives the same
text. Decoding stops after `max_new_tokens` or at the tokenizer's end-of-sequence token
(when it has one; the byte tokenizer has none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshfit.checkpoint.saved import load_model_folder
from meshfit.data import ByteTokenizer, TokenDataset
from meshfit.distributed import cpu_requested
from meshfit.models import GPT
from meshfit.models.factory import check_folder_code
from meshfit.models.packing import packed_forward
from meshfit.train.models import is_hf
from meshfit.train.preflight import check_sampling


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def context_length(model: nn.Module) -> int | None:
    """The longest sequence the model takes: GPT's max_seq_len, a transformers config's
    max_position_embeddings / n_positions; None when unknown."""
    if isinstance(model, GPT):
        return model.config.max_seq_len
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _logits(model: nn.Module, idx: torch.Tensor,
            positions: torch.Tensor | None = None) -> torch.Tensor:
    """`positions`: of rows packing several examples (a Hugging Face model's attention is
    then kept inside each, `meshfit.models.packing.packed_forward`)."""
    if positions is not None:
        if not is_hf(model):
            raise ValueError("packed fine-tuning rows need a Hugging Face model")
        out = packed_forward(model, idx, positions)
    else:
        out = model(idx) if not is_hf(model) else model(input_ids=idx)
    return getattr(out, "logits", out)


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None,
          gen: torch.Generator) -> torch.Tensor:
    """One token id per row of logits [B, V]: argmax at temperature 0, else a draw from the
    temperature-scaled, top-k-cut softmax."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


# ---------------------------------------------------------------------------- generation
@torch.no_grad()
def generate_ids(model: nn.Module, prompt_ids, *, max_new_tokens: int = 200,
                 temperature: float = 0.8, top_k: int | None = None, seed: int = 0,
                 eos_id: int | None = None) -> torch.Tensor:
    """The new token ids (1-D int64, at most `max_new_tokens`, without the EOS token) that
    `model` appends to `prompt_ids` (1-D, at least one id). See the module docstring."""
    check_sampling(max_new_tokens, temperature, top_k)
    device = _device(model)
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).to(device)
    if prompt.numel() == 0:
        raise ValueError("the prompt encodes to no tokens; give at least one character")
    if max_new_tokens == 0:
        return prompt.new_empty(0)
    was_training = model.training
    model.eval()
    try:
        if is_hf(model):
            return _generate_hf(model, prompt, max_new_tokens, temperature, top_k, seed, eos_id)
        gen = torch.Generator(device=device).manual_seed(seed)
        if isinstance(model, GPT):
            return _generate_gpt(model, prompt, max_new_tokens, temperature, top_k, gen, eos_id)
        return _generate_plain(model, prompt, max_new_tokens, temperature, top_k, gen, eos_id)
    finally:
        model.train(was_training)


def _generate_gpt(model, prompt, max_new, temperature, top_k, gen, eos_id) -> torch.Tensor:
    ctx = model.config.max_seq_len
    tokens = prompt.tolist()
    cache = model.new_cache(1)
    logits = model.forward_cached(prompt[-ctx:].view(1, -1), cache)[:, -1]
    new: list[int] = []
    while True:
        token = int(_pick(logits, temperature, top_k, gen)[0])
        if token == eos_id:
            break
        new.append(token)
        tokens.append(token)
        if len(new) == max_new:
            break
        if cache.length < ctx:
            step = torch.tensor([[token]], device=prompt.device)
        else:  # the context is full: slide the window, rebuilding the cache from its end
            cache.reset()
            step = torch.tensor([tokens[-max(ctx // 2, 1):]], device=prompt.device)
        logits = model.forward_cached(step, cache)[:, -1]
    return torch.tensor(new, dtype=torch.long)


def _generate_plain(model, prompt, max_new, temperature, top_k, gen, eos_id) -> torch.Tensor:
    """Any model whose forward maps ids [B, T] to logits: one full forward per token."""
    ctx = context_length(model)
    seq, new = prompt.clone(), []
    for _ in range(max_new):
        window = seq if ctx is None else seq[-ctx:]
        token = int(_pick(_logits(model, window.view(1, -1))[:, -1], temperature, top_k, gen)[0])
        if token == eos_id:
            break
        new.append(token)
        seq = torch.cat([seq, seq.new_tensor([token])])
    return torch.tensor(new, dtype=torch.long)


def _generate_hf(model, prompt, max_new, temperature, top_k, seed, eos_id) -> torch.Tensor:
    """transformers' own generate, with our stopping rule: the model's saved generation
    config may name an EOS id of another tokenizer (Llama's default 2 is a byte here), so
    EOS is the tokenizer's or none; top_p is 1, so only temperature and top_k shape the
    distribution, as for the reference GPT."""
    ctx = context_length(model)
    ids = (prompt if ctx is None else prompt[-ctx:]).view(1, -1)
    saved = model.generation_config
    config = saved.__class__.from_dict(saved.to_dict())
    config.eos_token_id = eos_id
    if config.pad_token_id is None or eos_id is not None:
        config.pad_token_id = eos_id if eos_id is not None else 0
    if temperature == 0:
        sampling: dict[str, Any] = dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        sampling = dict(do_sample=True, temperature=float(temperature), top_k=top_k or 0, top_p=1.0)
    for key, value in sampling.items():
        setattr(config, key, value)
    devices = [ids.device] if ids.device.type == "cuda" else []
    model.generation_config = config
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new, min_new_tokens=0)
    finally:
        model.generation_config = saved
    new = out[0, ids.shape[1]:].cpu()
    if eos_id is not None:
        hits = (new == eos_id).nonzero()
        if len(hits):
            new = new[: int(hits[0])]
    return new.long()


def chat_prompt_ids(tokenizer, message: str) -> list[int]:
    """`message` as the user's turn of a conversation, rendered by the tokenizer's chat
    template with the generation prompt (the assistant's turn begins), as token ids."""
    hf = getattr(tokenizer, "_hf", None)
    if hf is None or not getattr(hf, "chat_template", None):
        raise ValueError("--chat needs a tokenizer with a chat template (a model fine-tuned "
                         "with data.format='chat' keeps its tokenizer's); this one has none")
    text = hf.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                  add_generation_prompt=True)
    return list(hf(text, add_special_tokens=False)["input_ids"])


def generate(model: nn.Module, tokenizer, prompt: str, *, max_new_tokens: int = 200,
             temperature: float = 0.8, top_k: int | None = None, seed: int = 0,
             chat: bool = False) -> str:
    """The text `model` writes after `prompt` (the continuation only). `tokenizer`: an
    object with ``encode(text)`` and ``decode(ids)`` (and ``eos_id`` to stop at). `chat`:
    `prompt` is the user's message, put through the tokenizer's chat template
    (`chat_prompt_ids`), and the text is the assistant's answer."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"--prompt={prompt!r} is empty; give the text to continue, e.g. "
                         "--prompt 'def main('")
    prompt_ids = torch.as_tensor(chat_prompt_ids(tokenizer, prompt) if chat else
                                 tokenizer.encode(prompt), dtype=torch.long)
    eos = getattr(tokenizer, "eos_id", None)
    new = generate_ids(model, prompt_ids, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_k=top_k, seed=seed,
                       eos_id=None if eos is None else int(eos))
    # Decoded together with the prompt, so a token that merges with the prompt's end (a
    # sentencepiece space) comes out as the tokenizer writes it; the byte tokenizer turns
    # invalid UTF-8 (a cut multi-byte character) into U+FFFD instead of raising.
    head = tokenizer.decode(prompt_ids.tolist())
    full = tokenizer.decode(prompt_ids.tolist() + new.tolist())
    return full[len(head):] if full.startswith(head) else tokenizer.decode(new.tolist())


# ---------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate_loss(model: nn.Module, tokens, seq_len: int, *, batches: int = 8,
                  batch_size: int = 8) -> tuple[float, int]:
    """(mean next-token cross-entropy in nats, number of predicted tokens) over the first
    ``batches * batch_size`` windows of `seq_len` (`meshfit.data.TokenDataset`, as
    training's validation; or a dataset of fine-tuning rows, `meshfit.data.examples`, whose
    ignored targets count nothing); batches=0: every window."""
    data = tokens if isinstance(tokens, torch.utils.data.Dataset) else \
        TokenDataset(tokens, seq_len)  # fine-tuning examples come as their rows
    n = len(data) if batches == 0 else min(len(data), batches * batch_size)
    device = _device(model)
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    try:
        for first in range(0, n, batch_size):
            pairs = [data[i] for i in range(first, min(first + batch_size, n))]
            x = torch.stack([p[0] for p in pairs]).to(device)
            y = torch.stack([p[1] for p in pairs]).to(device)
            positions = torch.stack([p[2] for p in pairs]).to(device) if len(pairs[0]) > 2 \
                else None
            logits = _logits(model, x, positions)
            if logits.dtype in (torch.float16, torch.bfloat16):
                logits = logits.float()
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            total += loss.double().cpu()
            count += int((y != -100).sum())  # prompts and padding are not predicted
    finally:
        model.train(was_training)
    return (total / count).item(), count


# ---------------------------------------------------------------------------- loading
def resolve_model(path: str) -> tuple[Path, Path | None]:
    """(model folder, run folder or None) for RUN_OR_MODEL: a run folder (its model/), a
    model folder, or a run's model/ folder (its run is the parent)."""
    p = Path(path).expanduser()
    fix = ("give a meshfit train run folder (its model/ is used) or a model folder written "
           "by save_model_folder")
    if not p.is_dir():
        raise ValueError(f"RUN_OR_MODEL={path!r} is not a folder; {fix}")
    if (p / "config.json").is_file():
        run = p.parent if p.name == "model" and (p.parent / "config.toml").is_file() else None
        return p, run
    if (p / "model").is_dir():
        return p / "model", p
    if (p / "config.toml").is_file() and (p / "adapter").is_dir():
        raise ValueError(f"RUN_OR_MODEL={path!r} is a LoRA run: it wrote an adapter (adapter/), "
                         "not a whole model; load it with meshfit.peft.load_adapter onto its "
                         "base model (eval and generate of an adapter run are not supported yet)")
    if (p / "config.toml").is_file():
        raise ValueError(f"RUN_OR_MODEL={path!r} is a run folder without model/: a run writes its "
                         "model there when training ends; let it finish, or give a model folder")
    raise ValueError(f"RUN_OR_MODEL={path!r} holds no model (no config.json, no model/); {fix}")


def load_model(path: str, device: str | None, *, trust_code: bool = False):
    """(model, tokenizer, model folder, run folder) for RUN_OR_MODEL, on `device` (default:
    cuda when available, unless MESHFIT_CPU=1). Code the folder's config.json names (a
    factory, transformers' remote code) runs only with `trust_code` (``--trust-code``):
    before that, one line naming it (`meshfit.models.factory.check_folder_code`)."""
    folder, run = resolve_model(path)
    check_folder_code(folder, trust_code=trust_code, field="RUN_OR_MODEL", how="--trust-code")
    cpu = cpu_requested(None) or not torch.cuda.is_available()
    try:
        device = torch.device(device or ("cpu" if cpu else "cuda"))
    except RuntimeError:
        raise ValueError(f"--device={device!r} is not a device; use cpu, cuda or cuda:N") from None
    try:
        model, tokenizer = load_model_folder(folder, device=device, trust_code=trust_code)
    except Exception as err:  # a file cut short, not safetensors, another library's error
        if type(err).__name__ != "SafetensorError" and not isinstance(err, OSError):
            raise
        text = " ".join(str(err).split())
        raise ValueError(f"RUN_OR_MODEL={path!r}: the weights in {folder} cannot be read "
                         f"({text}); the file is damaged or incomplete: export or copy the "
                         "model again") from None
    if tokenizer is None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab != 256:
            raise ValueError(f"RUN_OR_MODEL={path!r}: {folder} holds no tokenizer files and "
                             f"the model's vocabulary ({vocab}) is not bytes; save the model "
                             "with save_model_folder(..., tokenizer=...)")
        tokenizer = ByteTokenizer()  # a 256-token model without tokenizer files: bytes
    return model, tokenizer, folder, run
