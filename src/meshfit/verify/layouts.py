"""`meshfit verify`: a run checked under each layout against one process. The same first
optimizer steps run on one process and under every layout asked for, from the same weights on
the same global batches, and per layout the largest loss difference, the largest relative
parameter difference, the tolerance and PASS/FAIL are reported.

    meshfit verify run.toml --layouts "dp_shard=2" "tp=2,sequence_parallel=true" \\
        "pp=2,schedule=1f1b" [--steps 3] [--dtype float64|float32] [--json]

**A configuration** (`verify_config`): what runs is what `meshfit train` runs — the TOML file
and ``--section.key=value`` overrides (`meshfit.train.configfile`), the model of any [model]
source, the tokens of [data] in the trainer's order, the trainer's `Accelerator`,
`prepare_steps` and optimizer step (accumulation, clipping, the configured optimizer and its
warm-up/cosine schedule) — with what makes runs comparable: the model cast to and computed in
float64 (or float32), no mixed precision, TF32 or float8; dropout off; ``--steps`` optimizer
steps. A layout is a whole ``[parallel]`` section written ``key=value,key=value`` (without
``--layouts``: the configuration's own), run on as many processes as its axes multiply to (an
axis at -1 takes the remaining ranks of ``--nproc``; without --nproc a lone -1 means 2), each
started by `meshfit.distributed.spawn` (gloo on the CPU; NCCL with a GPU per process where
there are enough GPUs for every layout). Everything is checked before any process starts.

**A loop of your own** (`compare_layouts`)::

    from meshfit.verify import compare_layouts

    def build():                                  # module level: each process calls it
        torch.manual_seed(0)
        return MyModel()

    def step(acc, model, optimizer, batch):       # one optimizer step of your loop
        x, y = batch                              # this data-parallel rank's rows
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss                               # this rank's mean loss

    report = compare_layouts(step, build, batches, layouts=["dp_shard=2", "tp=2"],
                             accelerator_kwargs={"tp_plan": MY_PLAN})
    print(report.table())
    assert report.passed

`batches` holds one global batch per optimizer step (a tensor, or a tuple/list/dict of
tensors, rows first); each data-parallel rank gets its contiguous share of the rows (the rows
must divide by the data-parallel degree), the reference the whole batch. Under pp > 1 the
model passed to `step_fn` is the `Pipeline` (`acc.prepare_pipeline` with the layout's schedule
and microbatches and `pipeline_plan`): drive it with ``model.step(x, y)``. `make_optimizer(model)`
(default: AdamW, lr 1e-3) builds the optimizer over the prepared model. `step_fn`, `build` and
`make_optimizer` travel to the processes by name: define them at module level.

**Tolerance** (`Tolerance`, stated with every report). A correct layout computes the same sums
in other orders and nothing else, so every difference is rounding. One rounding moves a result
by at most u (the unit roundoff: 2^-53 = 1.1e-16 in float64, 2^-24 = 6.0e-8 in float32) times
the sum of its terms' magnitudes. A weight's gradient sums over the tokens of a step (4,096 in
the default run), which in another order moves it by up to (n - 1) u times the sum of the
terms' magnitudes, itself larger than the sum by how much the terms cancel; then come the
blocks of backward, the all-reduce or reduce-scatter and the accumulation. We allow K = 1e5
such roundings per gradient element (n = 4,096 with 25-fold cancellation), so each gradient
element moves by dg <= K u G, with G the largest gradient element the reference's optimizer
is given (measured; after clipping), a bound on every element's terms. Then the optimizer:
SGD's step moves by lr dg, i.e. K u relative; Adam's g / (sqrt(v) + eps) by at most lr dg / eps
(its derivative eps / (|g| + eps)^2 is largest, 1/eps, where the exact gradient is 0: an
attention key bias, a token no batch holds), while the parameter that moves most moves by about
lr per step. Over N steps the differences add up (each step's gradients also see the earlier
steps' weight differences), and relative to the largest movement of any parameter:

    max|theta - theta_ref| / max|theta_ref - theta_0| <= N K u max(1, G / eps)   (SGD: N K u)

A step's loss moves by at most its gradient times the weights' difference, and N steps of
training move it by about its gradient times the weights' movement, less than the loss itself:
the same bound holds for |L - L_ref| / |L_ref|. For 3 float64 steps, G = 0.14 and eps = 1e-8 it
is 4.6e-4. Measured (4 small models x 3 seeds x 13 layouts, 3 steps, 10 steps alike; and the
README's three user-sized runs): correct layouts <= 4.5e-12 (parameters) and <= 2e-16 (losses;
the reference GPT's MoE under pp: 4.4e-10, because outside a pipeline the reported
cross-entropy is the loss minus auxiliary losses that `GPT.aux_loss` sums in float32); mistakes 1.5 to 2 (a tensor-
parallel plan that splits a fused gate|up projection column-wise, a pipeline plan that leaves
the final norm off `last`, a DDP hook that skips the all-reduce) and 1.0 (a sum for a mean
under SGD).

In float32 the same bound exceeds 1: Adam can turn float32 rounding of a gradient element near
eps into a difference of a whole step, so nothing is proven about such elements, and
`--dtype float32` compares against the bound without Adam's eps, N K u (1.8e-2 for 3 steps): a
screen, not a proof (measured on correct layouts: up to 1.0e-3 on the small models, 3.5e-3 on
the README's factory model under tp=2 (parameters), <= 9e-8 (losses); the mistakes above: 1 to
2). A correct layout of a larger model may exceed it in float32: float64 decides.
What a tolerance cannot see well: Adam is invariant to a constant scale of the gradients, so a
sum in place of a mean over the data-parallel ranks, or a norm clipped over part of the model,
changes AdamW's steps only through eps (measured: 1.5e-8 relative with clipped gradients,
PASS; 4.9e-3 in a loop whose gradients sit near eps, FAIL in float64) — and the trained
weights by as little; to see such scale mistakes, verify with ``--optim.optimizer=sgd``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from meshfit._quiet import quiet_logs
from meshfit.distributed.dims import MESH_AXES
from meshfit.distributed.spawn import SpawnError, spawn
from meshfit.models.config import GPTConfig
from meshfit.parallel.layout import Layout
from meshfit.parallel.request import LayoutRequest
from meshfit.train.config import RunConfig
from meshfit.train.configfile import build_config
from meshfit.train.preflight import check_data

# No torch here when the module loads: `meshfit verify` refuses a bad layout or configuration
# before torch is imported (every check runs first); torch, `meshfit.distributed.init` and the
# processes' code (`meshfit.verify.runs`) are imported by the functions that run.

__all__ = ["LayoutResult", "Tolerance", "VerifyReport", "compare", "compare_layouts",
           "parse_layout", "plan_config", "verify_config"]

UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24}
ROUNDINGS = 1e5
"""K: order-sensitive roundings allowed on the path to one gradient element (see above)."""


@dataclass(frozen=True)
class Tolerance:
    """The bound a layout's relative differences must stay within (module docstring):
    N K u max(1, G / eps) in float64, N K u in float32."""

    dtype: str
    steps: int
    max_grad: float = 0.0  # G: the largest gradient element of the reference run
    eps: float | None = None  # Adam's eps (None: an optimizer without one)

    @property
    def unit_roundoff(self) -> float:
        return UNIT_ROUNDOFF[self.dtype]

    @property
    def amplification(self) -> float:
        """How much the optimizer can amplify a gradient's rounding: max(1, G / eps) for Adam
        in float64; 1 otherwise (float32: see the module docstring)."""
        if self.eps is None or self.dtype != "float64":
            return 1.0
        return max(1.0, self.max_grad / self.eps)

    @property
    def relative(self) -> float:
        return self.steps * ROUNDINGS * self.unit_roundoff * self.amplification

    def describe(self) -> str:
        n, k, u = self.steps, f"{ROUNDINGS:.0e}", f"{self.unit_roundoff:.1e}"
        of = "relative to each step's loss and to the largest parameter movement of the reference"
        if self.amplification > 1:
            return (f"tolerance {self.relative:.1e} = N K u G/eps = {n} steps x {k} roundings x "
                    f"{u} ({self.dtype} unit roundoff) x {self.max_grad:.2g} (largest gradient) / "
                    f"{self.eps:.0e} (Adam's eps), {of}")
        why = ""
        if self.dtype == "float32" and self.eps is not None:
            why = ("; Adam's eps regime left out (float32 cannot bound it: a screen, not a "
                   "proof; float64 proves)")
        return (f"tolerance {self.relative:.1e} = N K u = {n} steps x {k} roundings x {u} "
                f"({self.dtype} unit roundoff), {of}{why}")


@dataclass
class LayoutResult:
    """One layout against the reference (differences None where it did not run)."""

    layout: str
    processes: int
    loss_diff: float | None = None  # max over steps of |L - L_ref|
    loss_rel: float | None = None  # max over steps of |L - L_ref| / |L_ref|
    param_diff: float | None = None  # max over elements of |theta - theta_ref|
    param_rel: float | None = None  # param_diff / max|theta_ref - theta_0|
    worst_param: str | None = None  # the parameter holding param_diff
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None  # why it did not run, or what does not match
    passed: bool = False

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class VerifyReport:
    """Every layout's result, the reference's losses, the tolerance and the wall time."""

    tolerance: Tolerance
    reference_losses: list[float]
    results: list[LayoutResult]
    reference_seconds: float = 0.0
    wall_seconds: float = 0.0
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def table(self) -> str:
        """The table `meshfit verify` prints."""
        head = ("layout", "procs", "max loss diff", "max rel param diff", "tolerance", "result",
                "time")
        rows = []
        for r in self.results:
            if r.loss_diff is None:
                rows.append((r.layout, str(r.processes), "-", "-",
                             f"{self.tolerance.relative:.1e}", "FAIL", f"{r.seconds:.1f} s"))
                continue
            rows.append((r.layout, str(r.processes), f"{r.loss_diff:.1e} ({r.loss_rel:.1e} rel)",
                         f"{r.param_rel:.1e}", f"{self.tolerance.relative:.1e}",
                         "PASS" if r.passed else "FAIL", f"{r.seconds:.1f} s"))
        widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
                  for i, h in enumerate(head)]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa
        out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
        for r in self.results:
            if r.error:
                out.append(f"{r.layout}: {error_line(r.error)}")
        ref = ", ".join(f"{x:.6f}" for x in self.reference_losses)
        out.append(f"reference: 1 process, losses {ref} ({self.reference_seconds:.1f} s); "
                   f"{self.tolerance.dtype}, {self.tolerance.steps} steps on {self.device}")
        out.append(self.tolerance.describe())
        passed = sum(r.passed for r in self.results)
        out.append(f"{passed} of {len(self.results)} layout(s) PASS; wall time "
                   f"{self.wall_seconds:.1f} s")
        return "\n".join(out)

    def to_json(self) -> dict:
        t = self.tolerance
        return {"passed": self.passed, "dtype": t.dtype, "steps": t.steps,
                "tolerance": {"relative": t.relative, "steps": t.steps, "roundings": ROUNDINGS,
                              "unit_roundoff": t.unit_roundoff, "max_grad": t.max_grad,
                              "eps": t.eps, "statement": t.describe()},
                "reference": {"losses": self.reference_losses,
                              "seconds": round(self.reference_seconds, 3)},
                "layouts": [r.to_json() for r in self.results], "device": self.device,
                "wall_seconds": round(self.wall_seconds, 3), "notes": self.notes}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


# ------------------------------------------------------------------------ the comparison
def compare(layout: str, processes: int, reference: dict, got: dict,
            tolerance: Tolerance) -> LayoutResult:
    """`got`'s per-step losses and final state against `reference`'s (results of
    `meshfit.verify.runs`); PASS when both relative differences are within
    `tolerance` and the state dicts hold the same names and shapes."""
    res = LayoutResult(layout=layout, processes=processes, losses=list(got["losses"]))
    ref_losses = reference["losses"]
    res.loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref_losses))
    res.loss_rel = max(abs(a - b) / max(abs(b), 1e-300)
                       for a, b in zip(got["losses"], ref_losses))
    ref, mine, start = reference["final"], got["final"], reference["initial"]
    problems = []
    missing, extra = sorted(set(ref) - set(mine)), sorted(set(mine) - set(ref))
    if missing:
        problems.append(f"the layout's model lacks {len(missing)} tensor(s): "
                        f"{', '.join(missing[:3])}")
    if extra:
        problems.append(f"the layout's model has {len(extra)} tensor(s) the reference lacks: "
                        f"{', '.join(extra[:3])}")
    moved, worst, worst_name = 0.0, 0.0, None
    for name, want in ref.items():
        if not want.is_floating_point():
            continue
        want = want.double()
        moved = max(moved, float((want - start[name].double()).abs().max()) if want.numel()
                    else 0.0)
        if name not in mine:
            continue
        have = mine[name]
        if have.shape != want.shape:
            problems.append(f"{name} has shape {tuple(have.shape)}, the reference's "
                            f"{tuple(want.shape)}")
            continue
        diff = float((have.double() - want).abs().max()) if want.numel() else 0.0
        if not math.isfinite(diff):
            diff = math.inf
        if diff > worst or worst_name is None:
            worst, worst_name = diff, name
    res.param_diff, res.worst_param = worst, worst_name
    res.param_rel = worst / moved if moved > 0 else (0.0 if worst == 0 else math.inf)
    if problems:
        res.error = "; ".join(problems)
    res.passed = (not problems and res.loss_rel <= tolerance.relative
                  and res.param_rel <= tolerance.relative and len(res.losses) == len(ref_losses)
                  and all(math.isfinite(x) for x in res.losses))
    return res


# ------------------------------------------------------------------------ layouts
def parse_layout(text: str) -> dict[str, Any]:
    """``"tp=2,sequence_parallel=true"`` -> ``{"tp": 2, "sequence_parallel": True}``: the keys
    a layout gives, in the one grammar of a layout on a command line
    (`LayoutRequest.parse_items`; one-line ValueError for a malformed item or an unknown key)."""
    return LayoutRequest.parse_items(text, flag="--layouts")


def world_size_of(sizes: dict[str, Any], nproc: int | None, what: str) -> int:
    """The processes a layout runs on: `nproc` if given, else the product of its mesh axes
    (an axis at -1 counts 1; a lone -1 with nothing else above 1 means 2: DDP on two)."""
    if nproc is not None:
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
            raise ValueError(f"--nproc={nproc!r} must be an integer >= 2 (one process is the "
                             "reference itself)")
        return nproc
    product, auto = 1, False
    for axis in MESH_AXES:
        value = sizes.get(axis, LayoutRequest.__dataclass_fields__[axis].default)
        if value == -1:
            auto = True
        elif isinstance(value, int) and not isinstance(value, bool) and value > 0:
            product *= value
    if product == 1 and auto:
        return 2
    if product == 1:
        raise ValueError(f"{what} runs on one process, which is the reference itself; give a "
                         "layout of two or more processes (e.g. dp_replicate=2, dp_shard=2, "
                         "tp=2 or pp=2)")
    return product


def _check_steps_dtype(steps: Any, dtype: Any) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 1000:
        raise ValueError(f"--steps={steps!r} must be an integer in [1, 1000]")
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"--dtype={dtype!r} is not one of {', '.join(UNIT_ROUNDOFF)}")


def plan_config(cfg: RunConfig, layouts: list[str] | None = None, *, steps: int = 3,
                dtype: str = "float64", nproc: int | None = None
                ) -> tuple[RunConfig, list[tuple[str, RunConfig, int]], list[str]]:
    """The reference's configuration, each layout's (name, configuration, processes), and
    the notes on what verify changed; every check `meshfit train` makes before launch,
    per layout (one-line ValueErrors naming the layout and the key). Needs no process."""
    _check_steps_dtype(steps, dtype)
    data, notes = _comparable(cfg, steps, dtype)
    own = data.get("parallel", {})
    data["parallel"] = {}
    asked = _asked(own, layouts, nproc)  # no torch yet
    reference = build_config(data)
    reference.validate_for(1)
    cases = []
    for name, parallel, world, what in asked:
        with _naming(what, world):
            case = build_config({**data, "parallel": parallel})
            case.validate_for(world, world)  # meshfit train's checks before launch
        cases.append((name, case, world))
    check_data(reference, 1)  # the token cache built here, read by every process
    for (name, case, world), (_, _, _, what) in zip(cases, asked):
        with _naming(what, world):
            check_data(case, world)
    return reference, cases, notes


def _comparable(cfg: RunConfig, steps: int, dtype: str) -> tuple[dict, list[str]]:
    """`cfg` as nested dicts with what makes runs comparable (computed in `dtype`, eagerly,
    without dropout, `steps` steps of the configured schedule, no evaluation), and a note
    for each setting verify changed."""
    data = {s: {k: v for k, v in values.items() if v is not None}
            for s, values in cfg.to_dict().items()}
    notes = []
    t = data["train"]
    for key, off in (("mixed_precision", "no"), ("tf32", False), ("float8", False),
                     ("find_batch_size", False), ("compile", False)):
        if key in t and t[key] != off:
            notes.append(f"train.{key}={t[key]!r} set to {off!r}: verify computes in {dtype}"
                         if key != "compile" else
                         "train.compile=true set to false: verify runs the model eagerly")
            t[key] = off
    if cfg.optim.optimizer in ("adamw_8bit", "adamw_4bit"):
        # (meshfit.optim.states: torchao computes the step in fp32 whatever --dtype asks, so
        # verify's float64 comparison cannot hold; tensor parallel's column shards keep fp32
        # moments where one process quantizes them)
        raise ValueError(f"optim.optimizer={cfg.optim.optimizer!r} steps in fp32 whatever "
                         "the dtype, and tensor-parallel shards keep its state in fp32, so "
                         "layouts may differ by design; verify the layout with "
                         "--optim.optimizer=adamw")
    if cfg.model.source == "preset":
        dropout = cfg.model.dropout if cfg.model.dropout is not None else \
            GPTConfig.preset(cfg.model.preset).dropout
        if dropout:
            notes.append(f"model.dropout={dropout} set to 0: verify compares deterministic runs")
        data["model"]["dropout"] = 0.0
    t["steps"] = max(t.get("steps", 1), steps)  # the schedule as configured, N steps of it
    t["eval_every"] = 0
    return data, notes


def _asked(own: dict, layouts: list[str] | None, nproc: int | None
           ) -> list[tuple[str, dict, int, str]]:
    """Each layout asked for (None: the configuration's own [parallel] section `own`) as
    (name, [parallel] section, processes, how an error names it)."""
    asked = []
    defaults = LayoutRequest().fields_dict()
    for text in layouts or [None]:
        if text is None:
            parallel, what = own, "the configuration's [parallel] section"
            name = ",".join(f"{k}={json.dumps(v)}" for k, v in own.items()
                            if defaults.get(k) != v)
        else:
            parallel, name, what = parse_layout(text), text, f"--layouts {text!r}"
        world = world_size_of(parallel, nproc, what)
        asked.append((name or f"dp_replicate={world}", parallel, world, what))
    return asked


@contextlib.contextmanager
def _noting(shown: set[str]):
    """The text of each warning shown meanwhile added to `shown`."""
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        shown.add(str(message))
        return previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


@contextlib.contextmanager
def _naming(what: str, world: int):
    """A ValueError of the block as one line naming the layout it is about."""
    try:
        yield
    except ValueError as err:
        raise ValueError(f"{what} on {world} process(es): {err}") from None


# ------------------------------------------------------------------------ running
def _context(extra_preload: tuple[str, ...] = ()):
    """A fork server that has imported torch and meshfit's run code once: each rank then
    starts in a fraction of the time a fresh interpreter takes."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "meshfit.verify.runs",
                                *extra_preload])
    return ctx


