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


def _model(kind: str = "dense"):
    """"dense", "moe" (both blocks mixtures of experts) or "uneven" (d_ff 129: the MLP's
    matrices split 65 + 64 rows by FSDP2, an uneven shard on the owner's receiving end)."""
    extra = {"dense": {}, "moe": MOE, "uneven": {"d_ff": 129}}[kind]
    return tiny_gpt(n_layer=2, max_seq_len=SEQ, **extra)


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


def _reference(dp: int, kind: str):
    model = _model(kind)
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
            kind: str = "dense", bucket: int | None = None):
    """how: "after" (build over the prepared model), "before" (build, then prepare with
    the model: re-pointed at the sharded parameters), "pipeline", "user" (the user's
    torch.optim.Muon + AdamW through prepare). `bucket`: Muon's bucket of local elements
    (small: several rounds of owners per step)."""
    import meshfit.optim.muon as muon_module
    import meshfit.optim.muon_whole as whole_module

    muon_module.BUCKET_ELEMENTS = bucket or 2**25
    calls = {"owner": 0, "gather": 0}
    originals = {fn: getattr(whole_module, fn) for fn in ("_by_owner", "_gathered")}
    for key, fn in (("owner", "_by_owner"), ("gather", "_gathered")):
        def counted(*args, _key=key, _fn=originals[fn]):
            calls[_key] += 1
            return _fn(*args)
        setattr(whole_module, fn, counted)
    try:
        return _train(acc_kwargs, how, whole, kind, calls)
    finally:  # the next case in this process starts from the real functions
        for fn, original in originals.items():
            setattr(whole_module, fn, original)


def _train(acc_kwargs: dict, how: str, whole: str, kind: str, calls: dict) -> dict:
    acc = Accelerator(**acc_kwargs)
    dp, dp_rank = acc.runtime.dp_size, acc.runtime.dp_rank
    model, build = _model(kind), lambda m: optim.build(
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
    return {"losses": losses, "state": acc.get_state_dict(model), "calls": dict(calls),
            "optimizers": [type(getattr(o, "optim", o)).__name__ for o in inner],
            "whole": [g.get("whole") for o in inner for g in o.param_groups]}


CASES = {  # id: Accelerator keyword arguments, how the optimizer is built, whole, model kind,
    # Muon bucket (local elements)
    "ddp": ({}, "after"),
    "zero1": ({"parallel": ParallelDims(dp_shard=2), "zero_stage": 1}, "before"),
    "zero2": ({"parallel": ParallelDims(dp_shard=2), "zero_stage": 2}, "before"),
    "zero3": ({"parallel": ParallelDims(dp_shard=2), "zero_stage": 3}, "after"),
    "zero3-gather": ({"parallel": ParallelDims(dp_shard=2), "zero_stage": 3}, "after",
                     "gather"),
    # 6,000 local elements per bucket (half of each matrix on a rank): per block
    # [wq, wk] [wv, wo] [w_in] [w_out], 8 rounds of owners per step, balanced over them
    "zero3-buckets": ({"parallel": ParallelDims(dp_shard=2), "zero_stage": 3}, "after",
                      "owner", "dense", 6000),
    "zero3-uneven": ({"parallel": ParallelDims(dp_shard=2), "zero_stage": 3}, "after",
                     "owner", "uneven"),
    "tp": ({"parallel": ParallelDims(tp=2)}, "after"),
    "tp-gather": ({"parallel": ParallelDims(tp=2)}, "after", "gather"),
    "pp": ({"parallel": ParallelDims(pp=2)}, "pipeline"),
    "ep": ({"parallel": ParallelDims(dp_shard=2, ep=2), "zero_stage": 3}, "after", "owner",
           "moe"),
    "user-zero3": ({"parallel": ParallelDims(dp_shard=2), "zero_stage": 3}, "user"),
}
DP = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 2, "zero3-gather": 2, "zero3-buckets": 2,
      "zero3-uneven": 2,
      "tp": 1,
      "tp-gather": 1, "pp": 1, "ep": 2, "user-zero3": 2}


@pytest.fixture(scope="module")
def ranks():
    return run_cases({name: (_worker, *case) for name, case in CASES.items()}, 2,
                     timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_muon_matches_one_process(ranks, case):
    results = case_result(ranks, case)
    kind = CASES[case][3] if len(CASES[case]) > 3 else "dense"
    want_losses, want = _reference(DP[case], kind)
    got = results[0]
    torch.testing.assert_close(got["losses"], want_losses, rtol=LOSS_RTOL, atol=0)
    assert set(got["state"]) == set(want)
    for key, value in got["state"].items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=PARAM_ATOL, msg=key)
    # the sharded layouts step meshfit's Muon (the user's torch.optim.Muon rebuilt as it),
    # making their matrices whole by the strategy asked for (owner rounds: one per bucket)
    if case == "user-zero3":
        assert got["optimizers"] == ["Muon", "AdamW"]
        assert got["whole"][0] == "owner"
    sharded = case not in ("ddp", "zero1", "pp")
    calls = got["calls"]
    if "gather" in case:
        assert calls["gather"] == STEPS * 12 and calls["owner"] == 0, calls
    else:
        rounds = 8 if "buckets" in case else 1
        assert calls == {"owner": STEPS * rounds if sharded else 0, "gather": 0}, calls


# ---------------------------------------------------------------- one process, in-process
def test_one_process_equals_torch_muon_and_adamw_bitwise():
    """Without sharding meshfit's Muon is torch.optim.Muon's step (and its AdamW groups
    torch.optim.AdamW's), to the last bit: the 2-D weights and the 3-D experts (per expert)."""
    for kind in ("dense", "moe"):
        _, want = _reference(2, kind)
        model = _model(kind)
        opt = optim.build("muon", model, lr=LR, weight_decay=WD, muon_lr=MUON_LR)
        for x, y in _batches(2):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)


