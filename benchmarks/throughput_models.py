"""Model factories for benchmarks/throughput.py (``[model] factory = "throughput_models:gpt2"``).

The built-in corpus is read with the byte tokenizer (256 ids); a preset trained through
``[model] preset`` would get a 256-entry vocabulary, a different model from the one whose
throughput users compare. These factories keep each preset's published vocabulary
(padded to a multiple of 64, as GPU kernels prefer: GPT-2's 50,257 -> 50,304); the byte ids
are a subset of it, so the model, its FLOPs and its memory are the real ones.
"""

from __future__ import annotations

from meshfit.models import GPT, GPTConfig


def _padded(vocab: int, multiple: int = 64) -> int:
    return -(-vocab // multiple) * multiple


def gpt2(max_seq_len: int) -> GPT:
    """GPT-2 small (124M), vocabulary 50,304."""
    return GPT(GPTConfig.preset("gpt2", vocab_size=_padded(50257),
                                max_seq_len=max(max_seq_len, 1024)))


def llama_1b(max_seq_len: int) -> GPT:
    """The llama-1b preset (TinyLlama-1.1B's shape), vocabulary 32,000."""
    return GPT(GPTConfig.preset("llama-1b", max_seq_len=max(max_seq_len, 2048)))


def tiny(max_seq_len: int) -> GPT:
    """The tiny preset: a CPU smoke run of the benchmark itself."""
    return GPT(GPTConfig.preset("tiny", max_seq_len=max(max_seq_len, 256)))