def _run_layouts(cases, target, args_of, reference: dict, tolerance: Tolerance, *, cpu: bool,
                 context, timeout_s: float, say: Callable[[str], None]) -> list[LayoutResult]:
    """Each case in its own start of processes (a failing layout cannot hold up the next)."""
    results = []
    for name, case, world in cases:
        began = time.perf_counter()
        try:
            ranks = spawn(target, world, *args_of(case), timeout=timeout_s, context=context,
                          cpu=cpu)
        except SpawnError as err:
            res = LayoutResult(layout=name, processes=world,
                               error=_unused_error(str(err), reference.get("unused") or []))
        else:
            res = compare(name, world, reference, ranks[0], tolerance)
        res.seconds = time.perf_counter() - began
        results.append(res)
        say(f"{name} on {world} process(es): {'PASS' if res.passed else 'FAIL'} "
            f"({res.seconds:.1f} s)")
    return results


def error_line(error: str) -> str:
    """The line of a layout's error that says what failed: for a rank's traceback
    (`meshfit.distributed.spawn.SpawnError`), the rank and its exception's first line (the
    last line is often a library's afterthought, such as DDP's advice on
    TORCH_DISTRIBUTED_DEBUG); otherwise the error's first line."""
    lines = error.strip().splitlines()
    rank = lines[0].removesuffix(" failed:") if lines and lines[0].startswith("rank ") \
        else None
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if rank is None or not frames:
        return lines[0] if lines else ""
    after = [line for line in lines[frames[-1] + 1:] if line and not line.startswith(" ")]
    return f"{rank}: {after[0]}" if after else f"{rank}: {lines[-1].strip()}"


