"""Reference mixture-of-experts MLP (token-choice top-k), a drop-in for a block's dense MLP.

    mlp.router                          nn.Linear(d_model, n_experts, bias=False)
    mlp.experts.w1, .w3, .w2            SwiGLU experts (mlp="swiglu"): [E, d, f] x 2, [E, f, d]
    mlp.experts.w_in, .w_out            GELU experts (mlp="gelu"): [E, d, f], [E, f, d]
    mlp.shared              optional shared expert: an ordinary GeluMLP / SwiGLUMLP of width f

Experts carry no biases (Mixtral, DeepSeek); the shared expert follows `GPTConfig.bias`.
Expert e computes x @ w1[e] etc. (stacked weights are stored input-major, so no transpose).

Routing (`GPTConfig.router`):
  * "softmax_topk": p = softmax(logits) over all E experts; the top_k are kept and their
    weights renormalised to sum to 1 (as Mixtral / HF MixtralSparseMoeBlock do).
  * "sigmoid_topk": s = sigmoid(logits); the top_k are kept and normalised to sum to 1
    (DeepSeek-V3, without its bias-based balancing). For the balancing loss the router
    "probability" P is s normalised over all experts.
Router logits, probabilities and combine weights are computed in float32 when the input is
fp16/bf16 (routing decisions are precision-sensitive), in the input's dtype otherwise.

Computation: the N*k (token, expert) assignments are sorted by expert with a stable sort, so
within an expert they stay in token order (token index = flattened batch-major position).
Each expert then runs one matmul chain over its contiguous slice: with `F.grouped_mm`
on CUDA for bf16/fp16 when a one-time probe shows it works there, otherwise (CPU, fp32/fp64,
older torch) a Python loop over experts. Outputs are scaled by the combine weights and
scatter-added back to their tokens.

Capacity (`GPTConfig.capacity_factor`): each expert keeps at most
ceil(cf * N * k / E) assignments; the earliest tokens win. A dropped assignment contributes
nothing (that token keeps its residual plus its other experts' outputs; the kept weights are
not renormalised) and is counted in `last_stats["dropped"]`. With capacity, routing depends
on how many tokens are in the forward, so incremental decoding (`GPT.forward_cached`) may
drop differently from one full forward; dropless routing (the default) is exact there.

Auxiliary losses, kept on the module as `last_aux_loss` after each forward (a scalar with
its autograd graph; `GPT.forward` adds the sum over blocks to the loss when given targets):
  * load balancing (Switch, Fedus et al. 2021; GShard): aux_loss_coef * E * sum_e f_e P_e,
    f_e = fraction of the N*k assignments routed to e (before capacity drops; not
    differentiable), P_e = mean over tokens of the router probability of e.
  * router z-loss (ST-MoE, Zoph et al. 2022): router_z_loss_coef * mean(logsumexp(logits)^2).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshfit.distributed.tensors import local_tensor
from meshfit.models.config import GPTConfig
from meshfit.models.mlp import GeluMLP, SwiGLUMLP

__all__ = ["Experts", "MoE", "scale_grad"]

# (device type, dtype) -> whether F.grouped_mm ran correctly there.
_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


def _grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Probe F.grouped_mm once per (device type, dtype) against a loop of matmuls."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_OK:
        ok = False
        if (hasattr(F, "grouped_mm") and device.type == "cuda"
                and dtype in (torch.bfloat16, torch.float16)):
            try:
                g = torch.Generator(device=device).manual_seed(0)
                x = torch.randn(40, 32, device=device, dtype=dtype, generator=g)
                w = torch.randn(3, 32, 16, device=device, dtype=dtype, generator=g)
                offs = torch.tensor([8, 8, 40], device=device, dtype=torch.int32)
                y = F.grouped_mm(x, w, offs=offs)
                ref = torch.cat([x[:8] @ w[0], x[8:8] @ w[1], x[8:] @ w[2]])
                ok = bool(torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-1))
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _GROUPED_MM_OK[key] = ok
    return _GROUPED_MM_OK[key]


class MoE(nn.Module):
    """Token-choice top-k mixture of experts over [B, T, d_model] (see the module docstring)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_experts < 1:
            raise ValueError("MoE needs GPTConfig.n_experts >= 1")
        d, f, E = cfg.d_model, cfg.expert_d_ff, cfg.n_experts
        self.n_experts, self.top_k, self.kind = E, cfg.top_k, cfg.router
        self.swiglu = cfg.mlp == "swiglu"
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef, self.router_z_loss_coef = cfg.aux_loss_coef, cfg.router_z_loss_coef
        self.router = nn.Linear(d, E, bias=False)
        self.experts = Experts(E, d, f, swiglu=self.swiglu)
        self.shared: nn.Module | None = None
        if cfg.shared_experts:
            dense = dataclasses.replace(cfg, d_ff=f, n_experts=0, dropout=0.0)
            self.shared = SwiGLUMLP(dense) if self.swiglu else GeluMLP(dense)
        self.drop = nn.Dropout(cfg.dropout)
        self.ep = None
        """`meshfit.parallel.ep.ExpertParallel` once the experts are split over ranks
        (`meshfit.parallel.ep.apply_ep`); None: every expert is local."""
        self.aux_grad_scale: float | None = None
        """None: the auxiliary loss is left for `GPT.forward` to add to the loss. A float
        (a pipeline stage, whose loss is computed elsewhere): its gradient, times this
        scale, is fed into backward from this block's output instead."""
        self.last_aux_loss: torch.Tensor | None = None
        self.last_stats: dict[str, torch.Tensor | int] | None = None
        self.sequence_group = None
        """Context parallel: the process group of the ranks holding the other parts of the
        same sequences; the auxiliary losses' statistics are taken over them, so that the
        loss is one process's on the whole sequences (None: this forward's tokens)."""

    # ------------------------------------------------------------------ routing
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [N, d] -> (logits [N, E], probs [N, E], top-k weights [N, k], top-k ids [N, k]).
        `probs` is what the balancing loss averages (see the module docstring)."""
        logits = self.router(x)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        if self.kind == "softmax_topk":
            probs = logits.softmax(dim=-1)
            top, idx = probs.topk(self.top_k, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            top, idx = scores.topk(self.top_k, dim=-1)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        return logits, probs, top / top.sum(dim=-1, keepdim=True), idx

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N, E, k = x.shape[0], self.n_experts, self.top_k
        logits, probs, weights, idx = self.route(x)

        flat_e = idx.reshape(-1)  # assignment a = token * k + j
        order = torch.argsort(flat_e, stable=True)  # by expert, token order within
        counts = torch.bincount(flat_e, minlength=E)
        dropped = 0
        if self.capacity_factor is not None:
            cap = math.ceil(self.capacity_factor * N * k / E)
            starts = counts.cumsum(0) - counts
            sorted_e = flat_e[order]
            rank = torch.arange(order.numel(), device=x.device) - starts[sorted_e]
            keep = rank < cap
            order = order[keep]
            kept = counts.clamp(max=cap)
            dropped = int(N * k - order.numel())
        else:
            kept = counts
        tok = order // k
        if self.ep is None:
            out = self.experts(x[tok], kept)
        else:
            out = self.ep.dispatch(x[tok], kept, self.experts)
        w = weights.reshape(-1)[order].to(out.dtype)
        y = torch.zeros_like(x).index_add_(0, tok, (out * w[:, None]).to(x.dtype))
        if self.shared is not None:
            y = y + self.shared(x)

        # auxiliary losses (fp32 for low-precision inputs, see route())
        sums = (counts.to(probs.dtype), probs.sum(dim=0),
                torch.logsumexp(logits, dim=-1).square().sum(), N)
        if self.sequence_group is not None:
            sums = _over_group(self.sequence_group, *sums)
        n = sums[3]
        balance = E * ((sums[0] / (n * k)) * (sums[1] / n)).sum()
        z = sums[2] / n
        self.last_aux_loss = self.aux_loss_coef * balance + self.router_z_loss_coef * z
        self.last_stats = {"tokens_per_expert": counts.detach(), "dropped": dropped,
                           "assignments": N * k, "aux_loss": self.last_aux_loss.detach()}
        y = self.drop(y).reshape(shape)
        if self.aux_grad_scale is not None and self.last_aux_loss.requires_grad:
            y = _AttachAuxLoss.apply(y, self.last_aux_loss, self.aux_grad_scale)
        return y


def _over_group(group, counts: torch.Tensor, probs: torch.Tensor, z: torch.Tensor, n: int):
    """The auxiliary losses' sums (assignments per expert, router probabilities per expert,
    squared log-sum-exps, tokens) over the ranks of `group`, one all-reduce: each value the
    group's total, each gradient this rank's own times the group's size -- averaged over the
    group's ranks afterwards, as every gradient is, it is the gradient of the total."""
    size = dist.get_world_size(group)
    totals = torch.cat([counts, probs.detach(), z.detach()[None],
                        counts.new_tensor([float(n)])])
    dist.all_reduce(totals, group=group)
    E = counts.numel()
    return (totals[:E], totals[E:2 * E] + size * (probs - probs.detach()),
            totals[2 * E] + size * (z - z.detach()), totals[-1])


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the block output whose backward also starts the auxiliary loss's
    gradient (d aux / d aux = scale): a pipeline stage's auxiliary loss reaches backward
    without being added to a loss that only the last stage computes (Megatron-LM's
    MoEAuxLossAutoScaler does the same)."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale, ctx.aux_shape, ctx.aux_dtype = scale, aux.shape, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype,
                                device=grad.device), None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, w, scale):
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """`tensor` itself, its gradient multiplied by `scale` in backward (expert parallel's 1/ep
    on the experts' weights)."""
    return _ScaleGrad.apply(tensor, scale)


