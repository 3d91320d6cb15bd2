"""``module:attribute`` specs: how a user names their own model factory or plan
(`[model] factory`, `tp_plan`, `pipeline_plan`, `meshfit estimate mymodels:build`), and the
rule for code that a model *folder* names instead (`folder_code`, `check_folder_code`).

A spec the user typed (a config key, a command's argument) is theirs to run. A folder's
config.json is not: whoever wrote the folder chose what it names, and opening the folder
(``meshfit eval``, ``generate``, ``train`` from it, ``estimate``...) must not run it. Two
kinds of folder name code: meshfit's own (``"model_type": "meshfit-factory"`` with
``"factory": "module:function"``, imported and called to build the model) and transformers'
remote code (``"auto_map"`` naming classes in the folder's .py files, in config.json for a
``model_type`` transformers does not itself hold, or in tokenizer_config.json for a tokenizer
class it does not hold). Each runs only when the user says so: ``--trust-code``
on a command, ``model.trust_code = true`` in a run's config, as transformers'
``trust_remote_code``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["check_folder_code", "folder_code", "import_object"]

FACTORY_TYPE = "meshfit-factory"
"""config.json's ``model_type`` of a model built by a user's factory (`meshfit.checkpoint.
saved`)."""


def import_object(spec: str, field: str) -> Any:
    """The object `spec` = ``module:attribute`` names (dotted attributes allowed), with the
    current folder on the import path as for ``python -m``; a one-line ValueError naming
    `field` when the spec is malformed, the module cannot be imported or lacks the name."""
    module, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module or not attr:
        raise ValueError(f"{field}={spec!r} must look like module:attribute, e.g. "
                         "mymodels:build_model")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module)
    except ImportError as err:
        raise ValueError(f"{field}={spec!r}: cannot import {module!r} ({err}); run from the "
                         "folder holding it or add it to PYTHONPATH") from None
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - the module's own code failed, or exited
        what = (f"called sys.exit({err.code!r})" if isinstance(err, SystemExit) else
                f"raised {type(err).__name__}: {' '.join(str(err).split()) or '(no message)'}")
        raise ValueError(f"{field}={spec!r}: importing {module!r} {what}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field}={spec!r}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _read_json(path: Path) -> dict:
    """A folder's JSON file as a dict; {} when absent or unreadable (its reader says why)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _transformers_holds(model_type: Any = None, tokenizer_class: Any = None) -> bool:
    """Whether transformers builds `model_type` (or loads `tokenizer_class`) with its own code:
    then it ignores a folder's ``auto_map`` unless told to trust it, as its ``has_local_code``
    decides. False without transformers."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
    except ImportError:
        return False
    if isinstance(tokenizer_class, str) and tokenizer_class:
        base = tokenizer_class.removesuffix("Fast")
        return any(tokenizer_class_from_name(n) is not None for n in (base, base + "Fast"))
    return isinstance(model_type, str) and model_type in CONFIG_MAPPING_NAMES


def _shown(auto_map: Any) -> str:
    if isinstance(auto_map, dict):
        return ", ".join(f"{k} -> {v}" for k, v in auto_map.items())
    return repr(auto_map)


def folder_code(folder, *, factories: bool = True) -> str | None:
    """What code opening `folder` (a model folder, or a config.json itself) would run, in
    words ("its config.json names code to run when the model is built: factory
    'mymodels:build'"): a meshfit factory, transformers' remote code for the model
    (config.json's ``auto_map``) or for its tokenizer (tokenizer_config.json's); None when it
    names none or its files cannot be read (the reader that opens them says what is wrong).
    `factories`: whether the reader builds meshfit-factory folders (`meshfit eval`,
    ``generate``); transformers' readers (``hf_model``, ``estimate``) never call a factory:
    they refuse its model_type."""
    path = Path(folder).expanduser()
    single = path.suffix == ".json" and not path.is_dir()
    config = _read_json(path if single else path / "config.json")
    model = "its config.json names code to run when the model is built"
    if factories and config.get("model_type") == FACTORY_TYPE:
        return f"{model}: factory {config.get('factory')!r}"
    if config.get("auto_map") and not _transformers_holds(model_type=config.get("model_type")):
        return f"{model}: transformers remote code (auto_map: {_shown(config['auto_map'])})"
    tokenizer = {} if single else _read_json(path / "tokenizer_config.json")
    auto_map = tokenizer.get("auto_map")
    if isinstance(auto_map, dict):
        auto_map = auto_map.get("AutoTokenizer")
    if auto_map and not _transformers_holds(tokenizer_class=tokenizer.get("tokenizer_class")):
        return ("its tokenizer_config.json names code to run when the tokenizer loads: "
                f"transformers remote code (auto_map: AutoTokenizer -> {_shown(auto_map)})")
    return None


def check_folder_code(folder, *, trust_code: bool, field: str, how: str,
                      factories: bool = True) -> None:
    """A one-line ValueError when opening `folder` would run code it names (`folder_code`)
    and the user did not say to trust it; `field` names where the folder was given
    ("RUN_OR_MODEL", "model.hf_model"), `how` the way to say so ("--trust-code",
    "model.trust_code = true")."""
    code = folder_code(folder, factories=factories)
    if code is not None and not trust_code:
        raise ValueError(f"{field}={str(folder)!r}: {code}; a folder's code runs only when you "
                         f"say so: add {how} if you trust whoever wrote the folder")
