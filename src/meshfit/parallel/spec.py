"""`LayoutSpec`: a layout as the memory estimate (`meshfit.memory`) and the planner
(`meshfit.plan`) describe it (their JSON's ``layout``): a
`meshfit.parallel.request.LayoutRequest`, whole, made concrete, with the micro-batch and the
activation checkpointing it runs with. No torch: `meshfit estimate --layout` is read and
refused before torch loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from meshfit.parallel.request import LayoutRequest
from meshfit.parallel.rules import default_zero_stage

__all__ = ["Checkpointing", "LayoutSpec"]

Checkpointing = Literal["none", "selective", "full", "budget"]


@dataclass(frozen=True, kw_only=True)
class LayoutSpec(LayoutRequest):
    """A `LayoutRequest` made concrete, with the micro-batch and checkpointing it runs with
    (`LayoutSpec.from_request(request, micro_batch_size=...)` keeps every field of a
    request: what `meshfit train` checks before launch is the layout it launches).

    Concrete: a spec describes its own world, so the axis left to "the remaining ranks"
    (-1) has 1, an unset ZeRO stage is the one `meshfit train` takes
    (`meshfit.parallel.rules.default_zero_stage`), and unset pipeline micro-batches and
    virtual stages are 1."""

    activation_checkpointing: Checkpointing = "none"
    activation_checkpointing_budget: float = 0.5
    """"budget": the share of each block's activations torch.compile's partitioner keeps."""
    activation_offload: bool = False
    """The blocks' saved activations (what checkpointing keeps) in host memory."""
    micro_batch_size: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()  # the request's own checks
        if self.activation_checkpointing not in get_args(Checkpointing):
            raise ValueError(f"activation_checkpointing={self.activation_checkpointing!r} is "
                             f"not one of {', '.join(get_args(Checkpointing))}")
        budget = self.activation_checkpointing_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) \
                or not 0 <= budget <= 1:
            raise ValueError(f"activation_checkpointing_budget={budget!r} must be a number in "
                             "[0, 1]")
        if not isinstance(self.activation_offload, bool):
            raise ValueError(f"activation_offload={self.activation_offload!r} must be true or "
                             "false")
        mbs = self.micro_batch_size
        if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
            raise ValueError(f"micro_batch_size={mbs!r} must be an integer >= 1")
        concrete = {axis: 1 for axis, size in self.sizes().items() if size == -1}
        dp_shard = concrete.get("dp_shard", self.dp_shard)
        concrete.update(zero_stage=self.zero_stage if self.zero_stage is not None
                        else default_zero_stage(dp_shard),
                        microbatches=self.microbatches or 1,
                        virtual_stages=self.virtual_stages or 1)
        for name, value in concrete.items():
            object.__setattr__(self, name, value)  # frozen: set once, while being built

    def to_json(self) -> dict[str, Any]:
        out = {**super().to_json(), "activation_checkpointing": self.activation_checkpointing}
        if self.activation_checkpointing == "budget":
            out["activation_checkpointing_budget"] = self.activation_checkpointing_budget
        if self.activation_offload:
            out["activation_offload"] = True
        return {**out, "micro_batch_size": self.micro_batch_size}

    def describe(self) -> str:
        text = super().describe()
        if self.activation_checkpointing == "budget":
            text += f", budget {self.activation_checkpointing_budget:g} checkpointing"
        elif self.activation_checkpointing != "none":
            text += f", {self.activation_checkpointing} checkpointing"
        if self.activation_offload:
            text += ", activations offloaded"
        return text + f", micro-batch {self.micro_batch_size}"
