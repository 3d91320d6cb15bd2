"""Expert parallelism for transformers' mixture-of-experts decoders (Mixtral, Qwen2-MoE,
Qwen3-MoE, GLM-4-MoE, DeepSeek-V3), the same exchange as meshfit's reference MoE
(`meshfit.parallel.ep`).

transformers 5 holds each MoE layer's routed experts fused in one module,
``mlp.experts.gate_up_proj`` [E, 2F, d] and ``mlp.experts.down_proj`` [E, d, F], called as
``experts(hidden_states [N, d], top_k_index [N, k], top_k_weights [N, k])`` after the layer's
own router. Only that call is distributed: the router (softmax or sigmoid top-k, DeepSeek's
and GLM's grouped routing over ``n_group`` / ``topk_group``, ``routed_scaling_factor``), the
shared experts (Qwen2-MoE's gated ``shared_expert``, DeepSeek's and GLM's
``shared_experts``) and every dense layer (``first_k_dense_replace``, ``mlp_only_layers``)
stay the model's own code and data-parallel parameters.

    apply_hf_ep(model, mesh["ep"])   # `meshfit.parallel.parallelize` step 2b

On each ep rank p the experts' two parameters become DTensors ``Shard(0)`` over
``mesh["ep"]`` (experts [p E/P, (p+1) E/P) local), and the module's forward (an instance
attribute, so the class and every other instance keep transformers' own) sorts the rank's
N*k assignments by expert, sends the rows to their experts' ranks with
`ExpertParallel.dispatch` (all_to_all_single, variable splits, differentiable), runs the
local experts as transformers' "eager" loop does (``linear(x, gate_up[e])``, gate * up
through the configured activation, ``linear(h, down[e])``), and adds the weighted outputs
back to their tokens. Dropless: every assignment is computed, whatever the load. Gradients
are scaled by 1/ep as in `meshfit.parallel.ep` (the module docstring there says why).

Which classes: `MAPPED` (the experts layout above, no biases, concatenated gate/up, not
transposed); an experts module of another class is refused by `hf_ep_problem` before
launch, as is ep on a dense family.

Load balancing. transformers adds ``router_aux_loss_coef`` x the Switch load-balancing loss
(`load_balancing_loss`, Fedus et al. 2021) in its ForCausalLM forward from the layers'
``router_logits``, over the tokens of that call. Under data (and expert) parallel each rank's
forward is one of one process's micro-batches (the global batch split over the ranks as one
process splits it into the micro-batches it accumulates), so each rank's own loss is one
process's -- and Accelerate's and the Trainer's. Under context parallel a rank holds part of
each sequence only, so `global_aux_loss_hook` recomputes the loss from the same router_logits
with the per-expert token fractions and mean router probabilities summed over the cp ranks
(one all_reduce), replacing ``out.aux_loss`` (and the aux part of ``out.loss`` when labels
were given): the value is one process's on those sequences whole, and its gradient, once
averaged over the cp ranks as every gradient is, one process's too. Taking the statistics
over the data-parallel ranks as well would make the loss depend on how many ranks share the
global batch (one process on it with micro-batches accumulated computes it per micro-batch).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshfit.distributed.tensors import local_tensor
from meshfit.models.moe import scale_grad
from meshfit.parallel.ep_exchange import ExpertParallel

__all__ = ["AUX_LOSS_FAMILIES", "MAPPED", "HFMoE", "apply_hf_ep", "global_aux_loss_hook", "hf_ep_problem",
           "hf_experts", "is_experts", "load_balancing_loss", "record_routing"]

MAPPED = {"mixtral": "MixtralExperts", "qwen2_moe": "Qwen2MoeExperts",
          "qwen3_moe": "Qwen3MoeExperts", "glm4_moe": "Glm4MoeExperts",
          "deepseek_v3": "DeepseekV3Experts"}
"""transformers ``model_type`` -> its routed-experts class, which expert parallel splits."""

AUX_LOSS_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""The mapped families whose ForCausalLM adds the Switch load-balancing loss that
`load_balancing_loss` computes (tested equal to theirs); GLM-4-MoE and DeepSeek-V3 have none.
Another family's router loss is left as transformers computes it (each rank's own)."""

_EXPERT_COUNT = ("num_local_experts", "num_experts", "n_routed_experts")


def _mapped_class(module: nn.Module) -> str | None:
    """The mapped experts class `module` is (or derives from: FSDP2 subclasses it)."""
    names = set(MAPPED.values())
    return next((c.__name__ for c in type(module).__mro__ if c.__name__ in names), None)


