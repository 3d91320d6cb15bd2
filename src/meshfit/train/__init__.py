"""`meshfit train` and `meshfit launch`: config-driven training on top of `Accelerator`.

    config.py          the run's frozen, validated configuration (TOML + --section.key=value)
    trainer.py         the training loop, read top to bottom
    run.py             the run folder: metrics, checkpoints and resume, preemption
    runfolder.py       the run folder claimed: checked, locked, written atomically
    cli.py             the `meshfit` command
    launch.py          torchrun's elastic agent with safer defaults
    batch_size.py      the largest micro-batch that fits, tensor-core shape advice
    pipeline_chart.py  a pipeline run's schedule as a Gantt chart
    models.py          [model]: presets, transformers configs and folders, factories
    observe.py         per-step figures (MFU, memory, data wait) and where they go
    generate.py        `meshfit generate` and `meshfit eval`
    plan_cli.py        `meshfit estimate`, `plan`, `calibrate`; plan_validate.py checks plans
    plot.py            `meshfit plot`; envinfo.py `meshfit env`
"""