def _unused_error(error: str, unused: list[str]) -> str:
    """A layout's error; where DDP refused parameters that take no part in the loss, and the
    reference found which (`meshfit.verify.runs`), one line naming them."""
    if not unused or "find_unused_parameters" not in error:
        return error
    names = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
    return (f"{len(unused)} trainable parameter(s) get no gradient: {names} (not used in the "
            "loss on one process either), and DDP needs a gradient for every trainable "
            "parameter; use them in the loss or freeze them (requires_grad=False)")


def verify_config(cfg: RunConfig, layouts: list[str] | None = None, *, steps: int = 3,
                  dtype: str = "float64", nproc: int | None = None, timeout_s: float = 900.0,
                  context=None, say: Callable[[str], None] = lambda _: None) -> VerifyReport:
    """`cfg` for `steps` optimizer steps on one process (in this one) and under each layout
    of `layouts` (None: the configuration's own), compared (see the module docstring).
    `context`: the multiprocessing context of the layouts' processes (default: a fork server
    that has imported torch); `say`: progress lines."""
    began = time.perf_counter()
    shown: set[str] = set()  # meshfit's warnings shown here, which the layouts' ranks repeat
    with _noting(shown), quiet_logs():  # (transformers and peft import torchao, which logs)
        reference_cfg, cases, notes = plan_config(cfg, layouts, steps=steps, dtype=dtype,
                                                  nproc=nproc)
    from meshfit.distributed import init  # (torch, loaded once every layout is checked)
    from meshfit.verify.runs import config_rank, devices_for, quiet, run_config

    cpu, note = devices_for([w for _, _, w in cases])
    notes += [note] if note else []
    for line in notes:
        say(f"note: {line}")
    say(f"reference: 1 process, {steps} step(s) in {dtype}")
    t0 = time.perf_counter()
    with _noting(shown), quiet():
        reference = run_config(reference_cfg, steps, dtype, init(cpu=cpu or None),
                               reference=True)
    ref_seconds = time.perf_counter() - t0
    if reference["dropouts"]:
        notes.append(f"dropout set to 0 in {reference['dropouts']} place(s) of the model: "
                     "verify compares deterministic runs")
        say(f"note: {notes[-1]}")
    tolerance = Tolerance(dtype, steps, reference["max_grad"], reference["eps"])
    hf = ("transformers",) if cfg.model.source in ("hf_config", "hf_model") else ()
    results = _run_layouts(cases, config_rank, lambda case: (case, steps, dtype, shown),
                           reference, tolerance, cpu=cpu, context=context or _context(hf),
                           timeout_s=timeout_s, say=say)
    return VerifyReport(tolerance=tolerance, reference_losses=reference["losses"],
                        results=results, reference_seconds=ref_seconds,
                        wall_seconds=time.perf_counter() - began, device=reference["device"],
                        notes=notes)


