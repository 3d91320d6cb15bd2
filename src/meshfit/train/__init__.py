"""`meshfit train`: config-driven training on top of `Accelerator`, and the files it writes
used afterwards. The commands themselves (arguments, printing) are in `meshfit.cli`; the
launcher is `meshfit.launch`.

    config.py          the run's configuration: a frozen dataclass per [section]
    configfile.py      the config read from TOML + --section.key=value overrides, written back
    tokens.py          [data]'s tokenizer and token splits
    preflight.py       every check before launch: config values, layout, this machine
    steps.py           what a step trains: the prepared model or this rank's pipeline stages
    trainer.py         the training loop, read top to bottom
    run.py             what a run records (metrics, MFU, memory); checkpoints, preemption
    runfolder.py       the run folder claimed: checked, locked, written atomically
    models.py          [model]: presets, transformers configs and folders, factories
    batch_size.py      the largest micro-batch that fits, tensor-core shape advice
    generate.py        a trained model used: sampling and loss
    plan_validate.py   `meshfit plan --validate`: plans run here for a few steps
    plot.py            runs' metrics drawn
    pipeline_chart.py  a pipeline run's schedule drawn, with its measured bubble
"""
