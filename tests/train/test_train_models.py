"""`meshfit train` on a Hugging Face model folder, a config, and the user's own module, with a
real tokenizer on local text; the final weights it writes (OUT/model/, OUT/adapter/).

Each 2-process layout run is compared with the same run on one process: the same seed, data
order and global batch (the data-parallel ranks of a step together read the 8 sequences one
process reads in its 4 accumulated micro-batches). fp32 (the trainer's dtype), dropout off:
the layouts sum in other orders only (~1e-7 relative per operation), and over 4 AdamW steps
the logged losses stay within 1e-4 relative (as tests/train/test_train_parallel.py measures),
while a layout that loads the wrong slice of a weight, drops a micro-batch or mis-scales
the loss differs from the first step by > 1e-2.

The written model is checked against the run itself: loaded into a fresh model, its mean
loss on the run's validation sequences must equal the run's last logged val_loss (rounded
to 5 decimals by the log: 1e-4 relative leaves room for that and the summation order).
"""

from __future__ import annotations

import json
import math
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import run_distributed
from meshfit.models.families import tiny_model
from meshfit.train import tokens

STEPS = 4
BASE = {"train": {"steps": STEPS, "eval_every": 0, "log_every": 1, "eval_batches": 1,
                  "global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32,
                  "warmup_steps": 1}}
RTOL = 1e-4

