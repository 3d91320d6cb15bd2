"""`meshfit train`: config-driven training on top of `Accelerator`, and the files it writes
used afterwards. The commands themselves (arguments, printing) are in `meshfit.cli`; the
launcher is `meshfit.launch`.

    config.py          the run's configuration (a dataclass per [section]), from TOML + overrides
    preflight.py       every check before launch: config values, layout, this machine
    trainer.py         the training loop, read top to bottom; what a step trains (model, pipeline)
    run.py             what a run records (metrics, MFU, memory); checkpoints, preemption
    runfolder.py       the run folder claimed: checked, locked, written atomically
    models.py          [model]: presets, transformers configs and folders, factories
    batch_size.py      the largest micro-batch that fits, tensor-core shape advice
    generate.py        a trained model used: sampling and loss
    plan_validate.py   `meshfit plan --validate`: plans run here for a few steps
    plot.py            runs' metrics drawn
    pipeline_chart.py  a pipeline run's schedule drawn, with its measured bubble
"""
