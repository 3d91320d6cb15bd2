"""Muon (`optimizer="muon"`, `meshfit.optim.Muon`) on every layout against one process
running torch.optim.Muon + torch.optim.AdamW, in fp64, and its refusals.

The model: the reference GPT with 2 blocks of width 64 (tied embedding/head), in fp64; for
expert parallelism both blocks are mixtures of 4 experts (3-D stacked weights, top-2,
auxiliary losses off so that the one-process loss is the whole batch's mean). Training: 2
optimizer steps on 2 sequences per data-parallel rank. The split: Muon (lr 0.02) for every
block matrix, AdamW (lr 1e-2) for the embeddings and the 1-D parameters, weight decay on
matrices. The reference: torch.optim.Muon on the block matrices (for 3-D expert weights, one
2-D leaf per expert, stepped by torch.optim.Muon and copied back), torch.optim.AdamW on the
rest, the whole global batch in one process.

Tolerance (the arithmetic of tests/reference.py): a layout's gradients differ from the
reference by ~1e-16 relative (the same sums in another order). Muon's Newton-Schulz runs in
bfloat16 (torch.optim.Muon's choice) on the momentum rounded to bfloat16, which removes
those differences except where an element lies within 1e-16 relative of a bfloat16 rounding
boundary (probability ~1e-16 / 2^-8 = 3e-14 per element per step; 2 steps x 3e4 Muon
elements: 2e-9 per run), so Muon's parameters move by what their fp64 multiply-add rounds
(1e-16 x |theta|); AdamW's part moves by at most lr dg / eps = 2e-10 in 2 steps (worst
case, tests/reference.py). Measured: 2.0e-13 at most (tensor parallel; 3.4e-14 for the
others), losses 1.6e-16 relative at most; PARAM_ATOL = 1e-11 as the other layout tests,
9 orders below a real mistake (measured on this model: each rank orthogonalising its own
shard instead of the whole matrix moves the parameters by 1.7e-2 under ZeRO-3 and 1.5e-2
under tensor parallelism, the second loss by 1.2e-4 relative).
"""

from __future__ import annotations

import pytest
import torch

from conftest import case_result, run_cases
from reference import tiny_gpt, token_batches
from meshfit import Accelerator, ParallelDims, optim

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ, PER_RANK, STEPS = 16, 2, 2
LR, MUON_LR, WD = 1e-2, 0.02, 0.1
PARAM_ATOL, LOSS_RTOL = 1e-11, 1e-12
MOE = dict(n_experts=4, top_k=2, shared_experts=1, aux_loss_coef=0.0,
           router_z_loss_coef=0.0)


def _model(moe: bool = False):
    return tiny_gpt(n_layer=2, max_seq_len=SEQ, **(MOE if moe else {}))


def _batches(dp: int):
    x, y = token_batches(STEPS * PER_RANK * dp, SEQ)
    n = PER_RANK * dp
    return [(x[i:i + n], y[i:i + n]) for i in range(0, len(x), n)]


def _is_muon(name: str, p: torch.Tensor) -> bool:
    """The reference's split, written out: the blocks' matrices."""
    return name.startswith("layers.") and p.ndim >= 2


class _PerExpert:
    """torch.optim.Muon on 3-D stacked expert weights: one 2-D leaf per expert."""

    def __init__(self, params: list[torch.Tensor], **kwargs):
        self.params = params
        self.leaves = [[torch.nn.Parameter(p[e].detach().clone()) for e in range(len(p))]
                       for p in params]
        self.opt = torch.optim.Muon([leaf for ls in self.leaves for leaf in ls], **kwargs)

    @torch.no_grad()
    def step(self):
        for p, leaves in zip(self.params, self.leaves):
            for e, leaf in enumerate(leaves):
                leaf.copy_(p[e])
                leaf.grad = p.grad[e].clone()
        self.opt.step()
        for p, leaves in zip(self.params, self.leaves):
            for e, leaf in enumerate(leaves):
                p[e].copy_(leaf)


def _reference_optimizers(model):
    named = list(model.named_parameters())
    muon = [p for n, p in named if _is_muon(n, p)]
    adamw = [{"params": [p for n, p in named if not _is_muon(n, p) and p.ndim >= 2],
              "weight_decay": WD},
             {"params": [p for n, p in named if not _is_muon(n, p) and p.ndim < 2],
              "weight_decay": 0.0}]
    kwargs = dict(lr=MUON_LR, weight_decay=WD, momentum=0.95)
    experts = [p for p in muon if p.ndim == 3]
    return [torch.optim.Muon([p for p in muon if p.ndim == 2], **kwargs),
            *([_PerExpert(experts, **kwargs)] if experts else []),
            torch.optim.AdamW(adamw, lr=LR)]


