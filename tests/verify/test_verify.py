"""`meshfit verify` (`meshfit.verify`): a configuration's first steps on one process and
under each layout, compared against the tolerance it states; and `compare_layouts`, the same
for a loop of one's own on `Accelerator`.

PASS: every built-in layout family on the reference GPT (DDP, ZeRO-1, ZeRO-3, tp2 with
sequence parallel, pp2 1f1b, through the command), a Hugging Face Llama from a config.json
(ZeRO-3, tp2, pp2), the MoE preset under expert parallelism, a factory model with its own
tensor- and pipeline-parallel plans (tp2, pp2, dp2 x tp2), and a loop of one's own (DDP, ZeRO-3).
FAIL: a tensor-parallel plan that splits a fused gate|up projection column-wise (each rank then
multiplies half the gate by the other half: silently wrong, 1.5 relative), one that swaps
column- and row-wise (DTensor refuses the shapes: the layout's error is the report), a
pipeline plan that leaves the final norm off `last` (every stage then applies it: 1.6), a
data-parallel loop whose DDP communication hook skips the all-reduce (each rank steps on its
own gradient) and one that sums instead of averaging under SGD (the step doubles). The
tolerance's derivation and the measurements behind it are in `meshfit.verify.layouts`'
docstring (float64: N K u G/eps, 2e-4 to 1e-3 here, against correct layouts' <= 3.5e-12 and
the mistakes' 1 to 2).

Each layout is a start of processes from the test suite's fork server (a second or two each).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from conftest import _mp_context, make_subprocess_env

pytestmark = pytest.mark.usefixtures("one_thread")

USER_MODELS = textwrap.dedent('''
    """A user's own language model, with tensor- and pipeline-parallel plans (right and wrong)."""
    import torch
    from torch import nn

    from meshfit.models.plans import PipelinePlan, colwise, replicate, rowwise


    class Block(nn.Module):
        def __init__(self, width, fused=False):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fused = fused
            if fused:  # SwiGLU with [gate | up] in one projection
                self.gate_up = nn.Linear(width, 8 * width)
            else:
                self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, h):
            x = self.norm(h)
            if self.fused:
                gate, up = self.gate_up(x).chunk(2, dim=-1)
                return h + self.down(torch.nn.functional.silu(gate) * up)
            return h + self.down(torch.relu(self.up(x)))


    class TinyLM(nn.Module):
        def __init__(self, vocab_size, width=32, n_blocks=4, fused=False):
            super().__init__()
            self.emb = nn.Embedding(vocab_size, width)
            self.blocks = nn.ModuleList([Block(width, fused) for _ in range(n_blocks)])
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab_size, bias=False)

        def forward(self, ids):  # a pipeline stage lacks some parts: None
            h = self.emb(ids) if self.emb is not None else ids
            for block in self.blocks:
                h = block(h)
            h = self.norm(h) if self.norm is not None else h
            return self.head(h) if self.head is not None else h


    def build(vocab_size):
        return TinyLM(vocab_size)


    def build_fused(vocab_size):
        return TinyLM(vocab_size, fused=True)


    _ENDS = {"emb": replicate(), "blocks.*.norm": replicate(), "norm": replicate(),
             "head": replicate()}
    PLAN = {**_ENDS, "blocks.*.up": colwise(), "blocks.*.down": rowwise()}
    SWAPPED_PLAN = {**_ENDS, "blocks.*.up": rowwise(), "blocks.*.down": colwise()}
    FUSED_PLAN = {**_ENDS, "blocks.*.gate_up": colwise(), "blocks.*.down": rowwise()}
    PIPELINE = PipelinePlan(blocks="blocks", first=("emb",), last=("norm", "head"))
    PIPELINE_NO_NORM = PipelinePlan(blocks="blocks", first=("emb",), last=("head",))