FACTORY = textwrap.dedent('''
    """A small language model of the user's own: embedding, a ReLU MLP, a head."""
    import torch
    from torch import nn

    from meshfit.models.plans import colwise, replicate, rowwise


    class TinyLM(nn.Module):
        def __init__(self, vocab_size, max_seq_len, width=32):
            super().__init__()
            self.emb = nn.Embedding(vocab_size, width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)
            self.head = nn.Linear(width, vocab_size, bias=False)

        def forward(self, ids):
            h = self.emb(ids)
            h = h + self.down(torch.relu(self.up(h)))
            return self.head(h)


    def build(vocab_size, max_seq_len):
        return TinyLM(vocab_size, max_seq_len)


    PLAN = {"emb": replicate(), "up": colwise(), "down": rowwise(), "head": replicate()}
''')


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A BPE tokenizer trained here (with an EOS token), two text documents, a tiny Llama
    saved as a model folder (and tiny Gemma 2 and Qwen3 ones) and a GPT-2 config, and a
    factory module."""
    import sys
    import sysconfig

    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tmp = tmp_path_factory.mktemp("sources")
    stdlib = sysconfig.get_paths()["stdlib"]
    texts = [open(f"{stdlib}/{name}").read()[:40_000] for name in ("os.py", "textwrap.py")]
    (tmp / "text").mkdir()
    for i, text in enumerate(texts):
        (tmp / "text" / f"{i}.txt").write_text(text)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400,
                                                       special_tokens=["<unk>", "</s>"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(tmp / "tok")
    llama = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, num_hidden_layers=2, vocab_size=512,
                                     max_position_embeddings=64)
    torch.manual_seed(7)
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp / "llama")
    # families meshfit writes no plan for: Gemma 2 (sliding and full layers, softcapping,
    # tied embeddings) under pp, Qwen3 (q/k norms) under cp, each from its own plans
    for family in FAMILY_FOLDERS.values():
        tiny_model(family, seed=7, dtype=torch.float32, vocab_size=512).save_pretrained(
            tmp / family)
    transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_inner=64, vocab_size=512,
                            n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0).save_pretrained(tmp / "gpt2")
    (tmp / "mymodels.py").write_text(FACTORY)
    sys.path.insert(0, str(tmp))
    return tmp


def _config(files, case: str, nproc: int):
    from meshfit.train.configfile import build_config

    data = {"path": str(files / "text"), "tokenizer": str(files / "tok"),
            "cache_dir": str(files / "cache")}
    model, parallel, peft = {}, {}, {}
    if case == "hf_model_zero3":
        model = {"hf_model": str(files / "llama")}
        parallel = {"dp_shard": 2, "dp_replicate": 1, "zero_stage": 3} if nproc == 2 else {}
    elif case == "hf_model_cp2":  # context parallel: the attention a ring over 2 ranks
        model = {"hf_model": str(files / FAMILY_FOLDERS[case])}
        parallel = {"cp": 2, "dp_replicate": 1, "zero_stage": 3} if nproc == 2 else {}
    elif case == "hf_model_pp":
        model = {"hf_model": str(files / FAMILY_FOLDERS[case])}
        parallel = {"pp": 2, "dp_replicate": 1} if nproc == 2 else {}
    elif case == "hf_model_docs":  # text documents kept apart (data.document_mask)
        model = {"hf_model": str(files / "llama")}
        data = {**data, "document_mask": True}
        parallel = {"dp_shard": 2, "dp_replicate": 1, "zero_stage": 3} if nproc == 2 else {}
    elif case == "factory_tp":
        model = {"factory": "mymodels:build", "tp_plan": "mymodels:PLAN"}
        parallel = {"tp": 2, "dp_replicate": 1} if nproc == 2 else {}
    elif case.startswith("lora_hf_model"):  # LoRA on pretrained weights
        model = {"hf_model": str(files / "llama")}
        peft = {"method": "lora", "r": 4, "merge": True}  # every block linear (the default)
        parallel = {"dp_shard": 2, "dp_replicate": 1, "zero_stage": 3} \
            if case.endswith("zero3") else {"tp": 2, "dp_replicate": 1} \
            if case.endswith("tp") else {"pp": 2, "dp_replicate": 1} \
            if case.endswith("pp") else {"dp_replicate": 2}
        parallel = parallel if nproc == 2 else {}
    elif case.startswith("qlora_hf_model"):  # LoRA on the folder's weights held in 4 bits
        model = {"hf_model": str(files / "llama")}
        peft = {"method": "qlora", "r": 4, "merge": True, "target_modules": ["q_proj", "v_proj"]}
        parallel = {"dp_shard": 2, "dp_replicate": 1, "zero_stage": 3} \
            if case.endswith("zero3") else {"dp_replicate": 2}
        parallel = parallel if nproc == 2 else {}
    elif case == "lora_gpt_tp_sp":  # the reference GPT, its every block linear adapted
        peft = {"method": "lora", "r": 4}
        parallel = {"tp": 2, "dp_replicate": 1, "sequence_parallel": True} if nproc == 2 \
            else {}
    elif case == "lora_gpt2_zero3":
        model = {"hf_config": str(files / "gpt2")}
        peft = {"method": "lora", "r": 4, "target_modules": ["c_attn", "c_fc"], "merge": True}
        parallel = {"dp_shard": 2, "dp_replicate": 1, "zero_stage": 3} if nproc == 2 else {}
    return build_config({**BASE, "model": model, "data": data, "parallel": parallel,
                         "peft": peft, "optim": {"optimizer": "adamw", "lr": 1e-2}})


FAMILY_FOLDERS = {"hf_model_pp": "gemma2", "hf_model_cp2": "qwen3"}
CASES = ("hf_model_zero3", "hf_model_pp", "factory_tp", "lora_gpt2_zero3", "lora_hf_model_ddp",
         "lora_hf_model_zero3", "lora_hf_model_tp", "lora_hf_model_pp", "lora_gpt_tp_sp",
         "hf_model_docs", "qlora_hf_model_ddp", "qlora_hf_model_zero3", "hf_model_cp2")


def _train_cases(rank, world_size, files):
    import sys

    from meshfit.distributed import init
    from meshfit.train.trainer import train

    sys.path.insert(0, str(files))
    env = init()
    for case in CASES:
        train(_config(files, case, world_size), files / f"{case}-2", env)
    _save_adapter_under_zero3(files / "zero3-adapter")
    return None


def _save_adapter_under_zero3(folder):
    """`meshfit.peft.save_adapter` on a model whose parameters are ZeRO-3 shards, called
    on every rank (it gathers the adapter alone)."""
    from reference import tiny_gpt

    from meshfit import Accelerator, ParallelDims
    from meshfit.peft import lora, save_adapter

    acc = Accelerator(parallel=ParallelDims(dp_shard=2, dp_replicate=1), zero_stage=3)
    torch.manual_seed(5)
    model = acc.prepare(lora(tiny_gpt(), r=2))
    save_adapter(model, folder)


@pytest.fixture(scope="module")
def runs(files):
    from meshfit.distributed import init
    from meshfit.train.trainer import train

    run_distributed(_train_cases, 2, files, timeout=400)
    for case in CASES:
        train(_config(files, case, 1), files / f"{case}-1", init())
    return files


def _losses(folder):
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x], [x["val_loss"] for x in lines
                                                        if "val_loss" in x]


@pytest.mark.parametrize("case", CASES)
def test_two_processes_match_one(runs, case):
    one, _ = _losses(runs / f"{case}-1")
    two, _ = _losses(runs / f"{case}-2")
    assert len(one) == len(two) == STEPS
    for a, b in zip(one, two):
        assert math.isclose(a, b, rel_tol=RTOL), (one, two)
    if "lora_hf_model" not in case:  # (their val_loss is checked to move below)
        assert two[-1] < two[0]  # it trained


def _val_loss(model, cfg, n: int, *, hf: bool) -> float:
    from meshfit.data import TokenDataset

    val = TokenDataset(tokens.load_tokens(cfg).val, cfg.train.seq_len)
    x = torch.stack([val[i][0] for i in range(n)])
    y = torch.stack([val[i][1] for i in range(n)])
    with torch.no_grad():
        out = model(input_ids=x).logits if hf else model(x)
    return F.cross_entropy(out.flatten(0, 1), y.flatten()).item()


def test_hf_model_is_loaded_then_written_as_a_from_pretrained_folder(runs):
    """The first evaluation is the saved model's own loss (its weights were loaded, not drawn
    at random); the written folder loads with from_pretrained and gives the last val_loss."""
    import transformers

    cfg = _config(runs, "hf_model_zero3", 2)
    original = transformers.LlamaForCausalLM.from_pretrained(runs / "llama")
    _, vals = _losses(runs / "hf_model_zero3-2")
    # every layout evaluates the same windows: eval_batches x micro_batch_size of them
    n = cfg.eval_windows()
    assert vals[0] == pytest.approx(_val_loss(original, cfg, n, hf=True), rel=RTOL)
    for case in ("hf_model_zero3-2", "hf_model_pp-2", "hf_model_zero3-1", "hf_model_cp2-2"):
        folder = runs / case / "model"
        trained = transformers.AutoModelForCausalLM.from_pretrained(folder)
        _, vals = _losses(runs / case)
        assert vals[-1] == pytest.approx(_val_loss(trained, cfg, n, hf=True), rel=RTOL), case
        assert transformers.AutoTokenizer.from_pretrained(folder).eos_token == "</s>"
        # The model's own class, not FSDP2's wrapper subclass ("FSDPLlamaForCausalLM"):
        # inference servers and converters choose the class by this field.
        config = json.loads((folder / "config.json").read_text())
        family = FAMILY_FOLDERS.get(case.rsplit("-", 1)[0], "llama")
        source = json.loads((runs / family / "config.json").read_text())
        assert config["architectures"] == source["architectures"], case
        # (and not the ring's attention implementation, which exists in the run only)
        assert "meshfit" not in json.dumps(config), case
    merged = json.loads((runs / "lora_gpt2_zero3-2" / "model" / "config.json").read_text())
    assert merged["architectures"] == ["GPT2LMHeadModel"]


def test_factory_model_written_with_its_factory(runs):
    from meshfit.checkpoint.saved import load_model_folder

    cfg = _config(runs, "factory_tp", 2)
    folder = runs / "factory_tp-2" / "model"
    config = json.loads((folder / "config.json").read_text())
    assert config["factory"] == "mymodels:build"
    assert config["kwargs"] == {"vocab_size": tokens.vocab_size(cfg), "max_seq_len": 32}
    with pytest.raises(ValueError, match=r"names code to run .*add trust_code=True"):
        load_model_folder(folder)  # the folder's factory runs only when the caller says so
    model, tokenizer = load_model_folder(folder, trust_code=True)
    _, vals = _losses(runs / "factory_tp-2")
    assert vals[-1] == pytest.approx(_val_loss(model, cfg, cfg.eval_windows(), hf=False),
                                     rel=RTOL)
    assert tokenizer is not None and tokenizer.vocab_size == tokens.vocab_size(cfg)


def test_lora_under_zero3_writes_a_peft_adapter_and_the_merged_model(runs):
    """The adapter (gathered from ZeRO-3 shards) loads with PeftModel.from_pretrained onto
    the base the run started from (transformers' init after the run's seed); that model and
    the merged folder both give the run's last val_loss."""
    import peft
    import transformers

    cfg = _config(runs, "lora_gpt2_zero3", 2)
    _, vals = _losses(runs / "lora_gpt2_zero3-2")
    torch.manual_seed(cfg.train.seed)
    base = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(runs / "gpt2"))
    adapted = peft.PeftModel.from_pretrained(base, runs / "lora_gpt2_zero3-2" / "adapter")
    n = cfg.eval_windows()
    assert vals[-1] == pytest.approx(_val_loss(adapted, cfg, n, hf=True), rel=RTOL)
    merged = transformers.GPT2LMHeadModel.from_pretrained(runs / "lora_gpt2_zero3-2" / "model")
    assert vals[-1] == pytest.approx(_val_loss(merged, cfg, n, hf=True), rel=RTOL)
    assert not any("lora" in k for k in merged.state_dict())


