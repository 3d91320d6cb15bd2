"""The timed probes of `meshfit calibrate`: this machine's matmul, memory copy, collectives,
training steps and data-parallel engines, each run on every rank of the job at once.

Every rank runs the same steps, so sizes and repeat counts must agree: `_Ranks.time` takes the
slowest rank's median, and a probe that fails on one rank is dropped on all of them. The
figures they yield and the file they go to: `meshfit.plan.calibrate`; the models they are
fitted to: `meshfit.plan.fit`; the run that calls them in order: `meshfit.plan.measure`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from meshfit.distributed import is_initialized
from meshfit.models import GPT, GPTConfig
from meshfit.parallel.ddp import apply_ddp
from meshfit.parallel.zero1 import apply_zero1
from meshfit.plan.fit import (DP_ENGINES, KINDS, _fit_step, bus_factor, data_parallel_seconds,
                              fit_latency_bandwidth)
from meshfit.plan.trust import spread

_MATMUL_SECONDS = 0.5  # no matmul size whose single product would take longer than this
_CPU_SIZES = tuple(4096 * 4**i for i in range(8))  # 4 KiB ... 64 MiB
_GPU_SIZES = tuple(16384 * 4**i for i in range(9))  # 16 KiB ... 1 GiB


class Timing(NamedTuple):
    """One timed operation: the slowest rank's median seconds per call over the repeats."""

    seconds: float
    iters: int
    """Calls per repeat (enough to last about the probe's target)."""
    spread: float
    """(max - min) / median of the repeats (`meshfit.plan.trust.spread`), the widest
    rank's: how far one timing of it may stray."""

    @property
    def noise(self) -> float:
        """Half the repeats' range, in seconds: how far the median may be off (about two
        standard errors of a median of five), what a difference with it must beat."""
        return self.spread * self.seconds / 2


class _Ranks:
    """This job's ranks as the probes use them: its device, whether a process group joins
    them, and timings taken on the slowest of them, each repeated `repeats` times (every
    timing's spread is kept in `spreads`, for the file's ``raw.noise``)."""

    def __init__(self, env, repeats: int = 5):
        self.env = env
        self.device = env.device
        self.group = env.is_distributed and is_initialized()
        self.repeats = repeats
        self.spreads: list[float] = []

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.sync()
        if self.group:
            dist.barrier()

    def max(self, values: list[float]) -> list[float]:
        """Elementwise maximum over the ranks."""
        if not self.group:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def time(self, op, *, target: float, warmup: int = 1) -> Timing:
        """`op` timed `repeats` times, each over as many calls as last about `target`
        seconds, on every rank at once."""
        for _ in range(warmup):
            op()
        self.barrier()
        t0 = time.perf_counter()
        op()
        self.sync()
        first = time.perf_counter() - t0
        once = self.max([first])[0]
        iters = max(1, min(200, int(target / max(once, 1e-7))))
        # A call that alone lasts the target is timed one at a time: after a warm-up, the
        # call just timed is then the first repeat (the same barrier, call and sync), not one
        # more to wait for.
        samples = [first] if iters == 1 and warmup > 0 else []
        while len(samples) < self.repeats:
            self.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                op()
            self.sync()
            samples.append((time.perf_counter() - t0) / iters)
        seconds, width = self.max([statistics.median(samples), spread(samples)])
        self.spreads.append(width)
        return Timing(seconds, iters, width)


def _matmul_once(r: _Ranks, n: int, dtype) -> dict[str, Any] | None:
    """One n×n product of `dtype` timed on every rank; None on every rank if any failed."""
    a = b = None
    try:
        a = torch.randn(n, n, device=r.device).to(dtype)
        b = torch.randn(n, n, device=r.device).to(dtype)
        torch.mm(a, b)  # warm-up
        r.sync()
        failed = 0.0
    except (RuntimeError, NotImplementedError):  # no kernel for the dtype, or out of memory
        failed = 1.0
    if r.max([failed])[0] > 0:
        return None
    # `r.time` runs one more untimed product to choose its loop length
    timed = r.time(lambda: torch.mm(a, b), target=0.02, warmup=0)
    return {"n": n, "seconds": timed.seconds, "iters": timed.iters, "spread": timed.spread,
            "flops": 2.0 * n**3 / timed.seconds}


def _matmul(r: _Ranks) -> tuple[dict[str, float | None], dict[str, Any]]:
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    cuda = r.device.type == "cuda"
    sizes = [2**k for k in (range(10, 15) if cuda else range(7, 13))]  # GPU 1K..16K, CPU 128..4K
    flops, raw = {}, {"fp32_precision": torch.get_float32_matmul_precision()}
    for name, dtype in dtypes.items():
        rows = []
        for n in sizes:
            row = _matmul_once(r, n, dtype)
            if row is None:
                break
            rows.append(row)
            if row["seconds"] * 8 > _MATMUL_SECONDS:  # the next size (8x the work): too slow
                break
        raw[name] = rows
        flops[name] = rows[-1]["flops"] if rows else None
    return flops, raw


