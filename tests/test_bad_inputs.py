"""A catalogue of bad inputs: every one is refused with one line before anything starts.

Each case calls `meshfit.cli.main.main` in this process (or builds an `Accelerator`) and
checks what a user would see and what must not happen: exit code 2 and exactly one stderr
line ``meshfit CMD: error: ...`` that names the option or config key and the offending
value; no file or folder created in the test's folder (no run folder); no worker started
(`meshfit.launch.run`, torch's launcher and the in-process trainer are replaced by
functions that fail the test); os.environ left as it was. Token caches go to a folder
outside the test's folder (building one is what the first rank would do anyway).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

# ------------------------------------------------------------------ files the cases use
TEXT = "def f(x):\n    return x + 1\n" * 40  # 1,080 bytes: a few windows of 64
FILES = {
    "small.txt": "hello world\n",
    "old/metrics.jsonl": '{"step": 0, "val_loss": 5.5}\n{"step": 1, "loss": 5.4}\n',
    "text/a.py": TEXT,
    "empty/": None,
    "blank/a.txt": "",
    "hidden/.a.txt": TEXT,
    "binary/a.bin": b"\xff\xfe\x00\x81" * 100,
    "nested/inner/": None,
    "tokdir/": None,
    "calib_dir/": None,
    "bad_calib.json": "{ not json",
    "hfconf/": None,
    "hfconf/config.json": '{"model_type": "nosuchmodel"}',
    "gpt2conf/config.json": ('{"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4, '
                             '"vocab_size": 300, "n_positions": 256, "bos_token_id": 0, '
                             '"eos_token_id": 0}'),
    # context parallel's refusals, one per class (configs only: no model is built)
    "qwen3nextconf/config.json": '{"model_type": "qwen3_next", "num_hidden_layers": 4}',
    "minimaxconf/config.json": '{"model_type": "minimax", "num_hidden_layers": 4}',
    "t5conf/config.json": '{"model_type": "t5", "num_layers": 1}',
    "gemma3biconf/config.json": ('{"model_type": "gemma3_text", '
                                 '"use_bidirectional_attention": true}'),
    "script.py": "raise SystemExit('the script ran')\n",
    "scripts/": None,
}
"""Created in each test's folder before the call (a trailing / makes a folder)."""


