"""What the tests compare layouts against: small models built from one seed, token batches,
and the single-process training run every layout must reproduce.

Every model here is built the same way on every rank and in the parent process (one seed, no
global RNG dependence where it matters), so a spawned rank and the reference start from
identical weights.

How far a correct layout may stray from the reference, in float64 (the layout tests compare
in fp64 because in fp32 Adam turns an all-reduce's 1e-8 rounding noise into 1e-4 parameter
differences, as large as some real mistakes):

- A layout computes the same sums in another order: per operation the result moves by up to
  u = 1.1e-16 (fp64 unit roundoff) relative to the sum of the magnitudes of its terms. On the
  path to one gradient element there are at most k ~ 100 such order-sensitive operations in
  these test models (<= 64 tokens per matmul reduction, <= 8 blocks of backward, the
  cross-rank all-reduce or reduce-scatter, micro-batch accumulation), and the terms' magnitudes
  add up to G ~ 1e-2 (the largest gradient elements here are ~1e-2). So a gradient element moves by
  dg <= k u G ~ 1e-16 — first-step gradients and losses agree to ~1e-16 relative (measured:
  <= 6e-16).
- AdamW then divides by sqrt(v) + eps: the derivative of g / (|g| + eps) is eps / (|g| + eps)^2
  <= 1 / eps, so an element whose gradient is near eps = 1e-8 (or zero in exact arithmetic,
  like an attention key bias's: softmax ignores a constant added to one query's scores) turns
  dg into a step difference of up to lr dg / eps, while elements with |g| >> eps move by only
  lr dg / |g|. After S steps: |d theta| <= S lr dg / eps, i.e. 3e-10 for 3 steps at lr 1e-2 and
  1.5e-10 for 5 steps at lr 3e-3 — a worst case (every rounding aligned, the element at
  Adam's most sensitive point at every step) that the measurements stay 2-3 orders below.
- The tolerances are set one to two orders of magnitude above the largest difference measured
  over 5 runs with different seeds (each test states its numbers), and far below what a real
  layout mistake gives (a missing all-reduce, a batch seen twice, an unsummed tied copy:
  1e-3 to 1e-1, measured where each test says).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.nn.functional as F

from meshfit.models import GPT, GPTConfig

VOCAB = 256


def tiny_gpt(*, n_layer: int = 2, d_model: int = 64, n_head: int = 4, d_ff: int = 128,
             max_seq_len: int = 32, dtype: torch.dtype = torch.float64, seed: int = 0,
             **overrides) -> GPT:
    """The reference GPT at test size, weights from `init_weights(Generator(seed))` (the
    values a meta-device model materialises per pipeline stage with the same seed)."""
    cfg = GPTConfig(vocab_size=VOCAB, n_layer=n_layer, n_head=n_head, d_model=d_model,
                    d_ff=d_ff, max_seq_len=max_seq_len, **overrides)
    model = GPT(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.to(dtype)


def tiny_preset(*, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> GPT:
    """The full `tiny` preset (0.86M parameters at 4 blocks; what `meshfit train` trains by
    default), GPT's own init after ``torch.manual_seed(seed)``, fields replaced by
    `overrides`. For tests that need activations and parameters of a realistic ratio
    (memory, compile, optimizers) rather than `tiny_gpt`'s test size."""
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", **overrides)).to(dtype)


def hf_llama(*, n_layer: int = 2, seed: int = 0, dtype: torch.dtype = torch.float64):
    """Hugging Face `LlamaForCausalLM` at test size (GQA: 4 heads, 2 key/value heads)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=n_layer, vocab_size=VOCAB,
                                   max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def hf_gpt2(*, n_layer: int = 2, seed: int = 0, dtype: torch.dtype = torch.float64):
    """Hugging Face `GPT2LMHeadModel` at test size (tied head, fused q|k|v), no dropout."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=n_layer, n_head=4, n_inner=128,
                                  vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


def hf_qwen2(*, n_layer: int = 2, seed: int = 0, dtype: torch.dtype = torch.float64):
    """Hugging Face `Qwen2ForCausalLM` at test size (as `hf_llama`: GQA with 4 heads and 2
    key/value heads; Qwen2 adds biases to q/k/v). Not in `MODELS`: tests that iterate it
    cover Llama's layout already; tests/checkpoint/test_export_matrix.py uses it by name."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=n_layer, vocab_size=VOCAB,
                                   max_position_embeddings=32)
    return transformers.Qwen2ForCausalLM(cfg).to(dtype)


MODELS = {"gpt": tiny_gpt, "llama": hf_llama, "gpt2": hf_gpt2}


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of the reference GPT or a Hugging Face causal LM."""
    out = model(x) if isinstance(model, GPT) else model(input_ids=x)
    return out if isinstance(out, torch.Tensor) else out.logits