def _memory(r: _Ranks) -> tuple[float, dict[str, Any]]:
    nbytes = (1 << 30) if r.device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=r.device).fill_(1.0)
    dst = torch.empty_like(src)
    timed = r.time(lambda: dst.copy_(src), target=0.1)
    return 2.0 * nbytes / timed.seconds, {"bytes": nbytes, "seconds": timed.seconds,
                                          "iters": timed.iters, "spread": timed.spread,
                                          "counted": "2 x bytes (read + write)"}


def _collective_op(r: _Ranks, kind: str, size: int):
    """The callable for one collective of about `size` bytes, and S as it really is."""
    n, rank = r.env.world_size, r.env.rank
    per_rank = max(1, size // (4 * n))  # fp32 elements in one rank's chunk

    def new(numel: int):
        return torch.ones(numel, dtype=torch.float32, device=r.device)

    if kind == "all_reduce":
        t = new(max(1, size // 4))
        return (lambda: dist.all_reduce(t)), t.numel() * 4
    if kind == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        inp, out = new(per_rank), new(per_rank * n)
        return (lambda: gather(out, inp)), out.numel() * 4
    if kind == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        inp, out = new(per_rank * n), new(per_rank)
        return (lambda: scatter(out, inp)), inp.numel() * 4
    if kind == "all_to_all":
        inp, out = new(per_rank * n), new(per_rank * n)
        return (lambda: dist.all_to_all_single(out, inp)), inp.numel() * 4
    t = new(max(1, size // 4))  # send_recv: 0->1, 2->3, ...; an odd last rank waits
    if rank % 2 == 0 and rank + 1 < n:
        return (lambda: dist.send(t, rank + 1)), t.numel() * 4
    if rank % 2 == 1:
        return (lambda: dist.recv(t, rank - 1)), t.numel() * 4
    return (lambda: None), t.numel() * 4


def _collectives(r: _Ranks, sizes: tuple[int, ...]) -> tuple[dict, dict]:
    n = r.env.world_size
    if not r.group or n < 2:
        return ({k: {"bus_bandwidth": None, "latency": None} for k in KINDS},
                {"note": "one process: no collectives measured"})
    target = 0.01 if r.device.type == "cuda" else 0.02
    fits, raw = {}, {}
    for kind in KINDS:
        nbytes, timings = [], []
        for size in sizes:
            op, s_bytes = _collective_op(r, kind, size)
            timings.append(r.time(op, target=target, warmup=1))
            nbytes.append(s_bytes)
            del op
        factor = bus_factor(kind, n)
        fit = fit_latency_bandwidth(nbytes, [t.seconds for t in timings], factor)
        fits[kind] = {"bus_bandwidth": fit["bus_bandwidth"], "latency": fit["latency"]}
        raw[kind] = {"nbytes": nbytes, "seconds": [t.seconds for t in timings],
                     "iters": [t.iters for t in timings],
                     "spread": [t.spread for t in timings], "factor": factor, "r2": fit["r2"],
                     "max_relative_error": fit["max_relative_error"], "fit": fit["method"]}
    return fits, raw


_STEP_SHAPES = ((64, 2, 64, 8), (64, 6, 64, 8), (128, 2, 256, 8), (128, 4, 128, 8),
                (256, 2, 128, 8), (256, 4, 256, 4), (64, 2, 256, 8), (192, 3, 192, 4))
"""(d_model, n_layer, seq_len, batch) of the reference GPT the training steps are timed on:
widths, depths and lengths varied apart, so that each term of the fit is seen."""


def _train_steps(r: _Ranks, flops: dict) -> tuple[dict, dict]:
    """Per dtype that ran a matmul: the training-step fit (`meshfit.plan.calibrate`'s
    docstring) and its rows. fp16 is timed on CUDA only (on a CPU its autocast is an
    emulation nobody trains with)."""
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    fits, raw = {}, {}
    for name, dtype in dtypes.items():
        if flops.get(name) is None or (name == "fp16" and r.device.type != "cuda"):
            fits[name] = None
            continue
        rows = []
        for d, layers, seq, batch in _STEP_SHAPES:
            torch.manual_seed(0)
            heads = max(1, d // 32)
            model = GPT(GPTConfig(vocab_size=256, d_model=d, n_layer=layers, n_head=heads,
                                  d_ff=4 * d, max_seq_len=seq))
            model.to(r.device)
            x = torch.randint(0, 256, (batch, seq + 1), device=r.device)

            def fwd_bwd():
                with torch.autocast(r.device.type, dtype=dtype, enabled=dtype is not None):
                    loss = model(x[:, :-1], x[:, 1:])
                loss.backward()
                for p in model.parameters():
                    p.grad = None

            timed = r.time(fwd_bwd, target=0.05, warmup=1)
            rows.append({"d_model": d, "n_layer": layers, "seq_len": seq, "batch": batch,
                         "heads": heads,
                         "flops": model.config.flops_per_token(seq) * batch * seq,
                         "seconds": timed.seconds, "iters": timed.iters,
                         "spread": timed.spread})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt_seconds = r.time(opt.step, target=0.05, warmup=1).seconds
        n_params = sum(p.numel() for p in model.parameters())
        fit = _fit_step(rows, peak=flops[name])
        fit["optimizer_per_param"] = opt_seconds / n_params
        fits[name] = fit
        raw[name] = {"rows": rows, "optimizer_seconds": opt_seconds, "params": n_params,
                     "max_relative_error": fit.pop("max_relative_error"), "r2": fit.pop("r2")}
    return fits, raw


_DP_SHAPES = {"cpu": (192, 3, 64, 1), "cuda": (1024, 4, 1024, 8)}
"""(d_model, n_layer, seq_len, batch) of the reference GPT the engines are timed on. On the
CPU few tokens for the parameters: the collectives (~1.4M parameters' gradients) are then a
large share of the step, not a few percent of it inside its noise."""


def _data_parallel(r: _Ranks, colls: dict) -> tuple[dict | None, dict]:
    """Per engine, the exposed share of its modelled collectives (`meshfit.plan.calibrate`'s
    docstring) and the timings it came from, with the noise they cannot beat (the engine's
    timing's, and the step alone's, timed before and after the engines, with their drift);
    (None, {}) on one process."""
    if not r.group or any(colls[k]["latency"] is None for k in
                          ("all_reduce", "all_gather", "reduce_scatter")):
        return None, {}
    n = r.env.world_size
    d, layers, seq, batch = _DP_SHAPES["cuda" if r.device.type == "cuda" else "cpu"]
    mesh = init_device_mesh(r.device.type, (n,))
    x = torch.randint(0, 256, (batch, seq + 1), device=r.device)

    def model():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=256, d_model=d, n_layer=layers, n_head=d // 32,
                             d_ff=4 * d, max_seq_len=seq)).to(r.device)

    def fwd_bwd(m):
        m(x[:, :-1], x[:, 1:]).backward()

    alone, optimizer, params = _alone(r, model(), fwd_bwd)
    before = alone()
    steps = {engine: _engine_step(r, engine, model(), mesh, fwd_bwd) for engine in DP_ENGINES}
    after = alone()  # again: its drift is noise the engines saw too
    drift = abs(before.seconds - after.seconds) / 2 + max(before.noise, after.noise)
    collective = _measured_collective(colls)
    scales, raw = {}, {"shape": {"d_model": d, "n_layer": layers, "seq_len": seq,
                                 "batch": batch, "params": params},
                       "alone_seconds": [before.seconds, after.seconds],
                       "alone_optimizer_seconds": optimizer.seconds}
    for engine, timed in steps.items():
        # the step alone, with the optimizer step on the engine's share of the parameters
        saved = 0.0 if engine == "ddp" else optimizer.seconds * (1 - 1 / n)
        exposed = timed.seconds - (before.seconds + after.seconds) / 2 + saved
        modelled = data_parallel_seconds(engine, collective, params=params, units=layers + 1,
                                         shard=n, replicate=1, spans=(n, n), gathers=2,
                                         gathered_bytes=4)
        # (at most its noise, or below 0: flagged by meshfit.plan.trust, not used)
        scales[engine] = max(0.0, exposed) / modelled
        raw[engine] = {"seconds": timed.seconds, "spread": timed.spread,
                       "optimizer_seconds": optimizer.seconds - saved,
                       "exposed_seconds": exposed, "modelled_seconds": modelled,
                       "noise_seconds": timed.noise + drift + (optimizer.noise if saved else 0)}
    return scales, raw


def _alone(r: _Ranks, model, fwd_bwd):
    """The engines' training step without an engine, as a timer (forward, backward, AdamW
    on every parameter: what DDP adds only collectives to); the AdamW step alone, timed;
    the parameter count."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step():
        fwd_bwd(model)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer = r.time(opt.step, target=0.1, warmup=1)
    opt.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    return (lambda: r.time(step, target=0.3, warmup=1)), optimizer, params


def _engine_step(r: _Ranks, engine: str, model, mesh, fwd_bwd) -> Timing:
    """One training step of `model` (forward, backward, AdamW) under `engine` over all of
    `mesh`'s ranks, timed."""
    from meshfit.parallel.fsdp import apply_fsdp  # (FSDP2: ~2 s of imports; one process: unused)

    m = apply_fsdp(model, mesh, reshard_after_forward=True) if engine == "fsdp2" else \
        apply_ddp(model, mesh, device=r.device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)
    if engine == "zero1":
        opt = apply_zero1(opt, mesh.get_group())

    def step():
        fwd_bwd(m)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return r.time(step, target=0.3, warmup=2)


def _measured_collective(colls: dict):
    """`data_parallel_seconds`' `collective` from the fitted figures of `_collectives` (the
    span is not used: the figures were measured over these same ranks)."""

    def collective(kind, nbytes, k, span):
        fit = colls[kind]
        return 0.0 if k <= 1 or nbytes <= 0 else \
            fit["latency"] + bus_factor(kind, k) * nbytes / fit["bus_bandwidth"]

    return collective
