"""meshfit: train PyTorch models efficiently on one device, many devices and many machines.

The package is layered; each layer imports only the ones below it:

    _files, _lazy, _quiet  atomic writes, names imported on first use, quiet imports  (stdlib)
    _compat/       private torch and transformers names, one module per library
    distributed/   processes, devices, mesh axes, collectives, the spawner      (torch only)
    models/, data/ the reference models with their parallel plans; token data
    parallel/      the layout request and decision, one technique per file, `parallelize`
    optim (+ optim_names), memory, peft, checkpoint, plan, tracking
    accelerator/   the `Accelerator` facade for users' own loops (Accelerate's calls)
    utils/         the names scripts written for Accelerate import from accelerate.utils
    train/, launch/, cli/, __main__   `meshfit train`, the launcher, every subcommand's CLI
    verify/, generate, charts/, plan_validate   commands driving the trainer through its
                   public API: meshfit verify, generate / eval, plot, pipeline-chart,
                   plan --validate
"""

from __future__ import annotations

from meshfit._lazy import lazy_exports

__version__ = "0.1.0"

# Public names, imported on first use so that `import meshfit.models` does not pull in the
# whole stack.
_EXPORTS = {"Accelerator": "meshfit.accelerator", "DistEnv": "meshfit.distributed",
            "ParallelDims": "meshfit.distributed", "Layout": "meshfit.parallel.layout",
            "LayoutRequest": "meshfit.parallel.request"}
# What scripts written for Hugging Face Accelerate import from ``accelerate`` itself.
_EXPORTS.update({name: "meshfit.accelerator.compat" for name in (
    "DistributedType", "AutocastKwargs", "DataLoaderConfiguration", "DDPCommunicationHookType",
    "DistributedDataParallelKwargs", "FullyShardedDataParallelPlugin", "GradScalerKwargs",
    "InitProcessGroupKwargs", "ProfileKwargs", "find_executable_batch_size")})
# ... and the rest of ``accelerate``'s top level that scripts use.
_EXPORTS.update({"PartialState": "meshfit.state", "AcceleratorState": "meshfit.state",
                 "GradientState": "meshfit.state", "LocalSGD": "meshfit.local_sgd",
                 "skip_first_batches": "meshfit.data_loader",
                 "prepare_data_loader": "meshfit.data_loader",
                 "init_empty_weights": "meshfit.utils", "notebook_launcher": "meshfit.utils",
                 "debug_launcher": "meshfit.utils"})
__all__ = [*_EXPORTS, "__version__"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