def test_lora_on_a_pretrained_folder_starts_from_its_weights(runs):
    """LoRA on an hf_model folder (one process, DDP and ZeRO-3, each equal to one process
    above): the base weights are read from the folder under peft's wrapped names, the
    adapters drawn as peft draws them (B = 0), so the first evaluation is the folder's own
    model; the adapter loads with PeftModel.from_pretrained onto the folder and the merged
    model with from_pretrained, both giving the run's last val_loss."""
    import peft
    import transformers

    cfg = _config(runs, "lora_hf_model_zero3", 2)
    n = cfg.eval_windows()
    original = transformers.LlamaForCausalLM.from_pretrained(runs / "llama")
    first = _val_loss(original, cfg, n, hf=True)
    for case in ("lora_hf_model_zero3-2", "lora_hf_model_ddp-2", "lora_hf_model_tp-2",
                 "lora_hf_model_pp-2", "lora_hf_model_zero3-1"):
        _, vals = _losses(runs / case)
        assert vals[0] == pytest.approx(first, rel=RTOL), case
        assert abs(vals[-1] - vals[0]) > 1e-3, case  # the adapters trained
        base = transformers.LlamaForCausalLM.from_pretrained(runs / "llama")
        adapted = peft.PeftModel.from_pretrained(base, runs / case / "adapter")
        assert vals[-1] == pytest.approx(_val_loss(adapted, cfg, n, hf=True), rel=RTOL), case
        merged = transformers.LlamaForCausalLM.from_pretrained(runs / case / "model")
        assert vals[-1] == pytest.approx(_val_loss(merged, cfg, n, hf=True), rel=RTOL), case
        assert json.loads((runs / case / "model" / "config.json").read_text())[
            "architectures"] == ["LlamaForCausalLM"]


