"""`LayoutRequest`: what a user asks of a layout, one type for every way of asking.

`Accelerator(parallel=...)` (a request whole, or its sizes and keywords), `meshfit train`'s
``[parallel]`` section (`meshfit.train.config.ParallelConfig`, this type with its errors
spelled as config keys), `meshfit estimate --layout` and `meshfit verify --layouts` (one
grammar, `LayoutRequest.parse`) and the estimator's `meshfit.memory.LayoutSpec` all carry
one, whole: `meshfit.parallel.layout.Layout.resolve` turns it into the resolved `Layout`,
which keeps it (``layout.request``, every size and the ZeRO stage resolved). A new setting is
a field here plus its rule (`meshfit.parallel.rules`): every way of asking takes it from the
fields. Values that are wrong whatever the world size are refused when a request is built,
in one line naming the field; the rules that need the world size run in `Layout.resolve`.
No torch: a request is read and refused before torch loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from meshfit.distributed.dims import AXES, MESH_AXES, MeshSizes, ParallelDims
from meshfit.parallel.options import SCHEDULES

__all__ = ["LayoutRequest", "Offload", "ZERO_STAGES", "namer", "offload_stage_problem"]

ZERO_STAGES = (0, 1, 2, 3)
Offload = Literal["none", "cpu", "disk"]


# Field names in errors are the Accelerator's keywords unless the caller passes its own
# spellings (`meshfit train` passes its config keys: `meshfit.train.config.LAYOUT_NAMES`).
def namer(names: Mapping[str, str] | None):
    names = names or {}
    return lambda key: names.get(key, key)


def offload_stage_problem(offload: str, stage: int, n) -> str | None:
    """CPU offload moves FSDP2's sharded parameters and their state to the host, so only
    stage 3 has them to move: checked on the stage a request names (when it is built) and on
    the stage a layout resolves to, in these words both times."""
    if offload == "cpu" and stage < 3:
        return (f"{n('offload')}='cpu' needs zero_stage=3 (FSDP2 offloads the sharded "
                f"parameters and their state), and the layout's {n('zero_stage')} is {stage}; "
                f"set {n('dp_shard')} > 1 and zero_stage=3, or offload='none'")
    return None


@dataclass(frozen=True, kw_only=True)
class LayoutRequest(MeshSizes):
    """Mesh sizes (`MeshSizes`: pp, dp_replicate, dp_shard, cp, tp, ep) and the layout's
    options, validated when built (errors use the keyword names; `check` takes others)."""

    zero_stage: int | None = None
    """0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters) over the
    dp_shard ranks; unset: 3 when dp_shard > 1, else 0."""
    offload: Offload = "none"
    """"cpu": sharded parameters, gradients and optimizer state in host memory (stage 3);
    "disk": the optimizer state in files of ``offload_dir``, streamed through each step
    (`meshfit.parallel.disk`; every stage)."""
    offload_params: bool = False
    """offload="disk" under zero_stage 3: the sharded fp32 parameters (the master weights)
    in memory-mapped files of ``offload_dir`` too, held on the host (FSDP2's CPU offload
    policy): each block's shard is paged in when FSDP2 all-gathers it, ahead of use, and the
    optimizer's updates are written back to the files."""
    sync_each_batch: bool | str = False
    """Stages 2/3 under accumulation: reduce-scatter every micro-batch (true: less memory),
    only on the last (false: fewer collectives), or "auto" (decided from free memory)."""
    schedule: str = "1f1b"
    """pp > 1: "gpipe", "1f1b", "interleaved_1f1b" or "zero_bubble"."""
    microbatches: int | None = None
    """pp > 1: micro-batches ("chunks") per pipeline step; the global batch is
    micro_batch_size x microbatches x data-parallel ranks x accumulation. Unset: all of the
    accumulation (`meshfit train`), i.e. global_batch_size / (micro_batch_size x
    data-parallel ranks)."""
    virtual_stages: int | None = None
    """pp > 1: stages per rank (unset: 1, or 2 for interleaved_1f1b and zero_bubble)."""
    sequence_parallel: bool = False
    """tp > 1: norms and dropout on a sequence shard (the sequence length must divide by tp)."""
    loss_parallel: bool = False
    """tp > 1: the loss on vocabulary-sharded logits, never gathering them (not with pp)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self, names: Mapping[str, str] | None = None) -> None:
        """One-line ValueError for a value that is wrong whatever the world size; `names`
        spell the fields as the caller's user writes them (e.g. "parallel.zero_stage")."""
        self.dims()  # ParallelDims checks each size
        problem = self.problem(namer(names))
        if problem:
            raise ValueError(problem)

    def problem(self, n) -> str | None:
        """The first value of this request that is wrong whatever the world size, as one
        line (`n` spells a field's name: `meshfit.parallel.rules.namer`), or None."""
        stage = self.zero_stage
        if stage is not None and (isinstance(stage, bool) or stage not in ZERO_STAGES):
            return (f"{n('zero_stage')}={stage!r} must be 0 (DDP), 1, 2 or 3 (unset: 3 when "
                    "dp_shard > 1, else 0)")
        if self.offload not in get_args(Offload):
            return f"{n('offload')}={self.offload!r} is not one of 'none', 'cpu', 'disk'"
        if stage is not None:  # (unset: checked once the world size resolves it)
            problem = offload_stage_problem(self.offload, stage, n)
            if problem:
                return problem
        sync = self.sync_each_batch
        if not (sync is True or sync is False or sync == "auto"):
            return f"{n('sync_each_batch')}={sync!r} must be true, false or 'auto'"
        for key in ("sequence_parallel", "loss_parallel", "offload_params"):
            if not isinstance(getattr(self, key), bool):
                return f"{n(key)}={getattr(self, key)!r} must be true or false"
        if self.offload_params and self.offload != "disk":
            return (f"{n('offload_params')}=true puts the parameters in the files of "
                    f"offload='disk', and {n('offload')}={self.offload!r}; set "
                    f"{n('offload')}='disk' (with an offload_dir) or drop it")
        if self.schedule not in SCHEDULES:
            return f"{n('schedule')}={self.schedule!r} is not one of {', '.join(SCHEDULES)}"
        for key in ("microbatches", "virtual_stages"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                return f"{n(key)}={value!r} must be a positive integer (or unset)"
        return None

    # ------------------------------------------------------------------ the fields
    @staticmethod
    def field_names() -> tuple[str, ...]:
        """Every field of a request, sizes first (`AXES`), then the options, in declaration
        order: what every way of asking reads and writes."""
        return tuple(f.name for f in dataclasses.fields(LayoutRequest))

    def fields_dict(self) -> dict[str, Any]:
        """{field: value} of `field_names` (a subclass's own fields left out)."""
        return {name: getattr(self, name) for name in self.field_names()}

    def options(self) -> dict[str, Any]:
        """{option: value}: the fields that are not mesh sizes."""
        return {k: v for k, v in self.fields_dict().items() if k not in AXES}

    def dims(self, world_size: int | None = None) -> ParallelDims:
        """The mesh sizes as a validated `ParallelDims` (checked against `world_size`)."""
        return ParallelDims(world_size=world_size, **self.sizes())

    @classmethod
    def of(cls, dims: MeshSizes | None = None, **options) -> LayoutRequest:
        """The request of `dims` (default: every rank on dp_replicate) with `options`."""
        sizes = (dims or ParallelDims()).sizes()
        return cls(**sizes, **options)

    @classmethod
    def from_request(cls, request: LayoutRequest, **changes) -> LayoutRequest:
        """A `cls` (a subclass: the estimator's `LayoutSpec`, a config section) holding
        every field of `request`, whole, then `changes` (its own fields, or a request's
        field the caller fills in, e.g. an unset count of micro-batches)."""
        return cls(**{**request.fields_dict(), **changes})

    # ------------------------------------------------------------------ text
    @classmethod
    def parse(cls, text: str, *, flag: str = "--layout", **defaults) -> LayoutRequest:
        """A request of `cls` from ``key=value,key=value`` (`parse_items`), the keys it does
        not give from `defaults`, then the fields' own; `flag` names the text in errors
        (e.g. "--layouts")."""
        items = cls.parse_items(text, flag=flag)
        try:
            return cls(**{**defaults, **items})
        except ValueError as err:
            raise ValueError(f"{flag} {text!r}: {err}") from None

    @classmethod
    def parse_items(cls, text: str, *, flag: str = "--layout") -> dict[str, Any]:
        """``"tp=2,sequence_parallel=true"`` -> ``{"tp": 2, "sequence_parallel": True}``: the
        one grammar of a layout written on a command line. Keys are `cls`'s fields (those of
        a `meshfit train` [parallel] section, or of the estimator's spec), values TOML
        literals (``true``, ``4``, ``"disk"``; a bare word is a string); keys not given keep
        their defaults. One-line ValueError for a malformed item, an unknown or repeated key."""
        example = "e.g. \"dp_shard=2\" or \"tp=2,sequence_parallel=true\""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{flag} {text!r} is empty; write key=value pairs separated by "
                             f"commas, {example}")
        keys = tuple(f.name for f in dataclasses.fields(cls) if f.init)
        out: dict[str, Any] = {}
        for item in text.split(","):
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep or not key or not value:
                raise ValueError(f"{flag} {text!r}: {item.strip()!r} must look like key=value, "
                                 f"{example}")
            if key not in keys:
                raise ValueError(f"{flag} {text!r}: unknown key {key!r}; known keys: "
                                 f"{', '.join(keys)}")
            if key in out:
                raise ValueError(f"{flag} {text!r}: {key} is given twice")
            out[key] = _literal(value)
        return out

    def describe(self) -> str:
        """e.g. ``"dp_shard 4 x tp 2, ZeRO-3 + CPU offload, SP"``: the sizes above 1 (every
        axis of `AXES`), then the options in words; an option without words here reads
        ``key=value`` where it differs from its default (a new field is never left out)."""
        text = " x ".join(f"{a} {getattr(self, a)}" for a in AXES
                          if getattr(self, a) > 1) or "one process"
        parts = []
        if self.zero_stage:
            parts.append(f"ZeRO-{self.zero_stage}" + (" + CPU offload" if self.offload == "cpu"
                                                      else ""))
        if self.offload == "disk":
            parts.append("parameters and optimizer state on disk" if self.offload_params
                         else "optimizer state on disk")
        if self.sequence_parallel:
            parts.append("SP")
        if self.loss_parallel:
            parts.append("loss parallel")
        if self.pp > 1:
            parts.append(self.schedule + (f" m={self.microbatches}" if self.microbatches else "")
                         + (f" v={self.virtual_stages}" if (self.virtual_stages or 1) > 1
                            else ""))
        defaults = {f.name: f.default for f in dataclasses.fields(LayoutRequest)}
        parts += [f"{key}={value}" for key, value in self.options().items()
                  if key not in _WORDED and value != defaults[key]]
        return ", ".join([text, *parts])

    def to_json(self) -> dict[str, Any]:
        """{field: value} of every field (JSON types: the options are strings, integers,
        booleans or null)."""
        return dict(self.fields_dict())

    @property
    def world_size(self) -> int:
        """The processes this request names: the product of its mesh sizes (`MESH_AXES`;
        an axis left to "the remaining ranks", -1, counts 1)."""
        product = 1
        for axis in MESH_AXES:
            product *= max(getattr(self, axis), 1)
        return product


# The options `describe` puts in words (the others read key=value).
_WORDED = ("zero_stage", "offload", "offload_params", "sequence_parallel", "loss_parallel",
           "schedule", "microbatches", "virtual_stages")


def _literal(text: str) -> Any:
    """A TOML literal (3, true, "x") or, failing that, the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
