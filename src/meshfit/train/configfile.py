"""`meshfit train`'s config file: TOML plus ``--section.key=value`` overrides read into a
`RunConfig` (`load_config`; `build_config` from nested dicts), unknown sections and keys
rejected and listed, and the resolved config written back (`to_toml`)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

import tomli_w

from meshfit.train.config import RunConfig, config_fields, toml_name

_SECTIONS = {f.name: f.default_factory for f in fields(RunConfig)}  # type: ignore[misc]


def _parse_value(text: str) -> Any:
    """A TOML literal (3, 1e-3, true, "x") or, failing that, the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _legacy_keys(data: dict[str, Any]) -> dict[str, Any]:
    """Keys of older configs, read as what they meant: [train] eval_batches = N (the
    validation set as N micro-batches) is eval_windows = N x micro_batch_size, the same
    windows, now fixed whatever the micro-batch (a resumed run of before keeps its
    validation set)."""
    train = data.get("train")
    if not isinstance(train, dict) or "eval_batches" not in train:
        return data
    train = dict(train)
    batches = train.pop("eval_batches")
    if "eval_windows" in train:
        raise ValueError(f"train.eval_batches={batches!r} and train.eval_windows="
                         f"{train['eval_windows']!r} both set the validation set; keep "
                         "train.eval_windows (eval_batches is its older form)")
    micro = train.get("micro_batch_size", _SECTIONS["train"]().micro_batch_size)
    for name, value in (("eval_batches", batches), ("micro_batch_size", micro)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"train.{name}={value!r} must be an integer >= 1")
    train["eval_windows"] = batches * micro
    return {**data, "train": train}


def build_config(data: dict[str, Any]) -> RunConfig:
    """A validated RunConfig from nested dicts; unknown sections/keys are listed in the error
    (older keys read as they were meant: `_legacy_keys`)."""
    data = _legacy_keys(data)
    unknown_sections = sorted(set(data) - set(_SECTIONS))
    if unknown_sections:
        raise ValueError(f"unknown config section(s) {', '.join(unknown_sections)}; known: "
                         f"{', '.join(_SECTIONS)}")
    sections = {}
    for name, factory in _SECTIONS.items():
        values = data.get(name, {})
        if not isinstance(values, dict):
            raise ValueError(f"config section [{name}] must be a table of keys, not "
                             f"{name} = {values!r}; write [{name}] followed by key = value lines")
        cls = type(factory())
        known = {toml_name(f): f.name for f in config_fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown key(s) in [{name}]: {', '.join(unknown)}; known keys: "
                             f"{', '.join(sorted(known))}")
        sections[name] = cls(**{known[k]: v for k, v in values.items()})
    return RunConfig(**sections)


def load_config(path: str | Path | None = None, overrides: list[str] = (), *,
                allowed: tuple[str, ...] | None = None) -> RunConfig:
    """Read a TOML file (optional) and apply ``--section.key=value`` overrides (only of the
    sections or ``section.key`` names in `allowed`, when given)."""
    data = _read_toml(Path(path)) if path is not None else {}
    for item in overrides:
        _override(data, item, allowed)
    return build_config(data)


def _read_toml(path: Path) -> dict[str, Any]:
    """--config's file as nested dicts; a one-line ValueError for a file that is missing,
    unreadable, not UTF-8 or not TOML."""
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ValueError(f"--config={str(path)!r} {what}; give a TOML file")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise ValueError(f"--config={str(path)!r} cannot be read ({err.strerror or err}); "
                         "give a readable TOML file") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"--config={str(path)!r} is not UTF-8 text (byte {err.start}); "
                         "give a TOML file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        reason = " ".join(str(err).split())  # one line, with its line and column
        raise ValueError(f"--config={str(path)!r} is not valid TOML: {reason}") from None


def _override(data: dict[str, Any], item: str, allowed: tuple[str, ...] | None) -> None:
    """One ``--section.key=value`` set in `data`."""
    key, sep, value = item.removeprefix("--").partition("=")
    section, dot, name = key.partition(".")
    if not sep or not dot or not section or not name:
        raise ValueError(f"override {item!r} must look like --section.key=value, "
                         "e.g. --train.steps=100")
    if allowed is not None and section not in allowed and key not in allowed:
        kept = ", ".join(a if "." in a else f"[{a}]" for a in allowed)
        raise ValueError(f"override {item!r}: a resumed run keeps its saved config except "
                         f"{kept}; start a new run to change {key}")
    table = data.setdefault(section, {})
    if not isinstance(table, dict):
        raise ValueError(f"override {item!r}: {section} = {table!r} in the config is a value, "
                         f"not a [{section}] table of keys; write [{section}] followed by "
                         "key = value lines")
    table[name] = _parse_value(value)


def to_toml(cfg: RunConfig) -> str:
    """The whole config as a TOML file (unset fields left out: they mean the default),
    written by a TOML library (tomli-w: any Unicode, every escape TOML's own) and read back
    before it is returned: a config that would not come back as itself is refused in one
    line naming the setting, before any run folder or process depends on the file."""
    data = {section: {key: list(value) if isinstance(value, tuple) else value
                      for key, value in values.items() if value is not None}  # no null
            for section, values in cfg.to_dict().items()}
    try:
        text = tomli_w.dumps(data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the config cannot be written as TOML ({err}); check the settings' "
                         "values") from None
    back = build_config(tomllib.loads(text))
    if back != cfg:
        differ = [f"{s}.{k}" for s, values in cfg.to_dict().items()
                  for k, v in values.items() if back.to_dict()[s].get(k) != v]
        raise ValueError(f"{', '.join(differ) or 'the config'} would not read back as written "
                         "in config.toml; use plain values (strings, numbers, booleans, lists)")
    return text