''')

SMALL = {"train": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32},
         "optim": {"optimizer": "adamw"}}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A corpus of 40 standard-library files, a token cache, the user's model module (on the
    import path of the processes too) and tiny Qwen3 and Qwen3-MoE config.json folders."""
    from meshfit.models.families import tiny_config

    root = tmp_path_factory.mktemp("verify")
    corpus = root / "corpus"
    corpus.mkdir()
    for i, f in enumerate(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]):
        (corpus / f"{i:02d}.txt").write_text(f.read_text(errors="ignore"))
    (corpus / "latin1.txt").write_bytes(b"caf\xe9\n")  # skipped, with a warning
    (root / "verify_usermodels.py").write_text(USER_MODELS)
    sys.path.insert(0, str(root))
    (root / "gpt.toml").write_text(textwrap.dedent(f"""
        [model]
        n_layer = 2
        d_model = 64
        d_ff = 128
        [train]
        global_batch_size = 8
        micro_batch_size = 2
        seq_len = 32
        [data]
        path = "{corpus}"
        cache_dir = "{root / 'cache'}"
    """))
    for family in ("qwen3", "qwen3_moe"):  # (q/k norms; transformers' fused experts)
        tiny_config(family, vocab_size=256).save_pretrained(root / family)
    yield root
    sys.path.remove(str(root))


def _config(sources, model: dict, **sections):
    from meshfit.train.configfile import build_config

    data = {"path": str(sources / "corpus"), "cache_dir": str(sources / "cache")}
    return build_config({**SMALL, **sections, "model": model, "data": data})


def _verify(cfg, layouts, **kw):
    from meshfit.verify import verify_config

    return verify_config(cfg, layouts, context=_mp_context(), timeout_s=300, **kw)


def _by_layout(report) -> dict:
    return {r.layout: r for r in report.results}


# ------------------------------------------------------------------------ the command
def test_command_passes_every_builtin_family_on_the_reference_gpt(sources):
    """`meshfit verify CONFIG --layouts ... --json` in a process of its own: exit 0, one
    result per layout, each within the stated tolerance by several orders of magnitude."""
    layouts = ["dp_replicate=2", "dp_shard=2,zero_stage=1", "dp_shard=2",
               "tp=2,sequence_parallel=true", "pp=2,schedule=1f1b"]
    proc = subprocess.run([sys.executable, "-m", "meshfit", "verify", str(sources / "gpt.toml"),
                           "--layouts", *layouts, "--json", "--train.seed=3"],
                          env=make_subprocess_env(sources), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["passed"] and out["dtype"] == "float64" and out["steps"] == 3
    assert [r["layout"] for r in out["layouts"]] == layouts
    tol = out["tolerance"]["relative"]
    assert 1e-6 < tol < 1e-2 and "N K u G/eps" in out["tolerance"]["statement"]
    for r in out["layouts"]:
        assert r["passed"] and r["error"] is None, r
        assert r["param_rel"] < 1e-10 and r["loss_rel"] < 1e-12, r  # measured: <= 6e-13, 2e-16
        assert len(r["losses"]) == 3
    assert "adamw_fused" not in proc.stderr  # (the default optimizer ran in float64)
    # the data's warning (a file that is not UTF-8, skipped) once, as the command's one line;
    # not again from each of the 10 ranks as a raw UserWarning
    assert proc.stderr.count("data: skipped 1 of 41 files") == 1, proc.stderr[-3000:]
    assert "meshfit verify: warning: data: skipped" in proc.stderr


def test_command_refuses_bad_input_before_any_process(cli_refusal, sources):
    import torch._dynamo  # noqa: F401  (sets TORCHINDUCTOR_CACHE_DIR once; not meshfit's doing)

    base = ["verify", str(sources / "gpt.toml")]
    cases = [
        (["--layouts", "tpp=2"], "unknown key 'tpp'"),
        (["--layouts", "tp"], "must look like key=value"),
        (["--layouts", "dp_replicate=1"], "one process, which is the reference itself"),
        (["--layouts", "dp_shard=3"], "train.global_batch_size=8"),  # not a multiple of 3 x 2
        (["--layouts", "tp=3"], "tp=3"),  # the heads do not divide
        (["--layouts", "pp=2,schedule=zigzag"], "parallel.schedule='zigzag'"),
        (["--dtype", "float16"], "--dtype='float16'"),
        (["--steps", "0"], "--steps=0"),
        (["--optim.optimizer=adamw_8bit"], "adamw_8bit"),
        (["--optim.optimizer=adamw_4bit"], "adamw_4bit"),
        (["--nproc", "1"], "--nproc=1"),
        (["--layouts", "dp_shard=2", "--bogus"], "--bogus"),
    ]
    for extra, expected in cases:
        line = cli_refusal(*base, *extra)
        assert line.startswith("meshfit verify: error: ") and expected in line, (extra, line)
    # a malformed layout is refused before torch loads (as meshfit train's bad flags are)
    probe = ("import sys, meshfit.cli.main as cli; rc = cli.main(['verify', '--layouts', "
             "'tpp=2']); print(rc, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], env=make_subprocess_env(sources),
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr


# ------------------------------------------------------------------------ PASS
def test_transformers_families_pass(sources):
    """A transformers family meshfit has no plan of its own for (Qwen3: q/k norms), under
    every axis that splits it -- its tp and pp plans read from the model, cp through its
    attention interface -- and a transformers mixture of experts under ep."""
    qwen3 = _config(sources, {"hf_config": str(sources / "qwen3")})
    report = _verify(qwen3, ["dp_shard=2", "tp=2,sequence_parallel=true", "pp=2", "cp=2"])
    assert report.passed, report.table()
    assert max(r.param_rel for r in report.results) < 1e-10, report.table()
    moe = _config(sources, {"hf_config": str(sources / "qwen3_moe")})
    report = _verify(moe, ["dp_shard=2,ep=2,zero_stage=1"])
    assert report.passed, report.table()


def test_factory_model_with_its_own_plans_passes(sources):
    cfg = _config(sources, {"factory": "verify_usermodels:build",
                            "tp_plan": "verify_usermodels:PLAN",
                            "pipeline_plan": "verify_usermodels:PIPELINE"})
    report = _verify(cfg, ["tp=2", "pp=2,schedule=gpipe", "dp_replicate=2,tp=2"])
    assert report.passed, report.table()
    assert max(r.param_rel for r in report.results) < 1e-10, report.table()
    table = report.table()
    assert "3 of 3 layout(s) PASS" in table and "tolerance" in table


# ------------------------------------------------------------------------ FAIL
def test_wrong_plans_of_a_factory_model_fail(sources):
    fused = _verify(_config(sources, {"factory": "verify_usermodels:build_fused",
                                      "tp_plan": "verify_usermodels:FUSED_PLAN"}), ["tp=2"])
    swapped = _verify(_config(sources, {"factory": "verify_usermodels:build",
                                        "tp_plan": "verify_usermodels:SWAPPED_PLAN"}), ["tp=2"])
    pipeline = _verify(_config(sources, {"factory": "verify_usermodels:build",
                                         "pipeline_plan": "verify_usermodels:PIPELINE_NO_NORM"}),
                       ["pp=2"])
    (f,), (s,), (p,) = fused.results, swapped.results, pipeline.results
    assert not f.passed and f.error is None and f.param_rel > 1e-2, fused.table()  # measured 1.5
    assert not p.passed and p.param_rel > 1e-2 and p.loss_rel > 1e-4, pipeline.table()  # 1.6
    assert not s.passed and s.loss_diff is None and "Sharding propagation" in s.error
    # the table names the rank and its exception, not the traceback's last line
    assert re.search(r"^tp=2: rank \d: \w+Error: \S", swapped.table(), re.MULTILINE), \
        swapped.table()
    assert "FAIL" in swapped.table() and "0 of 1 layout(s) PASS" in swapped.table()


# ------------------------------------------------------------------------ a loop of one's own
class _LoopLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 64)

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.mlp(h))


def build_loop_model():
    torch.manual_seed(0)
    return _LoopLM()


class _SpareLM(_LoopLM):
    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(32, 32)  # never used in forward: no gradient


def build_spare_model():
    torch.manual_seed(0)
    return _SpareLM()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _skip_allreduce(state, bucket):
    """A DDP communication hook that forgets the all-reduce: each rank keeps its gradient."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _sum(state, bucket):
    """A DDP communication hook that sums over the ranks instead of averaging."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
        lambda f: f.value()[0])


def _step(acc, model, optimizer, batch, hook=None):
    if hook is not None and isinstance(model, nn.parallel.DistributedDataParallel) \
            and not getattr(model, "_hooked", False):
        model.register_comm_hook(None, hook)
        model._hooked = True
    x, y = batch
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def step(acc, model, optimizer, batch):
    return _step(acc, model, optimizer, batch)


def step_without_allreduce(acc, model, optimizer, batch):
    return _step(acc, model, optimizer, batch, _skip_allreduce)


def step_summing(acc, model, optimizer, batch):
    return _step(acc, model, optimizer, batch, _sum)


def test_compare_layouts_on_a_loop_of_ones_own():
    from meshfit.verify import compare_layouts

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (3, 8, 17), generator=g)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]  # 3 global batches of 8 rows
    run = dict(context=_mp_context(), timeout_s=120)
    good = compare_layouts(step, build_loop_model, batches,
                           layouts=["dp_replicate=2", "dp_shard=2"], **run)
    assert good.passed, good.table()
    assert max(r.param_rel for r in good.results) < 1e-10
    no_allreduce = compare_layouts(step_without_allreduce, build_loop_model, batches,
                                   layouts=["dp_replicate=2"], **run)
    summing = compare_layouts(step_summing, build_loop_model, batches, layouts=["dp_replicate=2"],
                              make_optimizer=sgd, **run)
    (a,), (s,) = no_allreduce.results, summing.results
    assert not a.passed and a.param_rel > 1e-2, no_allreduce.table()
    assert not s.passed and s.param_rel > 1e-1, summing.table()  # the SGD step doubled
    assert "N K u" in summing.tolerance.describe() and summing.tolerance.eps is None
    # a parameter the loss does not use: one process steps on, DDP refuses it on the second
    # step; the report names the parameters (the reference found them), not DDP's last line
    spare = compare_layouts(step, build_spare_model, batches, layouts=["dp_replicate=2"], **run)
    (u,) = spare.results
    assert not u.passed and u.error.startswith(
        "2 trainable parameter(s) get no gradient: spare.weight, spare.bias"), u.error
    assert f"dp_replicate=2: {u.error}" in spare.table()
    with pytest.raises(ValueError, match="cannot split over its 2 data-parallel ranks"):
        compare_layouts(step, build_loop_model, [(x[:7], y[:7]) for x, y in batches],
                        layouts=["dp_shard=2"], **run)


def test_a_transformers_mixture_of_experts_runs_in_float64():
    """transformers' default experts kernel (a grouped matmul) takes no float64: verify's
    float64 runs switch it to transformers' own loop, which computes the same sums."""
    import transformers

    from meshfit.models.families import tiny_config
    from meshfit.verify.runs import float64_experts

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    single = model(input_ids=x).logits
    model = float64_experts(model.double())
    assert model.get_experts_implementation()[""] == "eager"
    double = model(input_ids=x).logits
    assert double.dtype == torch.float64
    torch.testing.assert_close(double.float(), single, rtol=1e-4, atol=1e-5)