def is_experts(module: nn.Module) -> bool:
    """A transformers routed-experts module: 3-D stacked ``gate_up_proj`` / ``down_proj``."""
    p = getattr(module, "gate_up_proj", None)
    return isinstance(p, torch.Tensor) and p.ndim == 3 and hasattr(module, "num_experts")


def hf_experts(model: nn.Module) -> list[nn.Module]:
    """The routed-experts modules of a transformers MoE (mapped or not)."""
    return [m for m in model.modules() if is_experts(m)]


class HFMoE:
    """A transformers experts module seen as meshfit's MoE block by the code that reads
    blocks (`meshfit.parallel.ep.moe_modules`: the layout's expert counts, the trainer's
    exchange timing and `routing_metrics`)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.aux_grad_scale = None  # (a pipeline's knob for meshfit's MoE; unused here)

    @property
    def n_experts(self) -> int:
        return int(self.module.num_experts)

    @property
    def ep(self) -> ExpertParallel | None:
        return getattr(self.module, "meshfit_ep", None)

    @property
    def last_stats(self) -> dict | None:
        return getattr(self.module, "meshfit_stats", None)


def _expert_count(config) -> int:
    return next((int(getattr(config, k)) for k in _EXPERT_COUNT
                 if isinstance(getattr(config, k, None), int)), 0)


def hf_ep_problem(model_or_config, ep: int, name: str = "ep") -> str | None:
    """Why a transformers model (or its configuration) cannot run expert parallel over `ep`
    ranks, or None: a dense family, a MoE class meshfit has not mapped, `ep` not dividing
    the experts."""
    model = model_or_config if isinstance(model_or_config, nn.Module) else None
    config = getattr(model, "config", model_or_config)
    family = getattr(config, "model_type", type(config).__name__)
    count = _expert_count(config)
    found = hf_experts(model) if model is not None else []
    if model is not None and count == 0 and found:
        count = int(found[0].num_experts)
    if count == 0:
        return (f"{name}={ep} needs a mixture-of-experts model, and {family} is dense (no "
                f"routed experts); use {name}=1 (ZeRO/FSDP and DDP work with every model)")
    unmapped = [type(m).__name__ for m in found if _mapped_class(m) is None]
    if family not in MAPPED or unmapped:
        what = unmapped[0] if unmapped else f"the experts of model_type {family!r}"
        return (f"{name}={ep}: {what} is a mixture-of-experts layout meshfit has not mapped "
                f"for expert parallel (mapped: {', '.join(MAPPED)}); use {name}=1 "
                "(ZeRO/FSDP and DDP work with every model)")
    if count % ep:
        return (f"{name}={ep} must divide the number of experts ({count}, {family}): each ep "
                f"rank holds n_experts / ep of them; use an ep that divides {count}")
    return None


def _local_experts(module: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """This rank's experts over `rows` sorted by local expert, counts[e] rows each; the
    arithmetic of transformers' "eager" experts loop."""
    scale = module.meshfit_grad_scale
    gate_up, down = (scale_grad(local_tensor(w), scale)
                     for w in (module.gate_up_proj, module.down_proj))
    outs = []
    for e, x in enumerate(torch.split(rows, counts.tolist())):
        if x.shape[0] == 0:
            continue
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(module.act_fn(gate) * up, down[e]))
    if not outs:
        # No rows for any local expert: the output still depends on the rows (their
        # exchange's backward is a collective the other ranks wait in) and on the weights
        # (FSDP2 expects their gradients), as `meshfit.models.moe.Experts` does.
        zero = (rows.sum() + gate_up.sum().to(rows.dtype) + down.sum().to(rows.dtype)) * 0
        return rows.new_zeros(0, rows.shape[-1]) + zero
    return torch.cat(outs)


