"""What a pipeline-parallel run of `meshfit train` (``[parallel] pp > 1``) records of its
schedule, in two files of its run folder, written by the trainer (`write_run`, through
`meshfit.train.steps`) and read back by `meshfit pipeline-chart` (`read_run`,
`meshfit.charts.pipeline`):

- ``pipeline.json``: {"schedule", "pp", "microbatches", "virtual_stages", "num_stages",
  "points" (block indices where stages 1.. begin), "placement" (stage indices held by each pp
  rank)} (`Pipeline.meta()` gives it);
- ``pipeline_timings.jsonl``: one {"step", "rank", "stage", "microbatch", "phase", "start",
  "end"} per line, wall-clock seconds, as `meshfit.parallel.pp.Pipeline.timings` records them.

Both sides check the same schema: a file that does not match is a one-line ValueError naming
the file, the key and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from meshfit._files import atomic_write_text
from meshfit.parallel.pp import SCHEDULES

META_FILE, TIMINGS_FILE = "pipeline.json", "pipeline_timings.jsonl"
PHASES = ("forward", "backward", "backward_input", "backward_weight")
_META_KEYS = ("schedule", "pp", "microbatches", "virtual_stages", "num_stages", "points",
              "placement")
_TIMING_KEYS = ("step", "rank", "stage", "microbatch", "phase", "start", "end")


def write_run(out_dir, meta: dict, timings: Sequence[dict]) -> None:
    """Write `pipeline.json` and `pipeline_timings.jsonl` into `out_dir` (created if needed),
    each atomically: a reader never sees half a file."""
    _check_meta(meta, "meta")
    _check_timings(timings, meta, "timings")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / META_FILE,
                      json.dumps({k: meta[k] for k in _META_KEYS}, indent=1) + "\n")
    atomic_write_text(out / TIMINGS_FILE, "".join(
        json.dumps({k: t[k] for k in _TIMING_KEYS}) + "\n" for t in timings))


def read_run(run_dir) -> tuple[dict, list[dict]]:
    """(meta, timings) of a pipeline run folder; one-line ValueErrors name the file and fix."""
    run = Path(run_dir)
    if not run.is_dir():
        what = "is not a folder" if run.exists() else "does not exist"
        raise ValueError(f"run folder {str(run)!r} {what}; pass the folder given to "
                         "`meshfit train --out`")
    meta_path, timings_path = run / META_FILE, run / TIMINGS_FILE
    if not meta_path.is_file():
        raise ValueError(f"{meta_path} not found: the run in {str(run)!r} was not pipeline-"
                         "parallel; train with `[parallel] pp > 1` (e.g. --parallel.pp=2) to "
                         "record a pipeline schedule")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{meta_path} is not valid JSON ({_short(err)}); rerun the training "
                         "or restore the file") from None
    _check_meta(meta, str(meta_path))
    if not timings_path.is_file():
        raise ValueError(f"{timings_path} not found beside {META_FILE}; rerun the training to "
                         "record the timings")
    try:
        lines = timings_path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"{timings_path} is not UTF-8 text (byte {err.start}); rerun the "
                         "training or restore the file") from None
    timings = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{timings_path} line {n} is not valid JSON ({_short(err)}); "
                             "delete the line or rerun the training") from None
        _check_timings([entry], meta, f"{timings_path} line {n}")
        timings.append(entry)
    if not timings:
        raise ValueError(f"{timings_path} holds no timings; rerun the training for at least "
                         "one step")
    return meta, timings


def _short(err: Exception) -> str:
    return str(err).splitlines()[0]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_meta(meta, where: str) -> None:
    if not isinstance(meta, dict):
        raise ValueError(f"{where} must be a JSON object with keys {', '.join(_META_KEYS)}")
    missing = [k for k in _META_KEYS if k not in meta]
    unknown = sorted(set(meta) - set(_META_KEYS))
    if missing or unknown:
        raise ValueError(f"{where}: missing keys {missing}, unknown keys {unknown}; expected "
                         f"exactly {', '.join(_META_KEYS)}")
    if meta["schedule"] not in SCHEDULES:
        raise ValueError(f"{where}: schedule={meta['schedule']!r} is not one of "
                         f"{', '.join(SCHEDULES)}")
    for k in ("pp", "microbatches", "virtual_stages", "num_stages"):
        if not _is_int(meta[k]) or meta[k] < 1:
            raise ValueError(f"{where}: {k}={meta[k]!r} must be a positive integer")
    pp, v, n = meta["pp"], meta["virtual_stages"], meta["num_stages"]
    if n != pp * v:
        raise ValueError(f"{where}: num_stages={n} must equal pp x virtual_stages = {pp * v}")
    points, placement = meta["points"], meta["placement"]
    if not isinstance(points, list) or len(points) != n - 1 or not all(map(_is_int, points)):
        raise ValueError(f"{where}: points={points!r} must be a list of {n - 1} block indices "
                         "(where stages 1.. begin)")
    held = sorted(s for ranks in placement for s in ranks) if isinstance(placement, list) and \
        all(isinstance(r, list) for r in placement) else None
    if held != list(range(n)) or len(placement) != pp:
        raise ValueError(f"{where}: placement={placement!r} must list, for each of the {pp} "
                         f"pp ranks, the stages it holds (together 0..{n - 1}, each once)")


def _check_timings(timings: Sequence[dict], meta: dict, where: str) -> None:
    for t in timings:
        if not isinstance(t, dict) or not set(_TIMING_KEYS) <= set(t):
            raise ValueError(f"{where}: a timing must be an object with keys "
                             f"{', '.join(_TIMING_KEYS)}, got {t!r:.120}")
        bad = [k for k in ("step", "rank", "stage", "microbatch") if not _is_int(t[k])] + \
            [k for k in ("start", "end") if not isinstance(t[k], (int, float))
             or isinstance(t[k], bool)]
        if bad:
            raise ValueError(f"{where}: {', '.join(bad)} must be numbers (integers for step, "
                             f"rank, stage, microbatch), got {t!r:.120}")
        if t["phase"] not in PHASES:
            raise ValueError(f"{where}: phase={t['phase']!r} is not one of {', '.join(PHASES)}")
        if not 0 <= t["rank"] < meta["pp"] or t["stage"] not in meta["placement"][t["rank"]]:
            raise ValueError(f"{where}: rank={t['rank']} stage={t['stage']} does not match "
                             f"the placement {meta['placement']} (pp={meta['pp']})")
        if t["end"] < t["start"]:
            raise ValueError(f"{where}: end={t['end']} is before start={t['start']}")
