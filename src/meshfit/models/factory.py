"""``module:attribute`` specs: how a user names their own model factory or plan
(`[model] factory`, `tp_plan`, `pipeline_plan`, a model folder's config.json, `meshfit
estimate mymodels:build`)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

__all__ = ["import_object"]


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
