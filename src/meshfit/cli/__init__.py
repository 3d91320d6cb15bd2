"""The ``meshfit`` command line: each command's arguments, checked before any process starts
or any file is written, and what it prints. The work itself is in the packages below
(`meshfit.train`, `meshfit.launch`, `meshfit.plan`, `meshfit.checkpoint`, ...), which never
import this one; ``python -m meshfit`` (`meshfit.__main__`) and the console script run
`main.main`.

    main.py       ``meshfit COMMAND``: the table of commands, --help, --version, and how a
                  command's error ends it (one line, exit code 2)
    parser.py     `OneLineParser`: argparse whose errors are one line
    launch.py     ``meshfit launch``, and the launch flags `meshfit train` shares
    train.py      ``meshfit train``, in this process or on workers (``--worker``)
    generate.py   ``meshfit export``, ``generate`` and ``eval``
    plan.py       ``meshfit estimate`` and ``plan``
    calibrate.py  ``meshfit calibrate``: its arguments, its workers, its table
    charts.py     ``meshfit plot`` and ``pipeline-chart``
    env.py        ``meshfit env``: versions, devices and variables for a bug report

No module imports torch when it loads: a bad argument is refused before torch is imported
(tests/cli/test_fast_start.py).
"""
