"""meshfit.memory: per-rank bytes measured on live DDP, ZeRO-1 and FSDP2 layouts (2 gloo
ranks on CPU), checked against exact counts and against the ZeRO paper's formula.

The layouts are built with PyTorch directly (DistributedDataParallel,
ZeroRedundancyOptimizer, fully_shard), so these tests check the measurement, not meshfit's
strategies. The model: three fp32 Linear blocks 256->512->256->256 with biases, Ψ = 328,704
parameters. Every dim 0 is even, so FSDP2's shards are exact halves (no padding); ZeRO-1's
greedy whole-tensor partition of it is uneven (196,608 vs 132,096 elements), which is the
point of using three blocks of unequal size rather than four equal ones.

The formula leaves out AdamW's scalar `step` tensor (4 B per parameter tensor, 6 tensors =
24 B against 8Ψ/2 = 1.3 MB of state): that is why measured optimizer bytes are compared to
the formula within 2%, and to the exact count (8 B per element + 4 B per tensor) exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshfit.memory import RankMemory, rank_report, zero_formula
from meshfit.optim import state_bytes
from meshfit.accelerator.prepared import GradientState, PreparedOptimizer
from conftest import case_result, run_cases

WIDTHS = (256, 512, 256, 256)
PSI = sum(i * o + o for i, o in zip(WIDTHS, WIDTHS[1:]))  # 328,704
N_TENSORS = 2 * (len(WIDTHS) - 1)  # a weight and a bias per block
WORLD = 2
REL = 0.02  # the formula's tolerance: it omits the 4-byte step scalars (see module docstring)


def _model() -> nn.Sequential:
    # The same initial weights on every rank: each builds the whole model from one seed
    # before it is wrapped or sharded (ranks that start apart would train apart).
    torch.manual_seed(0)
    layers = [nn.Linear(i, o) for i, o in zip(WIDTHS, WIDTHS[1:])]
    return nn.Sequential(*layers)


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    torch.manual_seed(100 + rank)  # each rank its own batch, as in data parallelism
    model(torch.randn(8, WIDTHS[0])).square().mean().backward()
    opt.step()  # AdamW's state exists from here; grads kept (no zero_grad) to be measured


def _adamw_bytes(numels: list[int]) -> int:
    """fp32 AdamW state: exp_avg + exp_avg_sq (8 B per element) + a 4-byte step per tensor."""
    return 8 * sum(numels) + 4 * len(numels)


# ---------------------------------------------------------------- workers (module level)
def _ddp_worker(rank: int, world: int) -> RankMemory:
    model = nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, rank)
    return rank_report(model, opt)


def _zero1_worker(rank: int, world: int) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = nn.parallel.DistributedDataParallel(_model())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    _step(model, opt, rank)
    local = [p.numel() for g in opt.optim.param_groups for p in g["params"]]
    wrapped = PreparedOptimizer(opt, GradientState())  # meshfit's wrapper around ZeRO
    out = {"report": rank_report(model, opt), "wrapped": rank_report(model, wrapped),
           "zero_state_entries": len(opt.state), "local_numels": sorted(local)}
    # A checkpoint round trip fills ZeRO's own .state with aliases of the local state.
    opt.consolidate_state_dict(to=0)
    state = [opt.state_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(state, src=0)
    opt.load_state_dict(state[0])
    out["reloaded"] = rank_report(model, opt)
    return out


def _fsdp2_worker(rank: int, world: int) -> dict:
    """Both FSDP2 variants; `mid_step_param_bytes` is measured between forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for reshard in (True, False):  # ZeRO-3, and meshfit's stage 2
        model = _model()
        for block in model:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built on the sharded parameters
        torch.manual_seed(100 + rank)
        loss = model(torch.randn(8, WIDTHS[0])).square().mean()
        mid_step = rank_report(model, opt).param_bytes
        loss.backward()
        opt.step()
        out[reshard] = {"report": rank_report(model, opt), "mid_step_param_bytes": mid_step,
                        "state_elements": state_bytes(opt).num_params}
    return out