def compare_layouts(step_fn: Callable, build: Callable, batches: list, *,
                    layouts: list[str | dict], steps: int | None = None,
                    make_optimizer: Callable | None = None, dtype: str = "float64",
                    accelerator_kwargs: dict | None = None, pipeline_plan=None,
                    nproc: int | None = None, timeout_s: float = 600.0,
                    context=None) -> VerifyReport:
    """A loop of your own under each of `layouts` against one process (see the module
    docstring): ``step_fn(acc, model, optimizer, batch)`` for each of the first `steps`
    (default: all) global `batches`, the model from ``build()``, the optimizer from
    ``make_optimizer(model)``; `accelerator_kwargs` go to every `Accelerator` (e.g.
    tp_plan, gradient_accumulation_steps). Returns the `VerifyReport`."""
    from meshfit.distributed import init  # (torch, loaded once every layout is checked)
    from meshfit.verify.runs import (check_rows, default_optimizer, devices_for, loop_rank, quiet,
                                     run_loop)

    began = time.perf_counter()
    steps = len(batches) if steps is None else steps
    _check_steps_dtype(steps, dtype)
    if steps > len(batches):
        raise ValueError(f"steps={steps} but only {len(batches)} global batches were given")
    if not layouts:
        raise ValueError("layouts is empty; give one or more, e.g. [\"dp_shard=2\", \"tp=2\"]")
    cases = []
    for item in layouts:
        request = parse_layout(item) if isinstance(item, str) else dict(item)
        name = item if isinstance(item, str) else ",".join(f"{k}={v}" for k, v in item.items())
        world = world_size_of(request, nproc, f"layout {name!r}")
        try:
            layout = Layout.resolve(LayoutRequest(**request), world)
        except (TypeError, ValueError) as err:
            raise ValueError(f"layout {name!r} on {world} process(es): {err}") from None
        for i, batch in enumerate(batches[:steps]):
            check_rows(batch, layout.dims.dp, name, i)
        cases.append((name, request, world))
    spec = dict(step_fn=step_fn, build=build, batches=list(batches[:steps]), steps=steps,
                dtype=dtype, make_optimizer=make_optimizer or default_optimizer,
                accelerator_kwargs=accelerator_kwargs or {}, pipeline_plan=pipeline_plan)
    cpu, _ = devices_for([w for _, _, w in cases])
    t0 = time.perf_counter()
    with quiet():
        reference = run_loop(**spec, request={}, env=init(cpu=cpu or None), reference=True)
    ref_seconds = time.perf_counter() - t0
    tolerance = Tolerance(dtype, steps, reference["max_grad"], reference["eps"])
    results = _run_layouts(cases, loop_rank, lambda request: ({**spec, "request": request},),
                           reference, tolerance, cpu=cpu, context=context or _context(),
                           timeout_s=timeout_s, say=lambda _: None)
    return VerifyReport(tolerance=tolerance, reference_losses=reference["losses"],
                        results=results, reference_seconds=ref_seconds,
                        wall_seconds=time.perf_counter() - began, device=reference["device"])
