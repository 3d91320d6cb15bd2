"""What plain Trainer cannot do: meshfit's layouts by one argument,
``TrainingArguments(parallel=...)``, and transformers' own ``fsdp=`` / ``deepspeed=`` read as
meshfit's ZeRO stages; TRL's SFTTrainer under ZeRO-3 and tp. Meshfit-only (run on 2 processes
by the test's meshfit launch); the test compares each with transformers' (TRL's) own trainer
on the same batches: the data-parallel layouts with its DDP run on 2 processes, tp and cp (one
data-parallel rank) with its run on 1.
"""

from meshfit.transformers import SFTConfig, SFTTrainer, Trainer, TrainingArguments

import sft
from snippets import COMMON, model, result, rows

CASES = {
    "zero1": dict(parallel="dp_shard=2,zero_stage=1"),
    "zero2": dict(parallel="dp_shard=2,zero_stage=2"),
    "zero3": dict(parallel="dp_shard=2,zero_stage=3", save_strategy="steps", save_steps=2,
                  save_only_model=True),
    "cpu_offload": dict(parallel="dp_shard=2,zero_stage=3,offload=cpu"),
    "disk_offload": dict(parallel="dp_shard=2,zero_stage=3,offload=disk"),
    "tp_sp": dict(parallel="tp=2,sequence_parallel=true", save_strategy="steps",
                  save_steps=2, save_only_model=True),
    "cp": dict(parallel="cp=2"),
    "auto": dict(parallel="auto"),
    "fsdp": dict(fsdp="full_shard", fsdp_config={"reshard_after_forward": False}),
    "deepspeed": dict(deepspeed={"zero_optimization": {"stage": 3}}),
    # TRL's SFTTrainer (completion-only loss) on meshfit's layouts
    "sft_zero3": dict(parallel="dp_shard=2,zero_stage=3"),
    "sft_tp": dict(parallel="tp=2"),
}


def run(case: str, out: str) -> dict:
    if case.startswith("sft_"):
        job = sft.trainer("sft_completion_only", out, config=SFTConfig,
                          trainer_class=SFTTrainer, **CASES[case])
        job.train()
        return {**result(job), "layout": job.accelerator.layout.request.describe()}
    args = TrainingArguments(output_dir=out, **{**COMMON, **CASES[case]})
    job = Trainer(model=model(), args=args, train_dataset=rows(32, 1))
    job.train()
    got = result(job)
    got["layout"] = job.accelerator.layout.request.describe()
    if args.save_only_model:  # the model saved whole from its shards (on every process)
        job.save_model(out + "/final")
        got["saved"] = _saved(out + "/final") if job.accelerator.is_main_process else None
    return got


def _saved(folder: str) -> dict:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(folder + "/model.safetensors").items()}