def mean_ce(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (ignore_index -100), in the logits' own dtype."""
    return F.cross_entropy(out.flatten(0, -2), targets.flatten())


def token_batches(n: int, seq_len: int, vocab_size: int = VOCAB, seed: int = 1):
    """`n` random token sequences as (inputs [n, seq_len], next-token targets [n, seq_len]),
    the same on every rank and in the single-process reference."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (n, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def step_batches(x: torch.Tensor, y: torch.Tensor, per_step: int) -> list:
    """(inputs, targets) cut into consecutive global batches of `per_step` rows, one per
    optimizer step: what the data-parallel ranks of one step see together."""
    return [(x[i:i + per_step], y[i:i + per_step]) for i in range(0, len(x), per_step)]


def reference_run(model: torch.nn.Module, batches, *, lr: float = 3e-3,
                  clip: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, one AdamW step per (inputs, targets) batch of the global batch: the
    losses and the final state dict that every layout must reproduce."""
    return reference_train(model, batches, lambda m: torch.optim.AdamW(m.parameters(), lr=lr),
                           clip=clip)


def reference_train(model: torch.nn.Module, batches, make_optimizer, *, make_scheduler=None,
                    clip: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`reference_run` with the optimizer built by ``make_optimizer(model)`` and, if given,
    a scheduler ``make_scheduler(optimizer)`` stepped after every optimizer step; the
    gradient norm clipped to `clip` over `model.parameters()` (a tied weight once)."""
    opt = make_optimizer(model)
    sched = make_scheduler(opt) if make_scheduler is not None else None
    losses = []
    for x, y in batches:
        loss = mean_ce(logits(model, x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, under the user's names: DTensors gathered (a collective, call
    it on every rank), DDP's `module.` prefix dropped."""
    return {name.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor")
                                           else p).detach().clone()
            for name, p in model.named_parameters()}


def idle_share(timings) -> float:
    """A pipeline's idle share, written out here rather than taken from meshfit.parallel.pp:
    for each step, every rank that recorded work is counted over the step's whole span
    (first start to last end on any rank) and idles for that span minus its own busy time;
    the idle time of all ranks and steps over their total span."""
    by_step = defaultdict(list)
    for t in timings:
        by_step[t["step"]].append(t)
    idle = total = 0.0
    for entries in by_step.values():
        span = max(t["end"] for t in entries) - min(t["start"] for t in entries)
        for r in {t["rank"] for t in entries}:
            busy = sum(t["end"] - t["start"] for t in entries if t["rank"] == r)
            idle, total = idle + span - busy, total + span
    return idle / total


def loss_and_grads(model: torch.nn.Module, idx: torch.Tensor, tgt: torch.Tensor | None,
                   seed: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward with the model's own loss, ``model(idx, tgt)``, and backward: the loss and
    a copy of every parameter's gradient by name. `seed` seeds the global RNG first (dropout)."""
    if seed is not None:
        torch.manual_seed(seed)
    loss = model(idx, tgt)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def forward_bytes(model: torch.nn.Module, *inputs) -> int:
    """Net bytes the CPU allocator holds after the forward pass ``model(*inputs)`` (what its
    backward will free), from the profiler's allocations minus frees; then runs backward."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(*inputs)
    loss.backward()
    return sum(e.self_cpu_memory_usage for e in prof.key_averages())


def differences(a, b, *, rtol: float, atol: float, path: str = "") -> list[str]:
    """Where two nested results (dicts, lists, tensors, floats, anything comparable with ==)
    differ: floating tensors and floats beyond `rtol`/`atol`, anything else unequal; one
    line per difference naming its path. The differential tests' comparison of a peer's
    run with meshfit's."""
    def inner(x, y, where: str) -> list[str]:
        return differences(x, y, rtol=rtol, atol=atol, path=where)

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) \
                or a.shape != b.shape or a.dtype != b.dtype:
            return [f"{path}: {a!r} vs {b!r}"]
        close = torch.allclose(a, b, rtol=rtol, atol=atol) if a.is_floating_point() \
            else torch.equal(a, b)
        return [] if close else [f"{path}: max |diff| {(a.double() - b.double()).abs().max()}"]
    if isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=rtol, abs_tol=atol) else [f"{path}: {a} vs {b}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} vs {sorted(b)}"]
        return [d for k in a for d in inner(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in inner(x, y, f"{path}[{i}]")]
    return [] if type(a) is type(b) and a == b else [f"{path}: {a!r} vs {b!r}"]
