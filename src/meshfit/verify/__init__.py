"""`meshfit verify`: a run checked under each layout against one process, the same first
optimizer steps on the same global batches, the losses and the final weights compared
against a stated tolerance.

    layouts.py  what to run and how it compares: `verify_config` (a `meshfit train`
                configuration), `compare_layouts` (a loop of your own), `Tolerance`,
                `VerifyReport`; the checks before any process starts (no torch)
    runs.py     what each process runs: the configuration's steps through
                `meshfit.train.TrainingRun`, or the user's step function on `Accelerator`

    from meshfit.verify import compare_layouts
"""

from __future__ import annotations

from meshfit._lazy import lazy_exports

# layouts.py loads no torch (the command refuses a bad layout before torch is imported):
# its names load on first use all the same, like every package's.
_EXPORTS = {name: "meshfit.verify.layouts" for name in (
    "LayoutResult", "Tolerance", "VerifyReport", "compare", "compare_layouts", "parse_layout",
    "plan_config", "verify_config")}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