# ---------------------------------------------------------------- tests
def _zero_greedy(numels: list[int], world: int) -> list[list[int]]:
    """ZeroRedundancyOptimizer's partition, re-derived: whole tensors, largest first, each
    to the rank with the fewest elements so far (lowest rank on a tie)."""
    parts: list[list[int]] = [[] for _ in range(world)]
    for n in sorted(numels, reverse=True):
        parts[min(range(world), key=lambda r: sum(parts[r]))].append(n)
    return parts


def _numels() -> list[int]:
    return [p.numel() for p in _model().parameters()]


@pytest.fixture(scope="module")
def measured():
    """The three layouts' workers in one spawn (see conftest.run_cases)."""
    return run_cases({"ddp": (_ddp_worker,), "zero1": (_zero1_worker,),
                      "fsdp2": (_fsdp2_worker,)}, WORLD)


def test_ddp_holds_the_full_model_on_each_rank(measured):
    reports = case_result(measured, "ddp")
    formula = zero_formula(PSI, WORLD, 0)
    for r in reports:
        assert (r.param_bytes, r.grad_bytes, r.buffer_bytes) == (4 * PSI, 4 * PSI, 0)
        assert r.optimizer_bytes == _adamw_bytes(_numels())  # 8Ψ + 6 step scalars of 4 B
        assert r.host_bytes == r.total_bytes and r.device_bytes == 0
        assert r.allocated_bytes is None and r.peak_allocated_bytes is None  # CPU
        assert r.param_bytes == formula["params"] and r.grad_bytes == formula["grads"]
        assert r.optimizer_bytes == pytest.approx(formula["optimizer"], rel=REL)
        assert r.total_bytes == pytest.approx(formula["total"], rel=REL)


def test_zero1_shards_only_the_optimizer_state(measured):
    results = case_result(measured, "zero1")
    formula = zero_formula(PSI, WORLD, 1)
    parts = _zero_greedy(_numels(), WORLD)
    # ZeRO-1's partition is whole tensors, so a rank's share is off Ψ/N by up to this much.
    imbalance = max(abs(sum(p) - PSI / WORLD) for p in parts) / (PSI / WORLD)
    assert 0.15 < imbalance < 0.25  # 196,608 vs 132,096 elements: the uneven case is tested
    for rank, res in enumerate(results):
        r = res["report"]
        assert res["local_numels"] == sorted(parts[rank])  # the partition re-derived above
        assert res["zero_state_entries"] == 0  # ZeRO's own .state stays empty: not counted
        assert res["wrapped"] == r  # PreparedOptimizer(ZeRO) measures the same
        assert res["reloaded"] == r  # after load_state_dict: still the partition only
        assert (r.param_bytes, r.grad_bytes) == (4 * PSI, 4 * PSI)  # replicated
        assert r.param_bytes == formula["params"] and r.grad_bytes == formula["grads"]
        # Exact: the state of this rank's partition and nothing else.
        assert r.optimizer_bytes == _adamw_bytes(parts[rank])
        # Formula: K·Ψ/N, off by this partition's imbalance (+ the step scalars, < 0.01%).
        assert r.optimizer_bytes == pytest.approx(formula["optimizer"], rel=imbalance + 1e-3)
    # Together the ranks hold exactly one full copy of the state.
    assert sum(res["report"].optimizer_bytes for res in results) == _adamw_bytes(_numels())


