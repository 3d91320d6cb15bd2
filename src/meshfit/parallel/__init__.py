"""Parallel techniques, one per module, each a plain function over a model and a mesh; the
`Layout` that decides which of them a job uses; `parallelize`, which applies them in order.

    request.py      `LayoutRequest`: mesh sizes and layout options, as a user asks for them
    layout.py       `Layout`: the one decision (engine, mesh axes, rules, warnings, costs)
    rules.py        the rules it applies, each written once; the engine and axes it picks
    costs.py        `LayoutCosts`: how the engine divides and copies the model states
    mesh.py         the layout's `DeviceMesh` and the sub-meshes taken by axis name
    parallelize.py  `parallelize(model, layout, options)`: TP -> checkpointing -> compile ->
                    data-parallel wrapper
    ddp.py, zero1.py, fsdp.py     data parallel: DDP, ZeRO-1, ZeRO-2/3 (FSDP2)
    tp/, pp/        tensor (+ sequence) parallel, pipeline parallel
    ep.py           expert parallel: a mixture-of-experts block's experts split over ranks
    activation.py, compile.py     activation checkpointing, torch.compile
    clip.py         gradient-norm clipping across shards, meshes and stages
    options.py      the techniques' option names and their checks, without torch

Names are imported on first use (`from meshfit.parallel import apply_tp` loads only tp/).
"""

from __future__ import annotations

from meshfit._lazy import lazy_exports

_EXPORTS = {"Layout": "layout", "Engine": "layout", "ModelFacts": "layout",
            "LayoutRequest": "request", "ModelOptions": "options", "parallelize": "parallelize",
            "apply_ddp": "ddp", "apply_zero1": "zero1", "apply_fsdp": "fsdp", "apply_tp": "tp",
            "tp_cross_entropy": "tp", "build_pipeline": "pp", "Pipeline": "pp",
            "apply_activation_checkpointing": "activation", "apply_compile": "compile",
            "clip_grad_norm_": "clip"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(
    __name__, {name: f"{__name__}.{module}" for name, module in _EXPORTS.items()}, globals())