def _reference(dp: int, moe: bool):
    model = _model(moe)
    opts = _reference_optimizers(model)
    losses = []
    for x, y in _batches(dp):
        loss = model(x, y)
        loss.backward()
        for opt in opts:
            opt.step()
        model.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _user_optimizers(model):
    """The user's own torch.optim.Muon + AdamW (over the unsharded model, before prepare)."""
    named = list(model.named_parameters())
    return [torch.optim.Muon([p for n, p in named if _is_muon(n, p)], lr=MUON_LR,
                             weight_decay=WD, momentum=0.95),
            torch.optim.AdamW(
                [{"params": [p for n, p in named if not _is_muon(n, p) and p.ndim >= 2],
                  "weight_decay": WD},
                 {"params": [p for n, p in named if not _is_muon(n, p) and p.ndim < 2],
                  "weight_decay": 0.0}], lr=LR)]


def _worker(rank, world, acc_kwargs: dict, how: str, whole: str = "owner",
            moe: bool = False):
    """how: "after" (build over the prepared model), "before" (build, then prepare with
    the model: re-pointed at the sharded parameters), "pipeline", "user" (the user's
    torch.optim.Muon + AdamW through prepare)."""
    acc = Accelerator(**acc_kwargs)
    dp, dp_rank = acc.runtime.dp_size, acc.runtime.dp_rank
    model, build = _model(moe), lambda m: optim.build(
        "muon", m, lr=LR, weight_decay=WD, muon_lr=MUON_LR, whole=whole)
    if how == "pipeline":
        model = acc.prepare_pipeline(model, schedule="1f1b", microbatches=2)
        opts = [acc.prepare(build(torch.nn.ModuleList(model.modules)))]
    elif how == "after":
        model = acc.prepare(model)
        opts = [acc.prepare(build(model))]
    else:
        made = _user_optimizers(model) if how == "user" else [build(model)]
        model, *opts = acc.prepare(model, *made)
    losses = []
    for x, y in _batches(dp):
        xr, yr = x[dp_rank::dp], y[dp_rank::dp]
        if how == "pipeline":
            loss = model.step(xr, yr)
        else:
            loss = model(xr, yr)
            acc.backward(loss)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    inner = [getattr(o, "optimizer", o) for o in opts]
    return {"losses": losses, "state": acc.get_state_dict(model),
            "optimizers": [type(getattr(o, "optim", o)).__name__ for o in inner],
            "whole": [g.get("whole") for o in inner for g in o.param_groups]}


CASES = {  # id: Accelerator keyword arguments, how the optimizer is built, whole, moe
    "ddp": ({}, "after"),
    "zero1": ({"parallel": ParallelDims(dp_shard=2), "zero_stage": 1}, "before"),
    "zero2": ({"parallel": ParallelDims(dp_shard=2), "zero_stage": 2}, "before"),
    "zero3": ({"parallel": ParallelDims(dp_shard=2), "zero_stage": 3}, "after"),
    "zero3-gather": ({"parallel": ParallelDims(dp_shard=2), "zero_stage": 3}, "after",
                     "gather"),
    "tp": ({"parallel": ParallelDims(tp=2)}, "after"),
    "tp-gather": ({"parallel": ParallelDims(tp=2)}, "after", "gather"),
    "pp": ({"parallel": ParallelDims(pp=2)}, "pipeline"),
    "ep": ({"parallel": ParallelDims(dp_shard=2, ep=2), "zero_stage": 3}, "after", "owner",
           True),
    "user-zero3": ({"parallel": ParallelDims(dp_shard=2), "zero_stage": 3}, "user"),
}
DP = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 2, "zero3-gather": 2, "tp": 1,
      "tp-gather": 1, "pp": 1, "ep": 2, "user-zero3": 2}


@pytest.fixture(scope="module")
def ranks():
    return run_cases({name: (_worker, *case) for name, case in CASES.items()}, 2,
                     timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_muon_matches_one_process(ranks, case):
    results = case_result(ranks, case)
    moe = len(CASES[case]) > 3 and CASES[case][3]
    want_losses, want = _reference(DP[case], moe)
    got = results[0]
    torch.testing.assert_close(got["losses"], want_losses, rtol=LOSS_RTOL, atol=0)
    assert set(got["state"]) == set(want)
    for key, value in got["state"].items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=PARAM_ATOL, msg=key)
    # the sharded layouts step meshfit's Muon (the user's torch.optim.Muon rebuilt as it)
    if case == "user-zero3":
        assert got["optimizers"] == ["Muon", "AdamW"]
        assert got["whole"][0] == "owner"
