"""Workers of the tensor-parallel family matrix (tests/parallel/test_tp_families.py), in a
module of their own so that test_tp.py's spawn can run them beside its own cases.

Every rank builds the tiny fp64 model of each family (`meshfit.models.families`) from one
seed, keeps a deep copy as the one-process reference, lays the other out with meshfit's
plan for it (`plan_for`: the general transformers path) and trains both for 3 AdamW steps on
the same batch; the loss is the float64 cross-entropy of the logits (`tp_cross_entropy`,
vocabulary-parallel under loss parallel; the one-process reference takes the same path on
its plain logits), not transformers' own, which upcasts to float32.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from reference import token_batches
from meshfit.models.families import tiny_model
from meshfit.parallel.tp import apply_tp, tp_cross_entropy

STEPS, B, T, VOCAB, LR = 3, 2, 8, 128, 1e-3

# Parts of some families compute in float32 in the one-process model too: Gemma's norms
# (``x.float()`` in Gemma2RMSNorm / Gemma3RMSNorm), DeepSeek-V3's and GLM-4-MoE's routers
# (``hidden_states.type(torch.float32)``). A 1e-16 difference in their input, or a gradient
# summed in another order, rounds to a different float32 value where it straddles a rounding
# boundary (2^-24 relative), so these families are held to float32's bound, not float64's.
# Measured: losses <= 3.6e-10 relative, weights <= 3.5e-9 (Gemma 3's k_proj; tp2 x ZeRO-3:
# DeepSeek-V3's router 2.1e-9); the float64 families <= 4e-16 and 5.3e-14. A layout mistake
# misses by far more (Qwen3 / Gemma 3 with their per-head q/k norms replicated, their
# gradient not summed over the ranks: weights 4.7e-3 / 5.7e-3 apart).
FLOAT32 = ("gemma2", "gemma3_text", "deepseek_v3", "glm4_moe")
RTOL = ATOL = 1e-10  # fp64, 3 AdamW steps at lr 1e-3: S lr dg / eps = 3e-11
F32_LOSS_RTOL, F32_ATOL = 1e-6, 1e-6


def _train(model, x, y, steps: int = STEPS) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        loss = tp_cross_entropy(model(input_ids=x, use_cache=False).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def weight_gaps(model, ref) -> tuple[str, float, int]:
    """(name, gap) of the parameter farthest from the reference's, and how many compared."""
    theirs = dict(ref.named_parameters())
    gaps = {n: (_full(p.detach()) - theirs[n].detach()).abs().max().item()
            for n, p in model.named_parameters()}
    worst = max(gaps, key=gaps.get)
    return worst, gaps[worst], len(gaps)


def families_tp(rank, world_size, families, sp: bool, lp: bool, root: str | None = None):
    """Worker: each family under tp=world_size (sequence / loss parallel as given) against
    one process: {family: dict(ref=losses, tp=losses, worst=(name, gap, n))}. With `root`:
    also the trained tp model's logits on a probe (`logits`), and rank 0 writes its folder
    (`save_model_folder`, what `meshfit train` writes) to root/<family> for
    `from_pretrained`."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    x, y = token_batches(B, T, VOCAB, seed=1)
    y[0, 3] = -100  # an ignored target: both losses must skip it alike
    out = {}
    for family in families:
        model = tiny_model(family, seed=0)
        ref = copy.deepcopy(model)
        apply_tp(model, mesh, sequence_parallel=sp, loss_parallel=lp)
        out[family] = dict(ref=_train(ref, x, y), tp=_train(model, x, y),
                           worst=weight_gaps(model, ref))
        if root is not None:
            out[family]["logits"] = _export(rank, model, f"{root}/{family}")
            out[family]["folder"] = f"{root}/{family}"
    return out


def _export(rank: int, model, folder: str) -> torch.Tensor:
    """The tp model's logits on a probe; rank 0 writes its gathered weights as a folder."""
    from meshfit.checkpoint.saved import save_model_folder

    probe = token_batches(2, T, VOCAB, seed=5)[0]
    with torch.no_grad():
        logits = _full(model(input_ids=probe, use_cache=False).logits).clone()
        state = {k: _full(v.detach()) for k, v in model.state_dict().items()}
    if rank == 0:
        save_model_folder(folder, state, model)
    torch.distributed.barrier()
    return logits


