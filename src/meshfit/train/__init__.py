"""`meshfit train`: config-driven training on top of `Accelerator`, and the files it writes
used afterwards. The commands themselves (arguments, printing) are in `meshfit.cli`; the
launcher is `meshfit.launch`; what uses a run's files is in rooms of its own
(`meshfit.verify`, `meshfit.generate`, `meshfit.charts`, `meshfit.plan_validate`).

    config.py           the run's configuration: a frozen dataclass per [section]
    configfile.py       the config read from TOML + --section.key=value overrides, written back
    tokens.py           [data]'s tokenizer and token splits
    preflight.py        every check before launch: config values, layout, this machine
    steps.py            what a step trains: the prepared model or this rank's pipeline stages
    trainer.py          `TrainingRun` (a run set up, `step()`) and the training loop
    run.py              what a run records (metrics, MFU, memory); checkpoints, preemption
    runfolder.py        the run folder claimed: checked, locked, written atomically
    pipeline_record.py  a pipeline run's schedule and timings, written for its chart
    models.py           [model]: presets, transformers configs and folders, factories
    batch_size.py       the largest micro-batch that fits, tensor-core shape advice

`TrainingRun(cfg, env)` is the public way to set a run up and take its optimizer steps
(`meshfit verify` drives the trainer through it); `train` runs one to the end.
"""

from meshfit._lazy import lazy_exports

# trainer.py imports torch: its names load on first use, so that a config is read and
# checked without it (`meshfit train` refuses a bad one before torch loads).
_EXPORTS = {"StepResult": "meshfit.train.trainer", "TrainingRun": "meshfit.train.trainer"}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
