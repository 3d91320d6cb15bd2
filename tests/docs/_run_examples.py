"""Run the manual's examples for `test_docs_examples.py`: ``python _run_examples.py JOBS OUT``.

JOBS is a JSON list of ``{"name", "cwd", "log", "kind": "meshfit"|"code", "args"|"code"}``;
OUT gets one ``{"name", "returncode", "output", "seconds"}`` per job, in order.

Each job runs as ``python -m meshfit ARGS`` or ``python -c CODE`` would, in a process of its
own forked from this one, so that torch, torch._dynamo (which ``Accelerator.prepare`` imports)
and meshfit are imported once for every example instead of once per example: on two cores
that is about 4 s per example saved. A forked job still starts from a clean interpreter state
as far as the examples can tell: nothing here runs an operator, starts a thread or joins a
process group before forking (as the tests' fork server, `tests/conftest.py`).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback

TIMEOUT_S = 120.0


def _preload() -> None:
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401

    import meshfit  # noqa: F401
    import meshfit.accelerator  # noqa: F401
    import meshfit.cli.main  # noqa: F401


def _exit_code(err: SystemExit) -> int:
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code
    print(err.code, file=sys.stderr)  # sys.exit("message"): Python prints it, exit status 1
    return 1


def _child(job: dict) -> None:
    """Run `job` in this (forked) process and leave with its exit status; never returns."""
    code = 1
    try:
        os.setpgrp()  # so that a job that overruns is killed with whatever it started
        os.chdir(job["cwd"])
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        try:
            if job["kind"] == "meshfit":
                sys.argv = ["meshfit", *job["args"]]
                runpy.run_module("meshfit", run_name="__main__", alter_sys=True)
            else:
                sys.argv = ["-c"]
                exec(compile(job["code"], job["name"], "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as err:
            code = _exit_code(err)
        except BaseException:  # noqa: BLE001 - every failure is this job's result
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)  # not the parent's atexit handlers, nor its buffered output


def _run(job: dict) -> dict:
    sys.stdout.flush()
    sys.stderr.flush()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(job)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() - start > TIMEOUT_S:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            returncode = f"killed after {TIMEOUT_S:.0f} s"
            break
        time.sleep(0.02)
    with open(job["log"], encoding="utf-8", errors="replace") as fh:
        output = fh.read()
    return {"name": job["name"], "returncode": returncode, "output": output,
            "seconds": round(time.monotonic() - start, 2)}


def main(jobs_path: str, out_path: str) -> None:
    with open(jobs_path, encoding="utf-8") as fh:
        jobs = json.load(fh)
    _preload()
    results = [_run(job) for job in jobs]
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main(*sys.argv[1:])
