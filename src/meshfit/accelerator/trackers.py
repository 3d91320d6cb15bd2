"""Experiment trackers for the `Accelerator` (``log_with``, `init_trackers`, `log`,
`get_tracker`), run as Accelerate runs them: on the main process only. They live in
`meshfit.tracking`; a user's tracker object (``.name``, ``.log``, ``.store_init_configuration``,
``.finish``) is used as it is, started with its ``start()`` if it has one.
"""

from __future__ import annotations

import os

from meshfit.accelerator.compat.config import LoggerType
from meshfit.tracking import build_trackers

__all__ = ["get_tracker", "log", "start", "tracker_list"]


def tracker_list(log_with) -> list:
    """``log_with`` as a list of names (str, LoggerType) and tracker objects."""
    if log_with is None:
        return []
    items = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    out = []
    for item in items:
        if isinstance(item, LoggerType):
            item = item.value
        elif isinstance(item, str):
            item = item.lower()
        elif not (callable(getattr(item, "log", None)) and hasattr(item, "name")):
            raise ValueError(f"log_with: {item!r} is neither a tracker name nor a tracker "
                             "object (with .name, .log, .store_init_configuration, .finish)")
        out.append(item)
    return out


class _BlankTracker:
    """What `get_tracker` returns where no tracker runs (other processes): does nothing."""

    def __init__(self, name: str):
        self.name = name
        self.tracker = None

    def store_init_configuration(self, config: dict) -> None:
        pass

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        pass

    def finish(self) -> None:
        pass


def start(trackers: list, log_with: list, project_name: str, config: dict | None = None,
          init_kwargs: dict | None = None, *, project_dir: str | os.PathLike | None,
          logging_dir: str | os.PathLike | None) -> None:
    """Append the trackers of `log_with` to `trackers` and start them (`init_kwargs`:
    ``{tracker name: {its keyword arguments}}``), then record `config` on every one."""
    for item in log_with:
        if isinstance(item, str):
            trackers.extend(build_trackers(
                item, project_dir=project_dir, logging_dir=logging_dir,
                init_kwargs=init_kwargs or {}, project_name=project_name))
        else:  # a tracker object, already made by the user
            if callable(getattr(item, "start", None)):
                item.start()
            trackers.append(item)
    if config is not None:
        for tracker in trackers:
            tracker.store_init_configuration(config)


def get_tracker(trackers: list, name: str, unwrap: bool = False):
    """The tracker called `name` (`unwrap`: its library object); where no tracker runs
    (other processes), one that does nothing."""
    if trackers:
        for tracker in trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(f"{name} is not an available tracker stored inside the "
                         "`Accelerator`.")
    return _BlankTracker(name)


def log(trackers: list, values: dict, step: int | None = None,
        log_kwargs: dict | None = None) -> None:
    """Log `values` to every tracker (`log_kwargs`: ``{tracker name: {its log's keywords}}``)."""
    for tracker in trackers:
        tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))
