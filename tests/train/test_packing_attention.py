"""Rows packing several documents (data.packing, data.document_mask) compute, in every
attention implementation a transformers model may run with, what each document computes
alone (`meshfit.models.packing`): the reference is the model's own forward of each document
by itself, with no mask and no positions given. Families: Llama (passes the positions to its
mask), OPT (does not: only a 4-D mask keeps its documents apart), Mistral (every layer
windowed), Gemma 2 (windowed and full layers; eager only), AFMoE (the same, and its masks
never see the positions: transformers' own packed-sequence path leaks there) and Llama 4
(chunked and full layers), the windows and chunks shorter than the row. Flex attention
(a block mask: documents, windows, chunks and a mask per layer kind) on Llama, Mistral and
Llama 4. Layers that carry a state along the row, and implementations whose mask form is
not known, are refused before launch."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from meshfit.models.packing import check_packable, packed_forward  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "opt": lambda: transformers.OPTConfig(vocab_size=64, hidden_size=16, ffn_dim=32,
                                          num_hidden_layers=2, num_attention_heads=2,
                                          max_position_embeddings=64, word_embed_proj_dim=16),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=4),
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, head_dim=16, sliding_window=4),
    "afmoe": lambda: transformers.AfmoeConfig(
        **SMALL, head_dim=16, sliding_window=4, layer_types=["sliding_attention",
                                                             "full_attention"],
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, num_dense_layers=1),
    "llama4": lambda: transformers.Llama4TextConfig(
        **SMALL, head_dim=16, attention_chunk_size=4, num_local_experts=2,
        num_experts_per_tok=1, intermediate_size_mlp=32, no_rope_layers=[1, 0],
        layer_types=["chunked_attention", "full_attention"]),
}
MOE = ("afmoe", "llama4")
DOCS = [[5, 7, 4], [3, 9, 4]]  # two rows of 16 tokens, three documents each


def _flash_present() -> bool:
    """Flash attention runs here: a CUDA device and transformers finds a flash kernel."""
    from transformers.utils import is_flash_attn_2_available

    return torch.cuda.is_available() and is_flash_attn_2_available()


CASES = [(f, i) for f in ("llama", "opt", "mistral") for i in ("eager", "sdpa")] + \
    [("gemma2", "eager"), ("afmoe", "eager"), ("llama4", "sdpa")] + \
    [(f, "flex_attention") for f in ("llama", "mistral", "llama4")] + \
    [(f, "flash_attention_2") for f in ("llama", "mistral")]


def _rows(generator: torch.Generator):
    docs = [[torch.randint(2, 60, (n,), generator=generator) for n in row] for row in DOCS]
    ids = torch.stack([torch.cat(row) for row in docs])
    positions = torch.stack([torch.cat([torch.arange(len(d)) for d in row]) for row in docs])
    return docs, ids, positions


@pytest.mark.parametrize(("family", "implementation"), CASES,
                         ids=[f"{f}-{i}" for f, i in CASES])
def test_packed_rows_compute_each_document_alone(family, implementation):
    """Logits of packed rows equal each document's logits alone: float64 on the CPU (eager's
    softmax runs in float32: 1e-6; the MoE families' grouped matmuls take no float64:
    float32, 1e-5; so does flex attention on the CPU), bfloat16 on a GPU for flash attention.
    Flex attention was given its mask as a tensor added by a score_mod, which crashes the
    process on the CPU (torch 2.13). Its documents alone are computed by eager attention on
    the same weights: torch 2.13 compiles flex attention for dynamic shapes once a second
    length is seen, and that CPU kernel fails to build (undeclared names in inductor's C++)."""
    if implementation.startswith("flash") and not _flash_present():
        pytest.skip("capability: flash attention needs CUDA and a flash kernel; absent here")
    device = "cuda" if implementation.startswith("flash") else "cpu"
    flex = implementation == "flex_attention"
    single = family in MOE or flex
    dtype = torch.bfloat16 if device == "cuda" else torch.float32 if single else torch.float64
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        FAMILIES[family](), attn_implementation=implementation).to(device, dtype).eval()
    docs, ids, positions = _rows(torch.Generator().manual_seed(1))
    # One compile thread (flex attention compiles): inductor's default pool leaves
    # non-daemon threads behind, which the hygiene fixture fails.
    with torch.no_grad(), torch._inductor.config.patch(compile_threads=1):
        packed = packed_forward(model, ids.to(device), positions.to(device)).logits
        if flex:
            model.set_attn_implementation("eager")
        alone = torch.stack([torch.cat([model(input_ids=d[None].to(device)).logits[0]
                                        for d in row]) for row in docs])
    assert packed.shape == alone.shape == (2, 16, 64)
    tol = 1e-5 if single else {"eager": 1e-6, "sdpa": 1e-12}.get(implementation, 2e-2)
    torch.testing.assert_close(packed, alone, rtol=tol, atol=tol)