def _nf4_round_trip(model):
    """`model` with the linear weights of its blocks replaced by their NF4 round trip,
    computed by torchao directly (QLoRA's 64-value blocks; the double quantization's groups
    as `meshfit.peft.nf4_blocks` sizes them): the weights a QLoRA run computes with."""
    from torchao.quantization import to_nf4

    from meshfit.peft import nf4_blocks

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                block, scaler = nf4_blocks(module.weight.numel())
                module.weight.copy_(to_nf4(module.weight.contiguous(), block,
                                           scaler).get_original_weight())
    return model


def test_qlora_on_a_pretrained_folder_trains_on_its_4_bit_weights(runs):
    """QLoRA (one process, DDP and ZeRO-3 equal to one process above): the first evaluation
    is the folder's model with its block linears rounded to NF4 by torchao; the adapter
    loads with PeftModel.from_pretrained onto that rounded base and the merged folder with
    from_pretrained, both giving the run's last val_loss. The merged folder holds the
    rounded weights where no adapter was added (k_proj: the run adapts q_proj and v_proj
    only), bit for bit, not the folder's full-precision ones (this random model's
    loss barely moves under rounding; its weights do, by up to 1/4 of a block's largest)."""
    import peft
    import transformers

    cfg = _config(runs, "qlora_hf_model_zero3", 2)
    n = cfg.eval_windows()
    full = transformers.LlamaForCausalLM.from_pretrained(runs / "llama")
    rounded = _nf4_round_trip(transformers.LlamaForCausalLM.from_pretrained(runs / "llama"))
    first = _val_loss(rounded, cfg, n, hf=True)
    k_full, k_rounded = (m.model.layers[0].self_attn.k_proj.weight for m in (full, rounded))
    assert (k_full - k_rounded).abs().max() > 1e-3 * k_full.abs().max()
    for case in ("qlora_hf_model_zero3-2", "qlora_hf_model_ddp-2", "qlora_hf_model_zero3-1"):
        _, vals = _losses(runs / case)
        assert vals[0] == pytest.approx(first, rel=RTOL), case
        assert abs(vals[-1] - vals[0]) > 1e-3, case  # the adapters trained
        base = _nf4_round_trip(transformers.LlamaForCausalLM.from_pretrained(runs / "llama"))
        adapted = peft.PeftModel.from_pretrained(base, runs / case / "adapter")
        assert vals[-1] == pytest.approx(_val_loss(adapted, cfg, n, hf=True), rel=RTOL), case
        merged = transformers.LlamaForCausalLM.from_pretrained(runs / case / "model")
        assert vals[-1] == pytest.approx(_val_loss(merged, cfg, n, hf=True), rel=RTOL), case
        assert torch.equal(merged.model.layers[0].self_attn.k_proj.weight, k_rounded), case


