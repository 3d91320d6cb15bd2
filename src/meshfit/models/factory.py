"""``module:attribute`` specs: how a user names their own model factory or plan
(`[model] factory`, `tp_plan`, `pipeline_plan`, `meshfit estimate mymodels:build`), and the
rule for code that a model *folder* names instead (`folder_code`, `check_folder_code`).

A spec the user typed (a config key, a command's argument) is theirs to run. A folder's
config.json is not: whoever wrote the folder chose what it names, and opening the folder
(``meshfit eval``, ``generate``, ``train`` from it, ``estimate``...) must not run it. Two
kinds of folder name code: meshfit's own (``"model_type": "meshfit-factory"`` with
``"factory": "module:function"``, imported and called to build the model) and transformers'
remote code (``"auto_map"`` naming classes in the folder's .py files, for a ``model_type``
transformers does not itself hold). Each runs only when the user says so: ``--trust-code``
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


def _config_file(folder) -> Path:
    path = Path(folder).expanduser()
    return path if path.suffix == ".json" and not path.is_dir() else path / "config.json"


def _transformers_holds(model_type: Any) -> bool:
    """Whether transformers builds `model_type` from its own code (then it ignores a folder's
    ``auto_map`` unless told to trust it); False without transformers."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return False
    return isinstance(model_type, str) and model_type in CONFIG_MAPPING_NAMES


def folder_code(folder, *, factories: bool = True) -> str | None:
    """What code the config.json of `folder` (a model folder, or a config.json itself) names
    to build its model, in words ("factory 'mymodels:build'", "transformers remote code
    (auto_map: AutoModelForCausalLM -> modeling_x.MyModel)"); None when it names none or
    there is no readable config.json (the reader that opens it says what is wrong).
    `factories`: whether the reader builds meshfit-factory folders (`meshfit eval`,
    ``generate``); transformers' readers (``hf_model``, ``estimate``) never call a factory:
    they refuse its model_type."""
    try:
        config = json.loads(_config_file(folder).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if factories and config.get("model_type") == FACTORY_TYPE:
        return f"factory {config.get('factory')!r}"
    auto_map = config.get("auto_map")
    if auto_map and not _transformers_holds(config.get("model_type")):
        shown = ", ".join(f"{k} -> {v}" for k, v in auto_map.items()) \
            if isinstance(auto_map, dict) else repr(auto_map)
        return f"transformers remote code (auto_map: {shown})"
    return None


def check_folder_code(folder, *, trust_code: bool, field: str, how: str,
                      factories: bool = True) -> None:
    """A one-line ValueError when the config.json of `folder` names code to run (`folder_code`)
    and the user did not say to trust it; `field` names where the folder was given
    ("RUN_OR_MODEL", "model.hf_model"), `how` the way to say so ("--trust-code",
    "model.trust_code = true")."""
    code = folder_code(folder, factories=factories)
    if code is not None and not trust_code:
        raise ValueError(f"{field}={str(folder)!r}: its config.json names code to run when the "
                         f"model is built, {code}; a folder's code runs only when you say so: "
                         f"add {how} if you trust whoever wrote the folder")