def _ep_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward under expert parallel (see the module docstring)."""
    n, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, token order within
    counts = torch.bincount(flat, minlength=self.num_experts)
    tok = order // k
    out = self.meshfit_ep.dispatch(hidden_states[tok], counts,
                                   functools.partial(_local_experts, self))
    out = out * top_k_weights.reshape(-1)[order][:, None]
    return torch.zeros_like(hidden_states).index_add_(0, tok, out.to(hidden_states.dtype))


def apply_hf_ep(model: nn.Module, ep_mesh, device: torch.device | None = None
                ) -> list[nn.Module]:
    """Split the routed experts of the transformers MoE `model` over the 1-D `ep_mesh`, in
    place (each rank keeps its slice of the whole weights, no communication; local shards go
    to `device`). Returns the experts modules (FSDP2 shards them on their own mesh)."""
    from torch.distributed.tensor import DTensor, Shard  # deferred: ~0.5 s at import

    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    problem = hf_ep_problem(model, size)
    if problem:
        raise ValueError(problem)
    out = []
    for module in hf_experts(model):
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(module, name)
            # under tp the experts are whole on every tp rank (a replicated DTensor)
            whole = local_tensor(p.detach())
            local = whole.chunk(size, dim=0)[rank].to(device or p.device).clone()
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False,
                                       shape=p.shape, stride=p.stride())
            setattr(module, name, nn.Parameter(shard, requires_grad=p.requires_grad))
        module.meshfit_grad_scale = 1.0 / size
        module.meshfit_ep = ExpertParallel(ep_mesh.get_group(), size, rank, module.num_experts)
        module.forward = types.MethodType(_ep_forward, module)
        out.append(module)
    return out


# ------------------------------------------------------------------ routing statistics
def record_routing(model: nn.Module) -> None:
    """Keep each experts module's last routing (tokens per expert) for `routing_metrics`."""
    for module in hf_experts(model):
        if not getattr(module, "meshfit_records", False):
            module.register_forward_pre_hook(_record)
            module.meshfit_records = True


def _record(module: nn.Module, args) -> None:
    index = args[1]
    module.meshfit_stats = {
        "tokens_per_expert": torch.bincount(index.reshape(-1).detach(),
                                            minlength=module.num_experts),
        "dropped": 0, "assignments": index.numel(), "aux_loss": 0.0}


def load_balancing_loss(router_logits, num_experts: int, top_k: int, *, group=None,
                        group_size: int = 1) -> torch.Tensor:
    """The Switch load-balancing loss of transformers' MoE ForCausalLM (E x sum_e f_e P_e,
    f_e: top-k assignments to expert e per row, P_e: mean router probability of e, rows of
    every layer together; transformers' `load_balancing_loss_func` without attention mask),
    accumulated in float64 (transformers: float32), with f and P over the tokens
    of every rank of `group` (`group_size` ranks whose gradients are averaged): the value
    is one process's on their tokens together, and so is the gradient once averaged."""
    counts = torch.zeros(num_experts, dtype=torch.float64, device=router_logits[0].device)
    probs, rows = torch.zeros_like(counts), 0
    for logits in router_logits:
        p = logits.softmax(dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        counts = counts + torch.bincount(chosen, minlength=num_experts).to(counts.dtype)
        probs = probs + p.to(torch.float64).sum(dim=0)
        rows += p.shape[0]
    if group is not None and group_size > 1:
        totals = torch.cat([counts, probs.detach(), counts.new_tensor([rows])])
        dist.all_reduce(totals, group=group)
        counts, global_probs, rows = totals[:num_experts], totals[num_experts:-1], totals[-1]
        # value: the global sum; gradient: this rank's, x group_size (averaged afterwards)
        probs = global_probs + group_size * (probs - probs.detach())
    return num_experts * ((counts / rows) * (probs / rows)).sum()


def global_aux_loss_hook(model: nn.Module, group=None, group_size: int = 1):
    """Register, on the transformers MoE `model`, a forward hook that replaces its output's
    ``aux_loss`` (and the aux part of ``loss``) by `load_balancing_loss` over `group` (the cp
    ranks); without a group it keeps the model's own and records its value."""
    config = model.config
    top_k, n = int(config.num_experts_per_tok), _expert_count(config)
    coef = float(getattr(config, "router_aux_loss_coef", 0.0))
    first = next(iter(hf_experts(model)), None)

    def hook(module, args, output):
        logits = getattr(output, "router_logits", None)
        if getattr(output, "aux_loss", None) is None or not logits:
            return output
        if group is None:  # (the model's own loss; its value kept for routing_metrics)
            stats = getattr(first, "meshfit_stats", None)
            if stats is not None:
                stats["aux_loss"] = coef * float(output.aux_loss.detach())
            return output
        aux = load_balancing_loss(logits, n, top_k, group=group, group_size=group_size)
        if output.loss is not None:
            output.loss = output.loss - coef * output.aux_loss.to(output.loss) + coef * aux
        output.aux_loss = aux
        stats = getattr(first, "meshfit_stats", None)
        if stats is not None:  # routing_metrics averages it over the data-parallel ranks
            stats["aux_loss"] = coef * float(aux.detach())
        return output

    return model.register_forward_hook(hook)