def test_lora_adapters_on_a_meta_model_are_drawn_as_peft_draws_them(tmp_path):
    """The adapters of a meta_model under LoRA get values by peft's rule (A kaiming-uniform
    with a=sqrt(5): uniform within 1/sqrt(fan_in); B zero), the same for the same seed (so
    every rank, seeded alike, holds the same adapters), one per adapted linear."""
    import math

    import transformers

    from meshfit.checkpoint.pretrained import ADAPTER_VALUES_ATTR, meta_model
    from meshfit.peft import lora

    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                      num_hidden_layers=1, vocab_size=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    drawn = []
    for _ in range(2):
        torch.manual_seed(3)
        model = lora(meta_model(tmp_path), r=2)
        drawn.append(getattr(model, ADAPTER_VALUES_ATTR))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert drawn[-1].keys() == trainable and len(trainable) == 14  # 7 linears: A and B
    for name, value in drawn[0].items():
        torch.testing.assert_close(value, drawn[1][name], rtol=0, atol=0)
        if "lora_B" in name:
            assert not value.any(), name
        else:
            bound = 1 / math.sqrt(value.shape[1])
            assert 0 < value.abs().max() <= bound and value.std() > bound / 4, name


# ---------------------------------------------------------------------------- refusals
@pytest.fixture
def source_files(tmp_path):
    import transformers

    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2, vocab_size=100,
                             max_position_embeddings=16).save_pretrained(tmp_path / "small")
    (tmp_path / "nomodel").mkdir()
    (tmp_path / "nomodel" / "config.json").write_text("{}")
    (tmp_path / "plainmodels.py").write_text(
        "import torch\n\ndef build(vocab_size):\n    return torch.nn.Embedding(vocab_size, 8)\n")
    return tmp_path