class Experts(nn.Module):
    """The routed experts' stacked weights and their computation over rows sorted by expert;
    its own module so that FSDP2 can shard it over other ranks than the rest of the block
    (under expert parallelism, `meshfit.parallel.ep`, this rank's experts: a dim-0 shard)."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, *, swiglu: bool) -> None:
        super().__init__()
        E, d, f = n_experts, d_model, d_ff
        self.swiglu = swiglu
        if swiglu:
            self.w1 = nn.Parameter(torch.empty(E, d, f))
            self.w3 = nn.Parameter(torch.empty(E, d, f))
            self.w2 = nn.Parameter(torch.empty(E, f, d))
        else:
            self.w_in = nn.Parameter(torch.empty(E, d, f))
            self.w_out = nn.Parameter(torch.empty(E, f, d))
        self.use_grouped_mm: bool | None = None
        """None: auto (grouped matmul where the probe passes); False: always the loop."""
        self.grad_scale: float = 1.0
        """Multiplies the experts' gradients (expert parallelism: 1/ep, `meshfit.parallel.ep`)."""

    def weights(self) -> tuple[torch.Tensor, ...]:
        """This rank's expert weights as plain tensors (the local shard of a DTensor)."""
        ws = (self.w1, self.w3, self.w2) if self.swiglu else (self.w_in, self.w_out)
        ws = tuple(local_tensor(w) for w in ws)
        if self.grad_scale != 1.0:
            ws = tuple(scale_grad(w, self.grad_scale) for w in ws)
        return ws

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs for xs [M, d] sorted by (local) expert, counts[e] rows each."""
        ws = self.weights()
        grouped = self.use_grouped_mm
        if grouped is None:
            grouped = _grouped_mm_works(xs.device, xs.dtype)
        if grouped:
            offs = counts.cumsum(0).to(torch.int32)
            mm = [F.grouped_mm(xs, w.to(xs.dtype), offs=offs) for w in ws[:-1]]
            h = F.silu(mm[0]) * mm[1] if self.swiglu else F.gelu(mm[0], approximate="tanh")
            return F.grouped_mm(h, ws[-1].to(xs.dtype), offs=offs)
        outs = []
        for e, rows in enumerate(torch.split(xs, counts.tolist())):
            if rows.shape[0] == 0:
                continue
            w = [t[e].to(xs.dtype) for t in ws]
            if self.swiglu:
                h = F.silu(rows @ w[0]) * (rows @ w[1])
            else:
                h = F.gelu(rows @ w[0], approximate="tanh")
            outs.append(h @ w[-1])
        if not outs:
            # No rows for any local expert. The output must still depend on the rows and the
            # weights: under expert parallelism the rows arrived by an all-to-all whose
            # backward the other ranks wait in (a rank skipping it hangs them), and FSDP2
            # expects the weights' gradients.
            zero = (xs.sum() + sum(t.sum() for t in ws).to(xs.dtype)) * 0
            return xs.new_zeros(0, xs.shape[-1]) + zero
        return torch.cat(outs)