def _write(root: Path, files: dict) -> None:
    for rel, content in files.items():
        path = root / rel
        if rel.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def _listing(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


# ------------------------------------------------------------------ the catalogue
# (id, argv, substrings the error line must hold, extra files). "{t}" is the test's folder,
# "{c}" the token-cache folder. `meshfit train` cases get "--out {t}/run" prepended.
TRAIN = "train"
T = [  # meshfit train: config overrides
    # [model]
    ("model.n_layer=0", ["--model.n_layer=0"], ["model.n_layer=0", ">= 1"]),
    ("model.n_head negative", ["--model.n_head=-2"], ["model.n_head=-2"]),
    ("model.d_model float", ["--model.d_model=1.5"], ["model.d_model=1.5"]),
    ("model.d_ff bool", ["--model.d_ff=true"], ["model.d_ff=True"]),
    ("model.dropout > 1", ["--model.dropout=1.5"], ["model.dropout=1.5"]),
    ("model.dropout nan", ["--model.dropout=nan"], ["model.dropout=nan"]),
    ("model.attention_backend enum", ["--model.attention_backend=fastest"],
     ["model.attention_backend='fastest'"]),
    ("model.factory no colon", ["--model.factory=mymodels"], ["model.factory='mymodels'",
                                                              "module:attribute"]),
    ("model.factory missing module", ["--model.factory=no_such_module_xyz:build"],
     ["model.factory", "no_such_module_xyz"]),
    ("model.factory missing attribute", ["--model.factory=math:no_such_builder"],
     ["model.factory", "no_such_builder"]),
    ("model.tp_plan no colon", ["--model.tp_plan=plans"], ["model.tp_plan='plans'"]),
    ("model.pipeline_plan no colon", ["--model.pipeline_plan=:PLAN"],
     ["model.pipeline_plan=':PLAN'"]),
    ("model.hf_config missing", ["--model.hf_config={t}/nope.json"],
     ["model.hf_config=", "nope.json"]),
    ("model.hf_config folder without config.json", ["--model.hf_config={t}/empty"],
     ["model.hf_config=", "empty"]),
    ("model.hf_model missing", ["--model.hf_model={t}/no_model"], ["model.hf_model", "no_model"]),
    ("model two sources", ["--model.factory=a:b", "--model.hf_config={t}/hfconf"],
     ["model.hf_config", "model.factory", "both set"]),
    ("model size with a foreign source", ["--model.factory=a:b", "--model.n_layer=2"],
     ["model.n_layer=2", "model.factory"]),
    ("model.preset int", ["--model.preset=5"], ["model.preset=5"]),
    ("model.top_k without experts", ["--model.top_k=3"], ["model.top_k=3", "n_experts=0"]),
    ("model.router enum", ["--model.preset=moe-tiny", "--model.router=random"],
     ["router", "random"]),
    ("model.capacity_factor negative", ["--model.preset=moe-tiny", "--model.capacity_factor=-1"],
     ["capacity_factor", "-1"]),
    ("model.n_experts negative", ["--model.n_experts=-4"], ["n_experts", "-4"]),
    ("model.hf_config int", ["--model.hf_config=5"], ["model.hf_config=5"]),
    ("model.hf_config not JSON", ["--model.hf_config={t}/bad_calib.json"],
     ["model.hf_config=", "bad_calib.json", "building the model raised OSError"]),
    ("model.hf_config unknown model_type", ["--model.hf_config={t}/hfconf/config.json"],
     ["model.hf_config=", "nosuchmodel"]),
    ("model.hf_model folder without config", ["--model.hf_model={t}/empty"],
     ["model.hf_model=", "empty", "config.json"]),
    ("model.factory not a function", ["--model.factory=math:pi"],
     ["model.factory='math:pi'", "building the model raised TypeError"]),
    # [train]
    ("train.steps negative", ["--train.steps=-5"], ["train.steps=-5"]),
    ("train.steps float", ["--train.steps=1.5"], ["train.steps=1.5"]),
    ("train.steps string", ['--train.steps="10"'], ["train.steps='10'"]),
    ("train.steps empty", ["--train.steps="], ["train.steps=''"]),
    ("train.steps inf", ["--train.steps=inf"], ["train.steps=inf"]),
    ("train.global_batch_size=0", ["--train.global_batch_size=0"],
     ["train.global_batch_size=0"]),
    ("train.micro_batch_size negative", ["--train.micro_batch_size=-1"],
     ["train.micro_batch_size=-1"]),
    ("train.seq_len=0", ["--train.seq_len=0"], ["train.seq_len=0"]),
    ("train.min_lr_ratio inf", ["--train.min_lr_ratio=inf"], ["train.min_lr_ratio=inf"]),
    ("train.min_lr_ratio nan", ["--train.min_lr_ratio=nan"], ["train.min_lr_ratio=nan"]),
    ("train.min_lr_ratio > 1", ["--train.min_lr_ratio=2"], ["train.min_lr_ratio=2"]),
    ("train.grad_clip negative", ["--train.grad_clip=-1"], ["train.grad_clip=-1"]),
    ("train.grad_clip -inf", ["--train.grad_clip=-inf"], ["train.grad_clip=-inf"]),
    ("train.warmup_steps negative", ["--train.warmup_steps=-1"], ["train.warmup_steps=-1"]),
    ("train.seed negative", ["--train.seed=-1"], ["train.seed=-1"]),
    ("train.eval_every negative", ["--train.eval_every=-1"], ["train.eval_every=-1"]),
    ("train.eval_batches=0", ["--train.eval_batches=0"], ["train.eval_batches=0"]),
    ("train.log_every=0", ["--train.log_every=0"], ["train.log_every=0"]),
    ("train.timeout_s=0", ["--train.timeout_s=0"], ["train.timeout_s=0"]),
    ("train.timeout_s nan", ["--train.timeout_s=nan"], ["train.timeout_s=nan"]),
    ("train.tf32 string", ["--train.tf32=yes"], ["train.tf32='yes'", "true or false"]),
    ("train.compile int", ["--train.compile=1"], ["train.compile=1"]),
    ("train.find_batch_size string", ["--train.find_batch_size=maybe"],
     ["train.find_batch_size='maybe'"]),
    ("train.activation_checkpointing_policy enum",
     ["--train.activation_checkpointing_policy=layer"],
     ["train.activation_checkpointing_policy='layer'"]),
    ("train.activation_checkpointing_every=0", ["--train.activation_checkpointing_every=0"],
     ["train.activation_checkpointing_every=0"]),
    ("train.compile_scope enum", ["--train.compile_scope=layer"], ["train.compile_scope='layer'"]),
    ("train.compile_mode unknown", ["--train.compile=true", "--train.compile_mode=turbo"],
     ["compile_mode", "turbo"]),
    ("train.empty_cache_steps negative", ["--train.empty_cache_steps=-3"],
     ["train.empty_cache_steps=-3"]),
    ("train.mixed_precision enum", ["--train.mixed_precision=bf32"],
     ["train.mixed_precision", "bf32"]),
    ("train global batch not a multiple", ["--train.global_batch_size=10",
                                           "--train.micro_batch_size=4"],
     ["train.global_batch_size=10", "train.micro_batch_size=4"]),
    # [optim]
    ("optim.lr=0", ["--optim.lr=0"], ["optim.lr=0"]),
    ("optim.lr negative", ["--optim.lr=-0.1"], ["optim.lr=-0.1"]),
    ("optim.lr nan", ["--optim.lr=nan"], ["optim.lr=nan"]),
    ("optim.lr inf", ["--optim.lr=inf"], ["optim.lr=inf"]),
    ("optim.lr string", ["--optim.lr=fast"], ["optim.lr='fast'"]),
    ("optim.weight_decay negative", ["--optim.weight_decay=-0.1"], ["optim.weight_decay=-0.1"]),
    ("optim.eps > 1", ["--optim.eps=2"], ["optim.eps=2"]),
    ("optim.momentum > 1", ["--optim.momentum=1.5"], ["optim.momentum=1.5"]),
    ("optim.betas = 1", ["--optim.betas=[0.9, 1.0]"], ["optim.betas=[0.9, 1.0]"]),
    ("optim.betas string", ["--optim.betas=0.9"], ["optim.betas=0.9"]),
    ("optim.betas bool", ["--optim.betas=[0.9, true]"], ["optim.betas=[0.9, True]"]),
    ("optim.betas nan", ["--optim.betas=[nan, 0.9]"], ["optim.betas=[nan, 0.9]"]),
    # [peft]
    ("peft.method enum", ["--peft.method=dora"], ["peft.method='dora'"]),
    ("qlora on random weights", ["--peft.method=qlora"],
     ["peft.method='qlora'", "model.hf_model=FOLDER", "peft.method='lora'"]),
    ("peft.r=0", ["--peft.r=0"], ["peft.r=0"]),
    ("peft.alpha=0", ["--peft.alpha=0"], ["peft.alpha=0"]),
    ("peft.dropout=1", ["--peft.dropout=1.0"], ["peft.dropout=1.0"]),
    ("peft.merge int", ["--peft.merge=2"], ["peft.merge=2"]),
    ("peft.target_modules string", ["--peft.target_modules=wq"], ["peft.target_modules='wq'"]),
    # [data]
    ("data.num_workers negative", ["--data.num_workers=-1"], ["data.num_workers=-1"]),
    ("data.persistent_workers string", ["--data.persistent_workers=nah"],
     ["data.persistent_workers='nah'"]),
    ("data.pin_memory int", ["--data.pin_memory=0"], ["data.pin_memory=0"]),
    ("data.tokenizer missing", ["--data.tokenizer={t}/no_tok"], ["data.tokenizer=", "no_tok"]),
    ("data.tokenizer int", ["--data.tokenizer=5"], ["data.tokenizer=5"]),
    ("data.tokenizer folder without tokenizer", ["--data.tokenizer={t}/tokdir"],
     ["data.tokenizer", "tokdir"]),
    ("data.hf_dataset missing", ["--data.hf_dataset={t}/no_ds"], ["data.hf_dataset=", "no_ds"]),
    ("data.hf_dataset and data.path", ["--data.hf_dataset={t}/text", "--data.path={t}/text"],
     ["data.path=", "data.hf_dataset=", "mutually exclusive"]),
    ("data.text_column empty", ['--data.text_column=""'], ["data.text_column=''"]),
    ("data.path int", ["--data.path=7"], ["data.path=7"]),
    ("data.path missing", ["--data.path={t}/gone.txt"], ["data.path=", "gone.txt",
                                                          "does not exist"]),
    ("data.tokenizer a text file", ["--data.tokenizer={t}/small.txt"],
     ["data.tokenizer=", "small.txt"]),
    ("data.hf_dataset without data files", ["--data.hf_dataset={t}/empty",
                                            "--data.cache_dir={c}"],
     ["data.hf_dataset=", "empty"]),
    ("data.cache_dir is a file", ["--data.cache_dir={t}/small.txt"],
     ["data.cache_dir=", "small.txt", "is a file"]),
    ("data.cache_dir under a file", ["--data.cache_dir={t}/small.txt/cache"],
     ["data.cache_dir=", "small.txt", "is a file"]),
    ("data.path empty folder", ["--data.path={t}/empty", "--data.cache_dir={c}"],
     ["data.path=", "empty", "no (non-hidden) files"]),
    ("data.path only hidden files", ["--data.path={t}/hidden", "--data.cache_dir={c}"],
     ["data.path=", "hidden"]),
    ("data.path only folders", ["--data.path={t}/nested", "--data.cache_dir={c}"],
     ["data.path=", "nested"]),
    ("data.path empty file", ["--data.path={t}/blank", "--data.cache_dir={c}"],
     ["data.path", "no text"]),
    ("data.path not UTF-8", ["--data.path={t}/binary", "--data.cache_dir={c}"],
     ["data.path", "no text"]),
    ("data too small for one window", ["--data.path={t}/small.txt", "--data.cache_dir={c}"],
     ["data.path=", "small.txt", "0 training windows", "train.seq_len=128"]),
    ("micro-batch larger than the data",
     ["--data.path={t}/text", "--data.cache_dir={c}", "--train.seq_len=64",
      "--train.micro_batch_size=32", "--train.global_batch_size=32"],
     ["data.path=", "16 training windows", "train.global_batch_size=32",
      "train.micro_batch_size=32"]),
    ("global batch larger than the data",
     ["--data.path={t}/text", "--data.cache_dir={c}", "--train.seq_len=64",
      "--train.micro_batch_size=2", "--train.global_batch_size=64"],
     ["16 training windows", "train.global_batch_size=64", "32 accumulation"]),
    ("global batch per rank larger than the data",
     ["--nproc", "2", "--data.path={t}/text", "--data.cache_dir={c}", "--train.seq_len=64",
      "--train.micro_batch_size=8", "--train.global_batch_size=32"],
     ["16 training windows", "train.global_batch_size=32", "2 data-parallel rank(s)"]),
    ("validation split smaller than a window",
     ["--data.path={t}/text", "--data.cache_dir={c}", "--train.seq_len=32",
      "--train.micro_batch_size=2", "--train.global_batch_size=4"],
     ["data.path=", "0 validation windows", "train.seq_len=32"]),
    # [parallel]
    ("parallel.pp=0", ["--parallel.pp=0"], ["pp", "0"]),
    ("parallel.tp negative", ["--parallel.tp=-1"], ["tp", "-1"]),
    ("parallel.tp string", ["--parallel.tp=two"], ["tp", "two"]),
    ("parallel.dp_shard vs nproc", ["--nproc", "2", "--parallel.dp_shard=3"],
     ["dp_shard", "3", "2"]),
    ("parallel product vs nproc", ["--nproc", "2", "--parallel.dp_replicate=2",
                                   "--parallel.dp_shard=2"], ["product 4", "world size is 2"]),
    ("parallel.pp vs nproc", ["--nproc", "3", "--parallel.pp=2"], ["pp", "3"]),
    ("parallel.zero_stage=4", ["--parallel.zero_stage=4"], ["zero_stage=4"]),
    ("parallel.zero_stage float", ["--parallel.zero_stage=1.5"], ["zero_stage=1.5"]),
    ("parallel.zero_stage without shards", ["--nproc", "2", "--parallel.zero_stage=2"],
     ["zero_stage=2", "dp_shard"]),
    ("parallel.offload enum", ["--parallel.offload=gpu"], ["offload", "gpu"]),
    ("parallel.sync_each_batch enum", ["--parallel.sync_each_batch=sometimes"],
     ["sync_each_batch", "sometimes"]),
    ("parallel.schedule enum", ["--parallel.schedule=zigzag"], ["parallel.schedule='zigzag'"]),
    ("parallel.microbatches=0", ["--parallel.microbatches=0"], ["parallel.microbatches=0"]),
    ("parallel.virtual_stages negative", ["--parallel.virtual_stages=-1"],
     ["parallel.virtual_stages=-1"]),
    ("parallel.sequence_parallel string", ["--parallel.sequence_parallel=yes"],
     ["sequence_parallel", "yes"]),
    ("parallel.microbatches not dividing", ["--nproc", "2", "--parallel.pp=2",
                                            "--parallel.dp_replicate=1",
                                            "--parallel.microbatches=3"],
     ["parallel.microbatches=3"]),
    ("parallel.ep not dividing", ["--nproc", "2", "--model.preset=moe-tiny",
                                  "--parallel.dp_shard=2", "--parallel.dp_replicate=1",
                                  "--parallel.ep=3"], ["ep", "3"]),
    ("document_mask with the byte tokenizer", ["--data.document_mask=true"],
     ["data.document_mask=true needs a tokenizer with an EOS token"]),
    ("peft with ep", ["--nproc", "2", "--parallel.dp_shard=2", "--parallel.dp_replicate=1",
                      "--parallel.ep=2", "--model.preset=moe-tiny", "--peft.method=lora"],
     ["peft.method='lora'", "ep > 1"]),
    # optimizer state on disk
    ("offload disk without a folder", ["--parallel.offload=disk"],
     ["parallel.offload='disk' needs parallel.offload_dir=PATH"]),
    ("offload_dir without disk", ["--parallel.offload_dir={t}/off"],
     ["parallel.offload_dir=", "parallel.offload='disk' only"]),
    ("offload_params without disk", ["--parallel.offload_params=true"],
     ["parallel.offload_params=true", "parallel.offload='none'", "set parallel.offload='disk'"]),
    ("offload_params at ZeRO-2", ["--nproc", "2", "--parallel.dp_shard=2",
                                  "--parallel.dp_replicate=1", "--parallel.zero_stage=2",
                                  "--parallel.offload=disk", "--parallel.offload_dir={t}/off",
                                  "--parallel.offload_params=true"],
     ["parallel.offload_params=true needs zero_stage=3", "zero_stage=2"]),
    ("offload disk under a file", ["--parallel.offload=disk",
                                   "--parallel.offload_dir={t}/bad_calib.json/off"],
     ["parallel.offload_dir=", "bad_calib.json' is a file, not a folder"]),
    ("offload disk on a full disk", ["--parallel.offload=disk", "--parallel.offload_dir=/proc/x"],
     ["parallel.offload_dir='/proc/x': the optimizer state of 1 local rank(s) needs",
      "GiB is free on that disk"]),
    # context parallel
    ("cp with tp at zero_stage 0", ["--nproc", "4", "--parallel.cp=2", "--parallel.tp=2",
                                    "--parallel.dp_replicate=1"],
     ["parallel.zero_stage=0 with parallel.cp=2 and parallel.tp=2", "set zero_stage 1, 2 or 3"]),
    ("cp, seq_len not in 2 x cp chunks", ["--nproc", "2", "--parallel.cp=2",
                                          "--parallel.dp_replicate=1", "--train.seq_len=66"],
     ["train.seq_len=66", "4 equal chunks", "multiple of 4"]),
    ("cp with dropout", ["--nproc", "2", "--parallel.cp=2", "--parallel.dp_replicate=1",
                         "--model.dropout=0.1"], ["parallel.cp=2 with model.dropout=0.1"]),
    ("cp with compile", ["--nproc", "2", "--parallel.cp=2", "--parallel.dp_replicate=1",
                         "--train.compile=true"], ["parallel.cp=2 with train.compile=true"]),
    # (a sliding window, Mistral's here, runs under cp: tests/parallel/test_cp_families.py)
    ("cp with attention dropout (GPT-2's default)", ["--nproc", "2", "--parallel.cp=2",
                                                     "--parallel.dp_replicate=1",
                                                     "--model.hf_config={t}/gpt2conf"],
     ["parallel.cp=2 with model.hf_config=", "attn_pdrop=0.1 is not available", "set it to 0"]),
    ("cp with a linear-attention hybrid", ["--nproc", "2", "--parallel.cp=2",
                                           "--parallel.dp_replicate=1",
                                           "--model.hf_config={t}/qwen3nextconf"],
     ["parallel.cp=2 with model.hf_config=", "model_type 'qwen3_next'",
      "attention does not go through transformers' attention interface", "ZeRO and DDP"]),
    ("cp with linear-attention layers", ["--nproc", "2", "--parallel.cp=2",
                                         "--parallel.dp_replicate=1",
                                         "--model.hf_config={t}/minimaxconf"],
     ["parallel.cp=2 with model.hf_config=", "'linear_attention' layers (layer_types)",
      "ZeRO and DDP"]),
    ("cp with an encoder-decoder", ["--nproc", "2", "--parallel.cp=2",
                                    "--parallel.dp_replicate=1", "--model.hf_config={t}/t5conf"],
     ["parallel.cp=2 with model.hf_config=", "model_type 't5' has no causal decoder",
      "ZeRO and DDP"]),
    ("cp with bidirectional attention", ["--nproc", "2", "--parallel.cp=2",
                                         "--parallel.dp_replicate=1",
                                         "--model.hf_config={t}/gemma3biconf"],
     ["parallel.cp=2 with model.hf_config=", "bidirectional attention is not available"]),
    ("cp_load_balance int", ["--parallel.cp_load_balance=2"], ["parallel.cp_load_balance=2"]),
    # [checkpoint] and [log]
    ("checkpoint.every negative", ["--checkpoint.every=-1"], ["checkpoint.every=-1"]),
    ("checkpoint.keep=0", ["--checkpoint.keep=0"], ["checkpoint.keep=0"]),
    ("checkpoint.async string", ["--checkpoint.async=yes"], ["checkpoint.async='yes'"]),
    ("checkpoint.async_mode enum", ["--checkpoint.async_mode=fork"],
     ["checkpoint.async_mode='fork' is not one of thread, process"]),
    ("log.with int", ["--log.with=5"], ["log.with=5"]),
    ("log.with unknown tracker", ["--log.with=neptune"], ["log.with", "neptune"]),
    ("log.project empty", ['--log.project=""'], ["log.project=''"]),
    ("log.calibration folder", ["--log.calibration={t}/calib_dir"],
     ["calib_dir"]),
    ("log.calibration not JSON", ["--log.calibration={t}/bad_calib.json"], ["bad_calib.json"]),
    ("log.calibration int", ["--log.calibration=3"], ["log.calibration=3"]),
    # sections, keys, override syntax
    ("unknown section", ["--trainer.steps=3"], ["unknown config section(s) trainer"]),
    ("unknown key", ["--model.layers=3"], ["unknown key(s) in [model]: layers"]),
    ("dotted key too deep", ["--train.steps.max=3"], ["[train]: steps.max"]),
    ("override without key", ["--train.=3"], ["'--train.=3'", "--section.key=value"]),
    ("override without section", ["--.steps=3"], ["'--.steps=3'", "--section.key=value"]),
    ("override without value", ["--train.steps"], ["'--train.steps' needs a value"]),
    ("bare section override", ["--train=5"], ["unknown argument '--train=5'"]),
    ("positional argument", ["oops"], ["unknown argument 'oops'"]),
    # integers past what torch and C++ hold
    ("train.timeout_s huge", ["--train.timeout_s=99999999999999999999"],
     ["train.timeout_s=99999999999999999999 is too large", "from 1 to 31,622,400"]),
    ("train.seed huge", ["--train.seed=99999999999999999999"],
     ["train.seed=99999999999999999999 is too large", "from 0 to"]),
    ("train.steps huge", ["--train.steps=99999999999999999999"],
     ["train.steps=99999999999999999999 is too large", "9,223,372,036,854,775,807"]),
    # float8 (torchao): a GPU of compute capability 8.9+ only
    ("float8 on a CPU", ["--train.float8=true"], ["train.float8=True needs an NVIDIA GPU",
                                                   "device is cpu", "train.float8=False"]),
    ("float8 recipe unknown", ["--train.float8_recipe=delayed"],
     ["train.float8_recipe='delayed'", "rowwise"]),
    # launch options of train
    ("train --nproc 0", ["--nproc", "0"], ["--nproc=0"]),
    ("train --max-restarts negative", ["--max-restarts", "-1"], ["--max-restarts=-1"]),
    ("train --master-port out of range", ["--master-port", "70000"], ["--master-port=70000"]),
    ("train --nnodes without port", ["--nnodes", "2"], ["--master-port is required"]),
    ("train --gpus duplicate", ["--gpus", "0,0"], ["--gpus='0,0'"]),
    ("train --out holds a run", ["--out", "{t}/old"], ["--out=", "old", "already holds a run"]),
    # --resume
    ("resume without --out", ["--resume", "DROP_OUT"], ["--resume needs --out"]),
    ("resume with --config", ["--resume", "--config", "{t}/small.txt"], ["drop --config"]),
    ("resume of a folder without a run", ["--resume"], ["--resume", "config.toml",
                                                       "does not exist"]),
]

TOML = [  # meshfit train --config FILE
    ("toml train = 5 plus override", "train = 5\n", ["--train.steps=3"],
     ["train = 5", "[train]"]),
    ("toml train = 5", "train = 5\n", [], ["[train]", "train = 5"]),
    ("toml model = string", 'model = "tiny"\n', [], ["[model]", "model = 'tiny'"]),
    ("toml syntax error", "[train\nsteps = 3\n", [],
     ["--config=", "run.toml", "not valid TOML", "line 1"]),
    ("toml duplicate key", "[train]\nsteps = 3\nsteps = 4\n", [],
     ["--config=", "run.toml", "not valid TOML", "line 3"]),
    ("toml duplicate section", "[train]\nsteps = 3\n[train]\nseed = 1\n", [],
     ["--config=", "run.toml", "not valid TOML", "line 3"]),
    ("toml bare word", "[train]\nsteps = three\n", [],
     ["--config=", "run.toml", "not valid TOML", "line 2"]),
    ("toml unknown section", "[trainer]\nsteps = 3\n", [], ["unknown config section(s) trainer"]),
    ("toml unknown key", "[optim]\nlearning_rate = 0.1\n", [],
     ["unknown key(s) in [optim]: learning_rate"]),
    ("toml inline table value", "[train]\nsteps = {a = 1}\n", [], ["train.steps={{'a': 1}}"]),
    ("toml nan", "[optim]\nlr = nan\n", [], ["optim.lr=nan"]),
    ("toml negative size", "[model]\nd_model = -64\n", [], ["model.d_model=-64"]),
    ("toml wrong type in [data]", "[data]\nnum_workers = \"2\"\n", [],
     ["data.num_workers='2'"]),
    ("toml array for a flag", "[parallel]\nloss_parallel = [true]\n", [],
     ["loss_parallel", "[True]"]),
    ("toml not UTF-8", b"[train]\nsteps = \xff\n", [], ["--config=", "run.toml", "not UTF-8"]),
    ("toml nested section", "[train.extra]\nx = 1\n", [], ["[train]: extra"]),
    ("toml with override of an unknown key", "[train]\nsteps = 3\n", ["--train.stpes=3"],
     ["unknown key(s) in [train]: stpes"]),
]

CONFIG_FILES = [  # --config itself
    ("config missing", ["--config", "{t}/none.toml"], ["--config=", "none.toml",
                                                       "does not exist"]),
    ("config is a folder", ["--config", "{t}/empty"], ["--config=", "empty", "folder"]),
]

LAUNCH = [  # meshfit launch (the script is {t}/script.py unless given)
    ("launch script missing", ["{t}/nope.py"], ["script=", "nope.py", "is not a file"]),
    ("launch script is a folder", ["{t}/scripts"], ["script=", "scripts", "is not a file"]),
    ("launch --max-restarts negative", ["--max-restarts", "-2", "{t}/script.py"],
     ["--max-restarts=-2"]),
    ("launch --master-port 0", ["--master-port", "0", "{t}/script.py"], ["--master-port=0"]),
    ("launch --master-port too large", ["--master-port", "65536", "{t}/script.py"],
     ["--master-port=65536"]),
    ("launch --nproc negative", ["--nproc", "-3", "{t}/script.py"], ["--nproc=-3"]),
    ("launch --nnodes 0", ["--nnodes", "0", "{t}/script.py"], ["--nnodes=0"]),
    ("launch --node-rank negative", ["--nnodes", "2", "--node-rank", "-1", "--master-port",
                                     "29999", "{t}/script.py"], ["--node-rank=-1"]),
    ("launch --gpus empty", ["--gpus", ",", "{t}/script.py"], ["--gpus=','"]),
    ("launch --gpus negative", ["--gpus=-1", "{t}/script.py"], ["--gpus='-1'"]),
    ("launch --num_machines 0", ["--num_machines", "0", "{t}/script.py"],
     ["--num_machines=0"]),
]

CHART = [  # meshfit pipeline-chart RUN (a folder "run" built per case)
    ("chart folder missing", ["{t}/no_run"], {}, ["no_run", "does not exist"]),
    ("chart folder is a file", ["{t}/small.txt"], {}, ["small.txt", "is not a folder"]),
    ("chart run without pp", ["{t}/run"], {"run/metrics.jsonl": "{}\n"},
     ["pipeline.json", "not pipeline-parallel", "--parallel.pp=2"]),
    ("chart meta not JSON", ["{t}/run"], {"run/pipeline.json": "{oops"},
     ["pipeline.json", "not valid JSON"]),
    ("chart meta keys", ["{t}/run"], {"run/pipeline.json": '{"schedule": "1f1b"}'},
     ["pipeline.json", "missing keys"]),
    ("chart meta schedule", ["{t}/run"], {"run/pipeline.json": "META:schedule=zigzag"},
     ["pipeline.json", "schedule='zigzag'"]),
    ("chart meta pp=0", ["{t}/run"], {"run/pipeline.json": "META:pp=0"},
     ["pipeline.json", "pp=0"]),
    ("chart timings missing", ["{t}/run"], {"run/pipeline.json": "META:"},
     ["pipeline_timings.jsonl", "not found"]),
    ("chart timings corrupt", ["{t}/run"], {"run/pipeline.json": "META:",
                                             "run/pipeline_timings.jsonl": "TIMINGS:\n{bro"},
     ["pipeline_timings.jsonl line 9", "not valid JSON"]),
    ("chart timings empty", ["{t}/run"], {"run/pipeline.json": "META:",
                                           "run/pipeline_timings.jsonl": "\n"},
     ["pipeline_timings.jsonl", "no timings"]),
    ("chart timings binary", ["{t}/run"], {"run/pipeline.json": "META:",
                                            "run/pipeline_timings.jsonl": b"\xff\xfe\x00"},
     ["pipeline_timings.jsonl", "not UTF-8"]),
    ("chart timings bad phase", ["{t}/run"], {"run/pipeline.json": "META:",
                                               "run/pipeline_timings.jsonl": "TIMINGS:phase=up"},
     ["pipeline_timings.jsonl line 1", "up"]),
    ("chart --step not recorded", ["{t}/run", "--step", "99"],
     {"run/pipeline.json": "META:", "run/pipeline_timings.jsonl": "TIMINGS:"}, ["99"]),
    ("chart --step negative", ["{t}/run", "--step", "-1"],
     {"run/pipeline.json": "META:", "run/pipeline_timings.jsonl": "TIMINGS:"}, ["-1"]),
    ("chart --out is a folder", ["{t}/run", "--out", "{t}/empty"],
     {"run/pipeline.json": "META:", "run/pipeline_timings.jsonl": "TIMINGS:"},
     ["--out=", "empty", "is a folder"]),
    ("chart --out under a file", ["{t}/run", "--out", "{t}/small.txt/chart.png"],
     {"run/pipeline.json": "META:", "run/pipeline_timings.jsonl": "TIMINGS:"},
     ["--out=", "small.txt", "is a file"]),
]

ARGPARSE = [  # what the argument parsers refuse (a bad number, a missing or unknown argument)
    ("launch --nproc not a number", ["launch", "--nproc", "abc", "{t}/script.py"],
     ["argument --nproc", "'abc'", "meshfit launch --help"]),
    ("launch without a script", ["launch"], ["required", "script"]),
    ("launch unknown flag", ["launch", "--bogus", "{t}/script.py"], ["--bogus"]),
    ("train --nproc not a number", ["train", "--nproc", "two", "--out", "{t}/run"],
     ["argument --nproc", "'two'"]),
    ("train --config without a value", ["train", "--out", "{t}/run", "--config"],
     ["argument --config", "expected one argument"]),
    ("pipeline-chart --step not a number", ["pipeline-chart", "{t}/run", "--step", "abc"],
     ["argument --step", "'abc'"]),
    ("pipeline-chart without a run", ["pipeline-chart"], ["required", "RUN"]),
    ("export without arguments", ["export"], ["required", "CKPT_OR_RUN"]),
    ("plot without a run", ["plot"], ["required", "RUN"]),
]

OTHER = [  # other subcommands, where a refusal is cheap
    ("export source missing", ["export", "{t}/no_ckpt", "{t}/exported"], ["no_ckpt"]),
    ("export source without checkpoint", ["export", "{t}/empty", "{t}/exported"], ["empty"]),
    ("generate run missing", ["generate", "{t}/no_run", "--prompt", "x"], ["no_run"]),
    ("eval run missing", ["eval", "{t}/no_run"], ["no_run"]),
    ("plot run missing", ["plot", "{t}/no_run"], ["no_run"]),
    ("plot run without metrics", ["plot", "{t}/empty"], ["empty", "metrics.jsonl"]),
]


def _meta(**change) -> str:
    import json

    meta = {"schedule": "1f1b", "pp": 2, "microbatches": 2, "virtual_stages": 1,
            "num_stages": 2, "points": [2], "placement": [[0], [1]]}
    meta.update(change)
    return json.dumps(meta)


def _timings(**change) -> str:
    import json

    rows = []
    for rank in (0, 1):
        for mb in (0, 1):
            for phase, start in (("forward", 0.0), ("backward", 1.0)):
                row = {"step": 1, "rank": rank, "stage": rank, "microbatch": mb,
                       "phase": phase, "start": start + mb + rank, "end": start + mb + rank + 0.5}
                row.update(change)
                rows.append(json.dumps(row))
    return "\n".join(rows) + "\n"


def _value(text):
    """Chart file shorthands: META:k=v (a valid pipeline.json with k changed), TIMINGS:k=v."""
    if not isinstance(text, str):
        return text
    for prefix, make in (("META:", _meta), ("TIMINGS:", _timings)):
        if text.startswith(prefix):
            head, _, rest = text[len(prefix):].partition("\n")
            change = {}
            if head:
                k, _, v = head.partition("=")
                change[k] = int(v) if v.lstrip("-").isdigit() else v
            return make(**change) + rest
    return text


# ------------------------------------------------------------------ the harness
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("token-cache")


@pytest.fixture
def refuse(tmp_path, cache_dir, capsys, monkeypatch):
    """Call ``meshfit ARGV`` in this process; return its one stderr line after checking the
    exit code, the line count and prefix, that the test's folder gained nothing and that no
    worker was started and os.environ is unchanged."""
    import torch.distributed.run as torchrun

    import meshfit.cli.main as cli
    from meshfit import launch
    from meshfit.train import trainer

    def started(*args, **kwargs):
        raise AssertionError(f"the input was accepted: it would have started {args}")

    monkeypatch.setattr(launch, "run", started)
    monkeypatch.setattr(trainer, "train", started)
    monkeypatch.setattr(torchrun, "run", started)
    monkeypatch.setattr(torchrun, "main", started)
    monkeypatch.setenv("MESHFIT_CPU", "1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    _write(tmp_path, FILES)
    # torch sets TORCHINDUCTOR_CACHE_DIR when torch._dynamo is first imported (refusing an
    # unusual compile mode imports it): imported here, so that only meshfit's own changes to
    # os.environ count below.
    import torch._dynamo  # noqa: F401

    def call(argv: list[str], extra: dict | None = None) -> str:
        _write(tmp_path, {k: _value(v) for k, v in (extra or {}).items()})
        argv = [a.format(t=tmp_path, c=cache_dir) for a in argv]
        before, env = _listing(tmp_path), dict(os.environ)
        capsys.readouterr()
        rc = cli.main(argv)
        captured = capsys.readouterr()
        assert dict(os.environ) == env, "main() changed os.environ"
        assert rc == 2, (rc, captured.out, captured.err)
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1, captured.err
        assert lines[0].startswith(f"meshfit {argv[0]}: error: "), lines[0]
        assert _listing(tmp_path) == before, "files were written"
        return lines[0]

    return call


def _check(line: str, wanted: list[str], tmp_path: Path) -> None:
    for w in wanted:
        w = w.format(t=tmp_path)
        assert w in line, f"{w!r} not in {line!r}"


def _train_argv(args: list[str]) -> list[str]:
    if "DROP_OUT" in args:
        return [TRAIN, *(a for a in args if a != "DROP_OUT")]
    return [TRAIN, "--out", "{t}/run", *args]


@pytest.mark.parametrize("args,wanted", [pytest.param(a, w, id=i) for i, a, w in T])
def test_train_override(args, wanted, refuse, tmp_path):
    _check(refuse(_train_argv(args)), wanted, tmp_path)


@pytest.mark.parametrize("text,args,wanted", [pytest.param(x, a, w, id=i) for i, x, a, w in TOML])
def test_train_toml(text, args, wanted, refuse, tmp_path):
    line = refuse(_train_argv(["--config", "{t}/run.toml", *args]), {"run.toml": text})
    _check(line, wanted, tmp_path)


@pytest.mark.parametrize("args,wanted", [pytest.param(a, w, id=i) for i, a, w in CONFIG_FILES])
def test_train_config_file(args, wanted, refuse, tmp_path):
    _check(refuse(_train_argv(args)), wanted, tmp_path)


@pytest.mark.parametrize("args,wanted", [pytest.param(a, w, id=i) for i, a, w in LAUNCH])
def test_launch(args, wanted, refuse, tmp_path):
    _check(refuse(["launch", *args]), wanted, tmp_path)


@pytest.mark.parametrize("args,files,wanted",
                         [pytest.param(a, f, w, id=i) for i, a, f, w in CHART])
def test_pipeline_chart(args, files, wanted, refuse, tmp_path):
    pytest.importorskip("matplotlib")
    _check(refuse(["pipeline-chart", *args], files), wanted, tmp_path)


@pytest.mark.parametrize("args,wanted", [pytest.param(a, w, id=i) for i, a, w in ARGPARSE])
def test_argument_parsers(args, wanted, refuse, tmp_path):
    _check(refuse(args), wanted, tmp_path)


@pytest.mark.parametrize("args,wanted", [pytest.param(a, w, id=i) for i, a, w in OTHER])
def test_other_commands(args, wanted, refuse, tmp_path):
    _check(refuse(args), wanted, tmp_path)


# ------------------------------------------------------------------ the run folder, the
# environment, the port: cases that need something set up around the call
LONG_NAME = "x" * 300
DEEP = "/".join(["y" * 200] * 25)
SURROUNDINGS = [  # (id, argv, setup, substrings)
    ("train --out is a file", ["train", "--nproc", "2", "--out", "{t}/small.txt"], None,
     ["--out=", "small.txt", "is a file"]),
    ("train --out is a file, one process", ["train", "--out", "{t}/small.txt"], None,
     ["--out=", "small.txt", "is a file"]),
    ("train --out under a file", ["train", "--nproc", "2", "--out", "{t}/small.txt/run"], None,
     ["--out=", "small.txt", "is a file"]),
    ("train --out name too long", ["train", "--out", "{t}/" + LONG_NAME], None,
     ["--out=", "300 bytes"]),
    ("train --out path too long", ["train", "--out", "{t}/" + DEEP], None,
     ["--out=", "bytes long"]),
    ("train --out read-only", ["train", "--out", "{t}/ro/run"], "read_only",
     ["--out=", "read-only file system"]),
    ("train --out holds a config", ["train", "--out", "{t}/oldcfg"], "old_config",
     ["--out=", "oldcfg", "already holds a run", "config.toml"]),
    ("train --out locked by a live run", ["train", "--out", "{t}/live"], "locked",
     ["--out=", "live", f"a run (PID {os.getpid()})"]),
    ("train --resume with --overwrite", ["train", "--out", "{t}/oldcfg", "--resume",
                                         "--overwrite"], "old_config", ["--resume", "--overwrite"]),
    ("train with inherited WORLD_SIZE and RANK", ["train", "--nproc", "1", "--out", "{t}/run"],
     "inherited_ranks", ["WORLD_SIZE=2", "RANK=0"]),
    ("train with inherited LOCAL_RANK", ["train", "--out", "{t}/run"], "local_rank",
     ["LOCAL_RANK=1"]),
    ("train --master-port in use", ["train", "--nproc", "2", "--master-port", "PORT", "--out",
                                    "{t}/run"], "port", ["--master-port=PORT", "not free"]),
    ("launch --master-port in use", ["launch", "--nproc", "2", "--master-port", "PORT",
                                     "{t}/script.py"], "port", ["--master-port=PORT", "not free"]),
]


@pytest.mark.parametrize("argv,setup,wanted",
                         [pytest.param(a, s, w, id=i) for i, a, s, w in SURROUNDINGS])
def test_surroundings(argv, setup, wanted, refuse, tmp_path, monkeypatch):
    import socket

    with contextlib.ExitStack() as stack:
        port = ""
        if setup == "read_only":
            _write(tmp_path, {"ro/": None})
            real = os.statvfs

            def statvfs(path):  # a read-only mount, which a test cannot make as root
                result = real(path)
                if Path(path) == tmp_path / "ro":
                    return os.statvfs_result((*result[:8], result.f_flag | os.ST_RDONLY,
                                              result.f_namemax))
                return result

            monkeypatch.setattr(os, "statvfs", statvfs)
        elif setup == "old_config":
            _write(tmp_path, {"oldcfg/config.toml": "[train]\nsteps = 3\n",
                              "oldcfg/metrics.jsonl": '{"step": 1, "loss": 5.4}\n'})
        elif setup == "locked":
            from meshfit.train.runfolder import RunLock

            (tmp_path / "live").mkdir()
            stack.enter_context(RunLock(tmp_path / "live", overwrite=False))
        elif setup == "inherited_ranks":
            monkeypatch.setenv("WORLD_SIZE", "2")
            monkeypatch.setenv("RANK", "0")
        elif setup == "local_rank":
            monkeypatch.setenv("LOCAL_RANK", "1")
        elif setup == "port":  # a listener of this test's own on loopback
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            port = str(sock.getsockname()[1])
        line = refuse([a.replace("PORT", port) for a in argv])
    _check(line, [w.replace("PORT", port) for w in wanted], tmp_path)


# ------------------------------------------------------------------ datasets on disk
HF_DATASETS = [  # (id, the dataset's columns, train arguments, substrings)
    ("hf_dataset without the text column", {"body": ["def f(x): return x"] * 50}, [],
     ["data.text_column='text'", "['body']"]),
    ("hf_dataset text column of numbers", {"text": list(range(50))}, [],
     ["data.text_column='text'", "int64"]),
    ("hf_dataset text column all empty", {"text": [""] * 5}, [],
     ["data.hf_dataset=", "no text", "5 rows"]),
    ("hf_dataset smaller than a global batch", {"text": ["ab"] * 5}, [],
     ["data.hf_dataset=", "0 training windows", "train.global_batch_size=32"]),
    ("hf_dataset with data.text_column of another row",
     {"text": ["def f(x): return x"] * 50, "id": list(range(50))}, ["--data.text_column=id"],
     ["data.text_column='id'", "int64"]),
]


@pytest.fixture(scope="module")
def hf_datasets(tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("hf-datasets")
    for name, columns, _, _ in HF_DATASETS:
        datasets.Dataset.from_dict(columns).save_to_disk(str(root / name.replace(" ", "_")))
    return root


@pytest.mark.parametrize("name,args,wanted",
                         [pytest.param(n, a, w, id=n) for n, _, a, w in HF_DATASETS])
def test_hf_dataset(name, args, wanted, hf_datasets, refuse, tmp_path):
    folder = hf_datasets / name.replace(" ", "_")
    line = refuse(_train_argv([f"--data.hf_dataset={folder}", "--data.cache_dir={c}", *args]))
    _check(line, wanted, tmp_path)


# ------------------------------------------------------------------ unreadable inputs
def _deny(monkeypatch, method: str, target: Path) -> None:
    """Path.`method` raises PermissionError for `target` and below (as chmod 000 would for a
    user who is not root; root reads through it, so the refusal is simulated)."""
    original = getattr(pathlib.Path, method)

    def denied(self, *args, **kwargs):
        if self == target or target in self.parents:
            raise PermissionError(13, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, method, denied)


def test_unreadable_corpus_file(refuse, tmp_path, cache_dir, monkeypatch):
    _write(tmp_path, {"locked/a.txt": TEXT + "locked"})
    _deny(monkeypatch, "read_bytes", tmp_path / "locked")
    line = refuse(_train_argv([f"--data.path={tmp_path / 'locked'}",
                               f"--data.cache_dir={cache_dir}"]))
    _check(line, ["data.path=", "locked", "a.txt", "Permission denied"], tmp_path)


def test_unlistable_corpus_folder(refuse, tmp_path, cache_dir, monkeypatch):
    _write(tmp_path, {"corpus/a.txt": TEXT, "corpus/sub/b.txt": TEXT})
    real = os.scandir

    def scandir(path="."):  # a folder without read permission, for a user who is not root
        if Path(path) == tmp_path / "corpus" / "sub":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    line = refuse(_train_argv([f"--data.path={tmp_path / 'corpus'}",  # enough without sub/
                               f"--data.cache_dir={cache_dir}", "--train.seq_len=16",
                               "--train.micro_batch_size=2", "--train.global_batch_size=4"]))
    _check(line, ["data.path=", "cannot list", "sub", "Permission denied"], tmp_path)


def test_unreadable_config_file(refuse, tmp_path, monkeypatch):
    _write(tmp_path, {"locked.toml": "[train]\nsteps = 3\n"})
    _deny(monkeypatch, "read_bytes", tmp_path / "locked.toml")
    line = refuse(_train_argv(["--config", str(tmp_path / "locked.toml")]))
    _check(line, ["--config=", "locked.toml", "cannot be read", "Permission denied"], tmp_path)


# ------------------------------------------------------------------ Accelerator keywords
def _acc_cases():
    from meshfit.accelerator.compat import GradientAccumulationPlugin
    from meshfit.distributed import ParallelDims

    return [
        ("gradient_accumulation_steps=0", dict(gradient_accumulation_steps=0),
         ["gradient_accumulation_steps=0"]),
        ("gradient_accumulation_steps float", dict(gradient_accumulation_steps=1.5),
         ["gradient_accumulation_steps=1.5"]),
        ("gradient_accumulation_steps bool", dict(gradient_accumulation_steps=True),
         ["gradient_accumulation_steps=True"]),
        ("empty_cache_steps negative", dict(empty_cache_steps=-1), ["empty_cache_steps=-1"]),
        ("tf32 string", dict(tf32="yes"), ["tf32='yes'"]),
        ("mixed_precision enum", dict(mixed_precision="fp4"), ["mixed_precision", "fp4"]),
        ("activation_checkpointing enum", dict(activation_checkpointing="half"),
         ["activation_checkpointing", "half"]),
        ("activation_checkpointing_every=0", dict(activation_checkpointing_every=0),
         ["activation_checkpointing_every", "0"]),
        ("activation_checkpointing_policy enum", dict(activation_checkpointing_policy="x"),
         ["activation_checkpointing_policy", "'x'"]),
        ("compile_scope enum", dict(compile_scope="layer"), ["compile_scope", "layer"]),
        ("compile_backend unknown", dict(compile=True, compile_backend="nope"),
         ["compile_backend", "nope"]),
        ("compile string", dict(compile="yes"), ["compile", "yes"]),
        ("zero_stage=5", dict(zero_stage=5), ["zero_stage=5"]),
        ("offload enum", dict(offload="disk"), ["offload", "disk"]),
        ("sync_each_batch enum", dict(sync_each_batch="sometimes"),
         ["sync_each_batch", "sometimes"]),
        ("sequence_parallel string", dict(sequence_parallel="yes"),
         ["sequence_parallel", "yes"]),
        ("loss_parallel int", dict(loss_parallel=1), ["loss_parallel", "1"]),
        ("parallel wrong type", dict(parallel="dp"), ["parallel", "'dp'"]),
        ("parallel larger than the world", dict(parallel=ParallelDims(tp=2)), ["tp", "2"]),
        ("rng_types unknown", dict(rng_types=["numpy"]), ["rng_types", "numpy"]),
        ("step_scheduler_with_optimizer string", dict(step_scheduler_with_optimizer="yes"),
         ["step_scheduler_with_optimizer"]),
        ("deepspeed_plugin", dict(deepspeed_plugin=object()), ["deepspeed_plugin"]),
        ("device_placement string", dict(device_placement="no"), ["device_placement", "'no'"]),
        ("cpu string", dict(cpu="yes"), ["cpu", "'yes'"]),
        ("log_with object", dict(log_with=[5]), ["log_with", "5"]),
        ("dataloader_config dict", dict(dataloader_config={"even_batches": False}),
         ["dataloader_config", "DataLoaderConfiguration"]),
        ("accumulation twice", dict(gradient_accumulation_steps=2,
                                    gradient_accumulation_plugin=GradientAccumulationPlugin(
                                        num_steps=2)),
         ["gradient_accumulation_steps", "gradient_accumulation_plugin"]),
        ("fsdp_plugin wrong type", dict(fsdp_plugin="full"), ["fsdp_plugin"]),
        ("ddp_kwargs wrong type", dict(ddp_kwargs=["find_unused_parameters"]),
         ["ddp_kwargs", "find_unused_parameters"]),
        ("kwargs_handlers wrong object", dict(kwargs_handlers=[5]), ["kwargs_handlers", "5"]),
        ("project_dir int", dict(project_dir=5), ["project_dir", "5"]),
    ]


ACCELERATOR = _acc_cases()


@pytest.mark.parametrize("name,kwargs,wanted", [pytest.param(*c, id=c[0]) for c in ACCELERATOR])
def test_accelerator_keywords(name, kwargs, wanted, monkeypatch):
    from meshfit import Accelerator

    monkeypatch.setenv("MESHFIT_CPU", "1")
    import torch._dynamo  # noqa: F401  (sets TORCHINDUCTOR_CACHE_DIR once; not meshfit's doing)

    env = dict(os.environ)
    # Accelerate raises TypeError for a wrong fsdp_plugin; meshfit keeps its exception.
    with pytest.raises(TypeError if "fsdp_plugin" in kwargs else ValueError) as err:
        Accelerator(**kwargs)
    message = str(err.value)
    assert "\n" not in message, message
    for w in wanted:
        assert w in message, f"{name}: {w!r} not in {message!r}"
    assert dict(os.environ) == env
    assert not torch.distributed.is_initialized()


MISUSE = [  # (id, what is done with a single-process Accelerator, substrings)
    ("prepare_pipeline without a pp axis",
     lambda acc, tmp: acc.prepare_pipeline(torch.nn.Linear(2, 2), microbatches=2),
     ["prepare_pipeline", "pp=P"]),
    ("gradient_accumulation_steps set to 0",
     lambda acc, tmp: setattr(acc, "gradient_accumulation_steps", 0),
     ["gradient_accumulation_steps=0"]),
    ("reduce with an unknown operation", lambda acc, tmp: acc.reduce(torch.ones(1), "median"),
     ["'median'", "sum, mean, min, max"]),
    ("load_state of a missing folder", lambda acc, tmp: acc.load_state(str(tmp / "no_ckpt")),
     ["load_state", "no_ckpt", "is not a folder"]),
    ("save_model to a file", lambda acc, tmp: acc.save_model(
        acc.prepare(torch.nn.Linear(2, 2)), _blocker(tmp)), ["save_model", "afile", "is a file"]),
    ("save_model under a file", lambda acc, tmp: acc.save_model(
        acc.prepare(torch.nn.Linear(2, 2)), _blocker(tmp) / "model"),
     ["save_model", "afile/model", "is a file"]),
]


def _blocker(tmp: Path) -> Path:
    """A file where a folder is wanted (the only thing a misuse case may leave behind)."""
    (tmp / "afile").write_text("mine\n")
    return tmp / "afile"


@pytest.mark.parametrize("do,wanted", [pytest.param(d, w, id=i) for i, d, w in MISUSE])
def test_accelerator_misuse(do, wanted, tmp_path, monkeypatch):
    from meshfit import Accelerator

    monkeypatch.setenv("MESHFIT_CPU", "1")
    acc = Accelerator()
    with pytest.raises(ValueError) as err:
        do(acc, tmp_path)
    message = str(err.value)
    assert "\n" not in message, message
    for w in wanted:
        assert w in message, f"{w!r} not in {message!r}"
    left = {p.name: p for p in tmp_path.iterdir()}
    assert set(left) <= {"afile"}, left
    assert "afile" not in left or left["afile"].read_text() == "mine\n"


# ------------------------------------------------------------------ still to be fixed
# Bad inputs whose refusal lives in files this catalogue does not fix; each entry says who
# must fix what, and is moved into the catalogue above once it gives one line. Not tests.
PENDING_OTHERS: list = []
"""(id, argv, substrings, who must fix what, what happens now) per case; empty now: the
argument parsers' errors (a bad number, a missing or unknown argument), listed here while
they printed the usage block too, are one line and moved to ARGPARSE above."""


def test_catalogue_size():
    """Issue 16 asks for at least 100 bad inputs."""
    count = (len(T) + len(TOML) + len(CONFIG_FILES) + len(LAUNCH) + len(CHART) + len(OTHER)
             + len(ARGPARSE) + len(SURROUNDINGS) + len(HF_DATASETS) + 3 + len(ACCELERATOR)
             + len(MISUSE))
    assert count >= 110, count


# ------------------------------------------------------------------ the trainer's own guard
def test_batch_stream_raises_after_two_empty_passes():
    """Where the preflight check is bypassed (`train` called directly), an epoch without a
    batch raises instead of looping forever; one empty pass (resumed at an epoch's end) is
    allowed."""
    from meshfit.train.trainer import _batches

    class Empty:  # fails the test where the old stream would spin forever
        passes = 0

        def __iter__(self):
            self.passes += 1
            assert self.passes < 100, "the batch stream spins on an empty loader"
            return iter([])

    with pytest.raises(ValueError, match="the loader X yields no batch"):
        next(_batches(Empty(), "the loader X"))

    class FirstPassEmpty:
        passes = 0

        def __iter__(self):
            self.passes += 1
            return iter([] if self.passes == 1 else [1, 2])

    stream = _batches(FirstPassEmpty())
    assert [next(stream) for _ in range(3)] == [1, 2, 1]


def test_train_with_a_batch_larger_than_the_data_stops(tmp_path, cache_dir, monkeypatch):
    """The hang of issue 16 (a micro-batch larger than the data: the batch generator spun on
    an empty loader), reproduced through `train` itself, which skips the CLI's preflight:
    it now ends in a ValueError naming the numbers."""
    from meshfit.train.configfile import build_config
    from meshfit.train.trainer import train

    from meshfit.accelerator.loader import PreparedDataLoader

    passes = []
    original = PreparedDataLoader.__iter__

    def counted(self):  # fails the test where the old stream would spin forever
        passes.append(1)
        assert len(passes) < 100, "the batch stream spins on an empty loader"
        return original(self)

    monkeypatch.setattr(PreparedDataLoader, "__iter__", counted)
    (tmp_path / "a.txt").write_text(TEXT)  # 1,060 training tokens: 66 windows of 16
    cfg = build_config({
        "data": {"path": str(tmp_path / "a.txt"), "cache_dir": str(cache_dir)},
        "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "d_ff": 64},
        "train": {"seq_len": 16, "micro_batch_size": 128, "global_batch_size": 128,
                  "steps": 2, "eval_batches": 1, "warmup_steps": 0}})
    with pytest.raises(ValueError, match=r"66 windows of train.seq_len=16 tokens, batches of "
                                         r"128 per rank.* yields no batch"):
        train(cfg, tmp_path / "run")