@pytest.mark.parametrize("args, match", [
    (["--model.hf_config={t}/missing.json"], "model.hf_config='{t}/missing.json' is neither"),
    (["--model.hf_model={t}/nomodel"], "holds no model.safetensors"),
    (["--model.factory=nocolon"], "model.factory='nocolon' must look like module:attribute"),
    (["--model.hf_config={t}/small", "--model.factory=a:b"], "are both set"),
    (["--model.hf_config={t}/small", "--model.n_layer=3"], "sizes the reference GPT"),
    (["--model.hf_config={t}/small"], "vocabulary holds 100 ids but the tokenizer"),
    (["--model.factory=plainmodels:build", "--parallel.tp=2", "--parallel.dp_replicate=1"],
     "Accelerator(tp_plan=PLAN)"),
    (["--model.factory=nomodule:build", "--parallel.tp=2", "--parallel.dp_replicate=1"],
     "cannot import 'nomodule'"),
])
def test_bad_model_sources_are_refused_before_launch(cli_refusal, source_files, monkeypatch,
                                                     args, match):
    monkeypatch.chdir(source_files)
    argv = [a.format(t=source_files) for a in args]
    line = cli_refusal("train", "--nproc", "2", "--out", str(source_files / "run"), *argv)
    assert match.format(t=source_files) in line
    assert not (source_files / "run").exists()


def test_seq_len_beyond_the_models_positions_is_refused(cli_refusal, source_files, tmp_path):
    line = cli_refusal("train", "--out", str(tmp_path / "run"),
                       f"--model.hf_config={source_files}/small", "--train.seq_len=32",
                       f"--data.tokenizer={source_files}/tok-missing")
    assert "data.tokenizer" in line  # the tokenizer is checked first; then the positions:
    import transformers
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"a": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(
        tmp_path / "tok")
    line = cli_refusal("train", "--out", str(tmp_path / "run"),
                       f"--model.hf_config={source_files}/small", "--train.seq_len=32",
                       f"--data.tokenizer={tmp_path}/tok")
    assert "train.seq_len=32 is longer than the 16 positions" in line


def test_an_out_folder_with_a_run_is_not_overwritten(cli_refusal, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    line = cli_refusal("train", "--out", str(tmp_path))
    assert "already holds a run" in line and "--resume" in line
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'


def test_a_run_stopped_before_its_first_step_does_not_block_the_next(tmp_path):
    """Ctrl-C between writing config.toml and the first step leaves config.toml (and the
    first evaluation's line): nothing to keep, so the folder is not refused; a folder with a
    logged step, a checkpoint or a model is."""
    from meshfit.train.runfolder import check_run_folder

    (tmp_path / "config.toml").write_text("[train]\nsteps = 3\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val_loss": 5.5}\n')
    check_run_folder(tmp_path, resume=False, overwrite=False)  # not refused
    (tmp_path / "checkpoints").mkdir()
    check_run_folder(tmp_path, resume=False, overwrite=False)  # an empty checkpoints folder
    (tmp_path / "checkpoints" / "step-1.tmp-abc").mkdir()  # a save had begun
    with pytest.raises(ValueError, match="already holds a run"):
        check_run_folder(tmp_path, resume=False, overwrite=False)


def test_documents_kept_apart_compute_each_document_as_alone(files):
    """data.document_mask: a window of the token stream holding several documents gives,
    in fp64, the loss sum and gradients of its documents run one by one (positions restart
    after EOS, attention stays inside each, a document's first token is no target)."""
    import transformers

    from meshfit.data import TokenDataset
    from meshfit.train.models import loss_function

    model = transformers.LlamaForCausalLM.from_pretrained(files / "llama").double()
    eos = 1
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(2, 300, (n,), generator=g).tolist() + [eos] for n in (6, 9, 4)]
    stream = np.array(sum(docs, []) + [5], dtype=np.int64)  # 22 tokens: one window of 21
    x, y, pos = (t[None] for t in TokenDataset(stream, 21, separator=eos)[0])
    assert pos[0].tolist()[:8] == [0, 1, 2, 3, 4, 5, 6, 0]
    loss = loss_function(model)
    total = loss(model, x, y, pos) * (y != -100).sum()
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = 0.0
    for doc in docs:
        row = torch.tensor(doc)[None]
        alone = alone + loss(model, row[:, :-1], row[:, 1:]) * (len(doc) - 1)
    alone.backward()
    assert total.item() == pytest.approx(alone.item(), rel=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-12)


