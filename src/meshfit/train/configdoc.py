"""`meshfit train --print-config`: every key of the config file with its value and one line of
meaning, as a TOML file (what ``--print-config > run.toml`` gives back is a config).

The meanings are read from the config classes themselves (`meshfit.train.config` and the
classes its sections extend: `meshfit.parallel.options.ModelOptions`,
`meshfit.parallel.request.LayoutRequest`, `meshfit.distributed.dims.MeshSizes`): the docstring
under a field, else the comment on its line. One source: a key added to a class is listed with
the words written beside it, and a key without words fails tests/train/test_print_config.py.
No torch: it runs before anything is built.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from functools import cache

import tomli_w

from meshfit.train.config import RunConfig, config_fields, toml_name


@cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its meaning as one line} for `cls` and the dataclasses it extends (a
    subclass's words win)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and klass is not object:
            out.update(_own_docs(klass))
    return out


def _own_docs(klass: type) -> dict[str, str]:
    """The fields `klass` itself declares: the string literal after each (a field
    docstring), else the comment at the end of its line."""
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):  # no source installed: keys without words
        return {}
    comments = {token.start[0]: token.string.lstrip("#").strip()
                for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT}
    body = ast.parse(source).body[0].body
    out = {}
    for node, after in zip(body, [*body[1:], None]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and \
                isinstance(after.value.value, str):
            out[node.target.id] = one_line(after.value.value)
        elif node.end_lineno in comments:
            out[node.target.id] = one_line(comments[node.end_lineno])
    return out


def one_line(text: str) -> str:
    """`text` on one line, cut after its first sentence (a full stop and a space, not after
    "e.g." or "i.e.")."""
    text = " ".join(text.split())
    for match in re.finditer(r"\. ", text):
        before = text[:match.start()]
        if not before.endswith(("e.g", "i.e", "etc", "vs")) and len(before) >= 20:
            return before + "."
    return text


def describe(cfg: RunConfig | None = None) -> str:
    """The config (default: every default) as TOML, each key followed by its meaning as a
    comment; a key whose value is unset is a commented line (TOML has no null), and a value
    other than the default names the default."""
    cfg = cfg or RunConfig()
    lines = ["# meshfit train's config: every key, its value and what it means",
             "# (meshfit train --print-config)"]
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        docs = field_docs(type(values))
        lines += ["", f"[{section.name}]"]
        for f in config_fields(values):
            key, value = toml_name(f), getattr(values, f.name)
            default = _default(values, f)
            meaning = docs.get(f.name, "")
            if value != default:
                meaning += f" (default: {_literal(default)})"
            entry = f"{key} = {_literal(value)}" if value is not None else f"# {key} = (unset)"
            lines.append(f"{entry:<34} # {meaning}" if meaning else entry)
    return "\n".join(lines) + "\n"


def _default(values, f: dataclasses.Field):
    """The value field `f` of the section `values` takes when left unset, the other keys as
    they are (train.warmup_steps follows train.steps)."""
    unset = f.default_factory() if f.default is dataclasses.MISSING else f.default
    try:
        return getattr(dataclasses.replace(values, **{f.name: unset}), f.name)
    except ValueError:  # the others do not go with the default (a batch size, a source)
        return getattr(type(values)(), f.name)


def _literal(value) -> str:
    """A value as TOML writes it, on one line (unset: "unset")."""
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()
