"""What the tests compare layouts against: small models built from one seed, token batches,
and the single-process training run every layout must reproduce.

Every model here is built the same way on every rank and in the parent process (one seed, no
global RNG dependence where it matters), so a spawned rank and the reference start from
identical weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshfit.models import GPT, GPTConfig

VOCAB = 256


def tiny_gpt(*, n_layer: int = 2, d_model: int = 64, n_head: int = 4, d_ff: int = 128,
             max_seq_len: int = 32, dtype: torch.dtype = torch.float64, seed: int = 0,
             **overrides) -> GPT:
    """The reference GPT at test size, weights from `init_weights(Generator(seed))` (the
    values a meta-device model materialises per pipeline stage with the same seed)."""
    cfg = GPTConfig(vocab_size=VOCAB, n_layer=n_layer, n_head=n_head, d_model=d_model,
                    d_ff=d_ff, max_seq_len=max_seq_len, **overrides)
    model = GPT(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.to(dtype)


def hf_llama(*, n_layer: int = 2, seed: int = 0, dtype: torch.dtype = torch.float64):
    """Hugging Face `LlamaForCausalLM` at test size (GQA: 4 heads, 2 key/value heads)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=n_layer, vocab_size=VOCAB,
                                   max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def hf_gpt2(*, n_layer: int = 2, seed: int = 0, dtype: torch.dtype = torch.float64):
    """Hugging Face `GPT2LMHeadModel` at test size (tied head, fused q|k|v), no dropout."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=n_layer, n_head=4, n_inner=128,
                                  vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


MODELS = {"gpt": tiny_gpt, "llama": hf_llama, "gpt2": hf_gpt2}


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of the reference GPT or a Hugging Face causal LM."""
    out = model(x) if isinstance(model, GPT) else model(input_ids=x)
    return out if isinstance(out, torch.Tensor) else out.logits


def mean_ce(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy (ignore_index -100), in the logits' own dtype."""
    return F.cross_entropy(out.flatten(0, -2), targets.flatten())


def token_batches(n: int, seq_len: int, vocab_size: int = VOCAB, seed: int = 1):
    """`n` random token sequences as (inputs [n, seq_len], next-token targets [n, seq_len]),
    the same on every rank and in the single-process reference."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (n, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def reference_run(model: torch.nn.Module, batches, *, lr: float = 3e-3,
                  clip: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, one AdamW step per (inputs, targets) batch of the global batch: the
    losses and the final state dict that every layout must reproduce."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        loss = mean_ce(logits(model, x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