def test_a_lora_models_tp_plan_lays_the_adapters_out_like_their_linear():
    """Under tensor parallel each adapted linear's style goes to its base_layer; a
    column-parallel one gets A whole and B column-parallel, a row-parallel one A row-parallel
    and B whole (the runs above check the numbers); pipeline parallel is still refused."""
    from reference import tiny_gpt

    from meshfit.models.plans import pipeline_plan_for, plan_for
    from meshfit.peft import lora

    model = lora(tiny_gpt(), r=2)
    styles = plan_for(model).styles
    p = "base_model.model.layers.*.attn."
    assert styles[p + "wq.base_layer"].kind == "colwise"
    assert styles[p + "wq.lora_A.default"].kind == "replicate"
    assert styles[p + "wq.lora_B.default"].kind == "colwise"
    assert styles[p + "wo.base_layer"].kind == "rowwise"
    assert styles[p + "wo.lora_A.default"].kind == "rowwise"
    assert styles[p + "wo.lora_B.default"].kind == "replicate"
    assert p + "wq" not in styles
    # pipeline parallel cuts the model inside the PeftModel (meshfit.train.steps), whose
    # adapted linears go with their blocks; the PeftModel itself has no pipeline plan
    with pytest.raises(ValueError, match="pipeline parallel of a LoRA model"):
        pipeline_plan_for(model)
    # the layout checks before launch see the adapted model's blocks and sizes
    from meshfit.parallel.layout import ModelFacts

    assert ModelFacts.of(model) == ModelFacts.of(tiny_gpt())


def test_save_adapter_gathers_zero3_shards(runs):
    """The adapter written from ZeRO-3 shards equals the one the same seed gives in one
    process (LoRA's A is drawn at random, B is zero)."""
    from reference import tiny_gpt
    from safetensors.torch import load_file

    from meshfit.peft import lora

    torch.manual_seed(5)
    expected = {k: v for k, v in lora(tiny_gpt(), r=2).state_dict().items() if "lora_" in k}
    saved = load_file(runs / "zero3-adapter" / "adapter_model.safetensors")
    assert len(saved) == len(expected) > 0
    for name, value in saved.items():
        match = [k for k in expected if k.replace(".default", "") == name]
        assert len(match) == 1, name
        torch.testing.assert_close(value, expected[match[0]], rtol=0, atol=0)


def test_the_main_job_needs_no_optional_library(tmp_path, subprocess_env):
    """The quick start installs meshfit without extras: a run and its final model must not
    import peft, transformers or datasets (blocked here as if not installed)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "for name in ('peft', 'transformers', 'datasets'):\n"
            "    sys.modules[name] = None  # import fails as if not installed\n"
            "from meshfit.cli.main import main\n"
            f"sys.exit(main(['train', '--out', {str(tmp_path / 'run')!r}, '--train.steps=2', "
            "'--train.eval_every=0', '--train.global_batch_size=4', '--train.micro_batch_size=4', "
            "'--train.seq_len=32', '--model.n_layer=1', '--train.eval_batches=1', "
            f"'--data.cache_dir={tmp_path / 'cache'}']))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=subprocess_env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "run" / "model").iterdir()) == [
        "config.json", "meshfit-digests.json", "meshfit_tokenizer.json", "model.safetensors"]
