"""`meshfit train`: config-driven training on top of `Accelerator`, and the files it writes
used afterwards. The commands themselves (arguments, printing) are in `meshfit.cli`; the
launcher is `meshfit.launch`.

    config.py          the run's configuration: one frozen, validated dataclass per [section],
                       read from TOML + --section.key=value overrides
    preflight.py       every check before launch: the config's values, the layout for a
                       world size, this machine
    trainer.py         the training loop, read top to bottom, and what a step trains: the
                       prepared model or this rank's pipeline stages
    run.py             what a run records (metrics, MFU, memory, data wait) and how it ends
                       early: checkpoints and resume, preemption
    runfolder.py       the run folder claimed: checked, locked, written atomically
    models.py          [model]: presets, transformers configs and folders, factories
    batch_size.py      the largest micro-batch that fits, tensor-core shape advice
    generate.py        a trained model used: sampling and loss
    plan_validate.py   `meshfit plan --validate`: plans run here for a few steps
    plot.py            runs' metrics drawn
    pipeline_chart.py  a pipeline run's schedule drawn, with its measured bubble
"""