def lora_tp(rank, world_size, family: str):
    """Worker: LoRA (meshfit.peft.lora, every block linear) on `family` under tp with
    sequence parallel, 3 AdamW steps on the adapters, B drawn non-zero (so A trains from the
    first step), against the same in one process: losses and the final adapter weights."""
    from meshfit.peft import lora

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    x, y = token_batches(B, T, VOCAB, seed=1)
    ref = lora(tiny_model(family, seed=0), r=2)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    model = copy.deepcopy(ref)
    apply_tp(model, mesh, sequence_parallel=True)
    adapters = sum(1 for n, p in model.named_parameters() if p.requires_grad)
    adapted = sum(1 for n, m in ref.named_modules() if hasattr(m, "lora_A"))
    return dict(ref=_train(ref, x, y), tp=_train(model, x, y), adapters=adapters,
                adapted=adapted, worst=weight_gaps(model, ref))


def lora_families_tp(rank, world_size, families):
    """Worker: `lora_tp` for each family: {family: its result}."""
    return {family: lora_tp(rank, world_size, family) for family in families}


def zero3_tp_export(rank, world_size, families, root: str, exported: tuple):
    """Worker on 4 ranks: tp=2 x ZeRO-3 (dp_shard=2) through the Accelerator, each data rank
    its half of each step's global batch; per family the losses, the full state dict and,
    for the `exported` families, the trained model's logits on a probe with its folder
    written by `save_model_folder` (what `meshfit train` writes) for `from_pretrained`."""
    from meshfit import Accelerator, ParallelDims
    from meshfit.checkpoint.saved import save_model_folder

    gx, gy = token_batches(STEPS * 2 * B, T, VOCAB, seed=1)
    probe = token_batches(2, T, VOCAB, seed=5)[0]
    out = {}
    for family in families:
        acc = Accelerator(parallel=ParallelDims(dp_shard=2, tp=2, dp_replicate=1),
                          zero_stage=3, sequence_parallel=True)
        model = acc.prepare(tiny_model(family, seed=0))
        opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=LR))
        losses = []
        for step in range(STEPS):
            rows = slice(step * 2 * B + acc.runtime.dp_rank * B,
                         step * 2 * B + (acc.runtime.dp_rank + 1) * B)
            loss = tp_cross_entropy(model(input_ids=gx[rows], use_cache=False).logits, gy[rows])
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(acc.reduce(loss.detach(), reduction="mean").item())
        state = acc.get_state_dict(model)
        res = {"losses": losses, "state": state}
        if family in exported:
            with torch.no_grad():
                res["logits"] = _full(model(input_ids=probe, use_cache=False).logits).clone()
            if rank == 0:
                save_model_folder(f"{root}/{family}", state, acc.unwrap_model(model))
            torch.distributed.barrier()
        out[family] = res
    return out


def phimoe_tp(rank, world_size):
    """Worker: PhiMoE (its router an `nn.Linear` subclass whose forward routes and returns a
    tuple: a style that redistributes a linear's output cannot take it) under tp=2 + SP
    against one process, as `families_tp` compares the families. In eval mode: PhiMoE's
    training-mode routing samples (sparsemixer's exponential noise), its eval routing does
    not, and the gradients are the same functions of the weights either way."""
    import transformers

    from meshfit.models.families import shrink_config

    config = shrink_config(transformers.PhimoeConfig(), vocab_size=VOCAB)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float64, experts_implementation="eager").eval()
    ref = copy.deepcopy(model)
    apply_tp(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)),
             sequence_parallel=True, loss_parallel=True)
    x, y = token_batches(B, T, VOCAB, seed=1)
    return dict(ref=_train(ref, x, y), tp=_train(model, x, y), worst=weight_gaps(model, ref))