def test_fsdp2_shards_params_grads_and_state(measured):
    results = case_result(measured, "fsdp2")
    formula = zero_formula(PSI, WORLD, 3)
    # reshard_after_forward=False (meshfit's stage 2) holds the same at rest: see zero_formula.
    assert zero_formula(PSI, WORLD, 2, fsdp2=True) == formula
    for reshard in (True, False):
        for res in (rank_results[reshard] for rank_results in results):
            r = res["report"]
            # Every dim 0 (512, 256, 256) divides by 2: exact halves, no padding.
            assert (r.param_bytes, r.grad_bytes) == (4 * PSI // WORLD, 4 * PSI // WORLD)
            assert res["state_elements"] == PSI // WORLD
            # Each rank keeps a step scalar for every parameter tensor, sharded or not.
            assert r.optimizer_bytes == 8 * PSI // WORLD + 4 * N_TENSORS
            assert r.param_bytes == formula["params"] and r.grad_bytes == formula["grads"]
            assert r.optimizer_bytes == pytest.approx(formula["optimizer"], rel=REL)
            assert r.total_bytes == pytest.approx(formula["total"], rel=REL)
        reports = [rank_results[reshard]["report"] for rank_results in results]
        assert sum(r.param_bytes for r in reports) == 4 * PSI  # the shards add up to the model
        assert sum(r.grad_bytes for r in reports) == 4 * PSI
        assert sum(rank_results[reshard]["state_elements"] for rank_results in results) == PSI
    # Between forward and backward the two differ: ZeRO-3 has resharded every block, while
    # reshard_after_forward=False still holds all blocks gathered (no second all-gather in
    # backward), i.e. the full parameters — the peak that the at-rest formula leaves out.
    for rank_results in results:
        assert rank_results[True]["mid_step_param_bytes"] == 4 * PSI // WORLD
        assert rank_results[False]["mid_step_param_bytes"] == 4 * PSI


# ---------------------------------------------------------------- single process
class _Tied(nn.Module):
    """An embedding tied to the output head, a frozen projection and a BatchNorm's buffers."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.proj = nn.Linear(16, 16).requires_grad_(False)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.norm(self.proj(self.emb(idx))))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_single_process_counts_match_hand_computed_sums():
    model = _Tied()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    empty = rank_report(model, opt)
    assert (empty.grad_bytes, empty.optimizer_bytes) == (0, 0)  # before backward / a step
    model(torch.randint(0, 32, (4,))).sum().backward()
    opt.step()
    r = rank_report(model, opt)
    # Tied: emb.weight once (32·16), not again as head.weight; the frozen proj counts.
    assert r.param_bytes == 4 * (32 * 16 + 16 * 16 + 16 + 16 + 16)
    assert r.param_bytes == _nbytes(model.parameters())  # parameters() also dedupes by identity
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert r.grad_bytes == _nbytes(p.grad for p in trainable)  # proj has no grad: 0
    assert r.optimizer_bytes == _adamw_bytes([p.numel() for p in trainable])
    # running_mean, running_var (fp32) and num_batches_tracked (int64).
    assert r.buffer_bytes == _nbytes(model.buffers()) == 4 * 16 * 2 + 8
    assert r.total_bytes == r.param_bytes + r.grad_bytes + r.optimizer_bytes + r.buffer_bytes
    assert (r.host_bytes, r.device_bytes, r.rank) == (r.total_bytes, 0, 0)
    assert rank_report(model).optimizer_bytes == 0
    assert r.format().startswith("rank 0: params ") and "MiB" in r.format()


def test_parameters_sharing_a_storage_count_once():
    """Two distinct Parameter objects over the same storage (not caught by parameters()'s
    identity dedupe) count once, as the memory does."""
    model = nn.Module()
    model.a = nn.Parameter(torch.zeros(64))
    model.b = nn.Parameter(model.a.detach())  # another Parameter, same storage
    assert rank_report(model).param_bytes == 64 * 4


def test_gpt_tiny_tied_embeddings():
    from meshfit.models import GPT, GPTConfig, count_params

    model = GPT(GPTConfig.preset("tiny"))  # tie_embeddings=True
    assert rank_report(model).param_bytes == 4 * count_params(model)


def test_zero_formula_matches_the_paper():
    # ZeRO Fig. 1: Ψ = 7.5B, N = 64, K = 12, fp16 params and grads: 120, 31.4, 16.6, 1.9 GB.
    totals = [zero_formula(7.5e9, 64, s, param_bytes=2, grad_bytes=2, optim_bytes=12)["total"]
              for s in range(4)]
    assert [round(t / 1e9, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    stage2 = zero_formula(100, 4, 2)
    assert (stage2["params"], stage2["grads"], stage2["optimizer"]) == (400, 100, 200)
    assert zero_formula(100, 4, 2, fsdp2=True)["params"] == 100  # sharded at rest, as stage 3
    for bad in ({"stage": 4}, {"stage": -1}, {"world": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            zero_formula(100, **{"world": 2, "stage": 1, **bad})


def test_estimate_counts_lora_and_qlora_states_as_measured():
    """`estimate(..., adapters=Adapters(...))` against `rank_report` after a step of a Llama
    (fp32, AdamW, one process): full fine-tuning, LoRA and QLoRA on every block linear. The
    estimate counts NF4 at the paper's 4.127 bits per weight; torchao also keeps, per 4-bit
    weight, its 16-entry code table and one mean (68 B), finer groups for small weights (4 B
    each) and AdamW a 4 B `step` per trainable tensor: the measured bytes may exceed the
    estimate by those, and by nothing else."""
    import transformers

    from meshfit.memory import Adapters, LayoutSpec, ModelShape, estimate
    from meshfit.peft import lora, nf4_blocks, qlora, quantized_linears
    from meshfit.train.fits import adapters_of

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                      num_attention_heads=4, num_key_value_heads=1,
                                      num_hidden_layers=2, vocab_size=128,
                                      max_position_embeddings=32)
    shape = ModelShape.from_module(transformers.LlamaForCausalLM(config))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    for method in ("full", "lora", "qlora"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        if method != "full":
            model = (qlora if method == "qlora" else lora)(model, r=8,
                                                            target_modules="all-linear")
        adapters = adapters_of(model) if method != "full" else None
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-3)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        report = rank_report(model, opt)
        est = estimate(shape, LayoutSpec(), seq_len=16, adapters=adapters)
        measured = report.param_bytes + report.grad_bytes + report.optimizer_bytes
        expected = est.params + est.grads + est.optimizer
        slack = 4 * len(trainable)
        if method == "qlora":
            weights = [m.weight.numel() for m in quantized_linears(model).values()]
            slack += sum(68 + 4 * w // (64 * nf4_blocks(w)[1]) for w in weights)
            assert adapters == Adapters(trainable=sum(p.numel() for p in trainable),
                                        quantized=sum(weights))
        assert expected <= measured <= expected + slack, (method, measured, expected, slack)
        if method == "full":
            full = measured
        elif method == "qlora":  # 4 bits: under a fifth of the fp32 states' 16 B per weight
            assert measured < full / 5


@pytest.mark.parametrize("family", ["llama", "gpt2-shaped"])
def test_closed_form_adapters_count_what_peft_adds(family):
    """`Adapters.lora(shape, r)` (what `meshfit estimate --peft` uses) equals the trainable
    and 4-bit parameters of peft's all-linear LoRA and of `qlora` on the built model."""
    import transformers

    from meshfit.memory import Adapters, ModelShape
    from meshfit.models import GPT, GPTConfig
    from meshfit.peft import lora, qlora
    from meshfit.train.fits import adapters_of

    def build():
        torch.manual_seed(0)
        if family == "llama":
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(
                hidden_size=128, intermediate_size=320, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=3, vocab_size=100,
                max_position_embeddings=32))
        return GPT(GPTConfig.preset("tiny", d_model=128, n_layer=3, n_head=4, d_ff=512,
                                    vocab_size=100))

    # every block linear: peft's "all-linear" for a transformers model; for the reference
    # GPT, meshfit's default (peft's "all-linear" would take its lm_head too)
    targets = "all-linear" if family == "llama" else None
    shape = ModelShape.from_module(build())
    got = adapters_of(lora(build(), r=8, target_modules=targets))
    assert Adapters.lora(shape, 8) == got
    assert Adapters.lora(shape, 8, quantized=True) == adapters_of(
        qlora(build(), r=8, target_modules=targets))


def test_an_estimate_table_reads_in_a_unit_its_figures_show_in():
    """`byte_unit`: the unit a table of estimates is printed in (GiB, else MiB, else KiB: the
    largest in which the biggest total is at least 1), so that a small model's cells are
    not all 0.00 GiB (the tiny preset's total is 0.02 GiB) and a large one's stay in GiB."""
    from meshfit.memory import LayoutSpec, ModelShape, estimate
    from meshfit.memory.estimate import byte_unit

    def table(model, **kw):
        return [estimate(ModelShape.of(model), LayoutSpec(**kw), seq_len=256)]

    tiny = table("tiny")
    unit, size = byte_unit(tiny)
    assert (unit, size) == ("MiB", 2**20)
    for part in ("params", "grads", "optimizer", "activations", "total"):
        assert f"{getattr(tiny[0], part) / size:.2f}" != "0.00", part
    assert byte_unit(table("llama-1b", dp_shard=2, zero_stage=3)) == ("GiB", 2**30)
    assert byte_unit([]) == ("KiB", 2**10)