def test_the_training_loss_of_packed_rows_is_each_documents_loss():
    """`loss_function`'s loss over packed rows, for an eager model, is the token-weighted
    mean of each document's loss alone (the trainer's path, not only the forward)."""
    from meshfit.train.models import loss_function

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        FAMILIES["llama"](), attn_implementation="eager").double()
    docs, ids, positions = _rows(torch.Generator().manual_seed(2))
    starts = positions[:, 1:] == 0  # a document's first token is nobody's target
    y = torch.where(starts, -100, ids[:, 1:])
    loss = loss_function(model)
    packed = loss(model, ids[:, :-1], y, positions[:, :-1]) * (y != -100).sum()
    alone = sum(loss(model, d[None, :-1], d[None, 1:]) * (len(d) - 1) for row in docs
                for d in row)
    assert packed.item() == pytest.approx(alone.item(), rel=1e-6)


def _mamba():
    return transformers.AutoModelForCausalLM.from_config(transformers.MambaConfig(
        vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2))


def test_layers_with_a_state_or_an_unknown_mask_form_are_refused_before_launch(tmp_path):
    """A Mamba model carries its state across the documents of a row (its packed logits
    differ from each document's alone); an attention implementation registered by the user
    takes a mask of a form meshfit does not know. Both are one line before launch, from the
    run's config (`check_model_source`)."""
    from meshfit.train.configfile import build_config
    from meshfit.train.models import check_model_source

    mamba = _mamba().eval()
    docs, ids, positions = _rows(torch.Generator().manual_seed(3))
    with torch.no_grad():
        alone = torch.cat([mamba(input_ids=d[None]).logits[0] for d in docs[0]])
        leaked = (mamba(input_ids=ids[:1], position_ids=positions[:1]).logits[0] - alone)
    assert leaked.abs().max() > 1e-3  # the refusal is needed
    with pytest.raises(ValueError, match=r"^model: its layers of type linear_attention carry"):
        check_packable(mamba, "model")

    transformers.AttentionInterface.register(
        "meshfit_test_attention", transformers.integrations.sdpa_attention.sdpa_attention_forward)
    transformers.AttentionMaskInterface.register(
        "meshfit_test_attention", transformers.masking_utils.sdpa_mask)
    custom = transformers.AutoModelForCausalLM.from_config(
        FAMILIES["llama"](), attn_implementation="meshfit_test_attention")
    with pytest.raises(ValueError, match="'meshfit_test_attention', whose mask form"):
        check_packable(custom, "model")

    folder = tmp_path / "mamba"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(transformers.MambaConfig(
        vocab_size=300, hidden_size=16, state_size=4, num_hidden_layers=2).to_dict()))
    cfg = build_config({"model": {"hf_config": str(folder)}, "data": {"document_mask": True},
                        "train": {"seq_len": 16}})  # (data.packing: the same condition)
    with pytest.raises(ValueError) as err:
        check_model_source(cfg, 260)
    assert str(err.value).startswith(f"model.hf_config={str(folder)!r}: its layers")
    assert "\n" not in str(err.value)
    check_model_source(build_config({"model": {"hf_config": str(folder)},
                                     "train": {"seq_len": 16}}), 260)  # unpacked: runs


def test_flex_attention_on_the_cpu_is_refused_before_launch(tmp_path, monkeypatch):
    """torch has no CPU backward for flex attention: a run whose model config asks for it
    failed after launch, on every rank, with torch's traceback. Now one line before launch,
    packed or not (MESHFIT_CPU=1: the CPU even beside a GPU)."""
    from meshfit.train.configfile import build_config
    from meshfit.train.models import check_model_source

    monkeypatch.setenv("MESHFIT_CPU", "1")
    folder = tmp_path / "flex"
    folder.mkdir()
    config = FAMILIES["llama"]().to_dict()
    (folder / "config.json").write_text(json.dumps({**config, "attn_implementation":
                                                    "flex_attention"}))
    for data in ({}, {"document_mask": True}):
        cfg = build_config({"model": {"hf_config": str(folder)}, "data": data,
                            "train": {"seq_len": 16}})
        with pytest.raises(ValueError) as err:
            check_model_source(cfg, 60)
        assert str(err.value) == (
            f"model.hf_config={str(folder)!r} runs attn_implementation 'flex_attention', which "
            "torch cannot train on the CPU (it has no CPU backward); use 'sdpa' in its "
            "config.json, or a GPU")
    (folder / "config.json").write_text(json.dumps(config))
    check_model_source(build_config({"model": {"hf_config": str(folder)},
                                     "train": {"seq_len": 16}}), 60)  # sdpa: runs