def test_the_split_and_its_name_filter():
    """Muon: the blocks' matrices (and 3-D expert weights); AdamW: embeddings, the tied
    head, norms, biases, and what muon_exclude names; an untied head (a linear with the
    vocabulary's outputs) is AdamW's too."""
    model = _model("moe")
    opt = optim.build("muon", model, lr=LR, muon_exclude=["router"])
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    want = {n for n, p in model.named_parameters()
            if n.startswith("layers.") and p.ndim >= 2 and "router" not in n}
    assert muon == want and any(n.endswith("experts.w_in") for n in muon)
    assert {g["lr"] for g in opt.param_groups if g["use_muon"]} == {0.02}
    assert {g["lr"] for g in opt.param_groups if not g["use_muon"]} == {LR}
    untied = tiny_gpt(n_layer=1, max_seq_len=SEQ, tie_embeddings=False)
    opt = optim.build("muon", untied, lr=LR)
    adamw = {n for n, p in untied.named_parameters() for g in opt.param_groups
             if not g["use_muon"] and any(p is q for q in g["params"])}
    assert "lm_head.weight" in adamw and "tok_emb.weight" in adamw


def test_muon_refuses_what_it_cannot_treat():
    """One line naming the parameter (its name where build has the model), the value and
    the fix; before any step."""
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"parameter 0\.weight \(\(4, 3, 3, 3\).*muon_exclude"):
        optim.build("muon", conv, lr=LR)
    assert optim.build("muon", conv, lr=LR, muon_exclude=["0."]).param_groups
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(\(4,\)"):
        optim.Muon([torch.nn.Parameter(torch.zeros(4))])
    complex_p = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="not a real 2-D matrix"):
        optim.Muon([complex_p])
    ok = [torch.nn.Parameter(torch.zeros(2, 2))]
    for kwargs, match in (({"whole": "scatter"}, "whole='scatter' is not one of owner"),
                          ({"ns_steps": 0}, r"ns_steps=0 must be an integer in \[1, 99\]"),
                          ({"adjust_lr_fn": "rms"}, "adjust_lr_fn='rms' is not one of"),
                          ({"momentum": -1}, "momentum=-1 must be a finite number >= 0")):
        with pytest.raises(ValueError, match=match):
            optim.Muon(ok, **kwargs)


def test_config_keys_reach_the_optimizer_and_are_checked():
    from meshfit.train.config import OptimConfig
    from meshfit.train.trainer import build_optimizer

    class _Cfg:
        optim = OptimConfig(optimizer="muon", muon_lr=0.05, muon_momentum=0.9,
                            muon_ns_steps=3, muon_adjust_lr="match_rms_adamw",
                            muon_exclude=["wq"], muon_whole="gather", muon_nesterov=False)

    opt = build_optimizer(_model(), _Cfg)
    muon = [g for g in opt.param_groups if g["use_muon"]]
    assert {(g["lr"], g["momentum"], g["ns_steps"], g["adjust_lr_fn"], g["whole"],
             g["nesterov"]) for g in muon} == {(0.05, 0.9, 3, "match_rms_adamw", "gather",
                                                False)}
    assert not any(p.shape == (64, 64) and p is q for g in muon for p in g["params"]
                   for q in _model().layers["0"].attn.wq.parameters())
    for kwargs, match in (({"muon_whole": "all"}, r"optim\.muon_whole='all' is not one of"),
                          ({"muon_exclude": "wq"}, r"optim\.muon_exclude='wq' must be a list"),
                          ({"muon_ns_steps": 0}, r"optim\.muon_ns_steps=0 must be an integer"),
                          ({"muon_adjust_lr": "x"}, r"optim\.muon_adjust_lr='x' is not one")):
        with pytest.raises(ValueError, match=match):
            OptimConfig(optimizer="muon", **kwargs)


def test_estimate_counts_muons_state_as_measured():
    """The estimator's optimizer bytes for "muon" (4 B on the block matrices, AdamW's 8 on
    the rest) against `state_bytes` of a live Muon after a step (fp32, the tiny preset, and
    its MoE variant): within 1%; and below AdamW's."""
    from reference import tiny_preset
    from meshfit.memory import LayoutSpec, ModelShape, estimate

    for overrides in ({}, {"n_experts": 4, "top_k": 2}):
        model = tiny_preset(**overrides)
        opt = optim.build("muon", model, lr=1e-3)
        x = torch.randint(0, 256, (1, 16))
        model(x, x).backward()
        opt.step()
        measured = optim.state_bytes(opt).total_bytes
        shape = ModelShape.from_module(model)
        est = estimate(shape, LayoutSpec(), seq_len=16, optimizer="muon")
        assert abs(est.optimizer / measured - 1) < 0.01, (overrides, est.optimizer, measured)
        assert est.optimizer < estimate(shape, LayoutSpec(), seq_len=16,
                                        optimizer="adamw").optimizer


def test_the_iteration_leaves_a_bf16_momentum_alone():
    """Without Nesterov the update is the momentum buffer itself; for bf16 parameters
    ``.bfloat16()`` would return that buffer and Newton-Schulz would normalise it in place
    (torch.optim.Muon 2.13 does): the buffer must stay (1 - momentum) g after one step."""
    p = torch.nn.Parameter(torch.randn(8, 4, dtype=torch.bfloat16))
    opt = optim.Muon([p], nesterov=False, momentum=0.5)
    p.grad = torch.randn(8, 4, dtype=torch.bfloat16)
    opt.step()
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], p.grad * 0.5, rtol=0, atol=0)
