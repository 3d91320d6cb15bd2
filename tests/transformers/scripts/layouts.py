"""What plain Trainer cannot do: meshfit's layouts by one argument,
``TrainingArguments(parallel=...)``, and transformers' own ``fsdp=`` / ``deepspeed=`` read as
meshfit's ZeRO stages; TRL's SFTTrainer under ZeRO-3 and tp. Meshfit-only (run on 2 processes
by the test's meshfit launch); the test compares each with transformers' (TRL's) own trainer
on the same batches: the data-parallel layouts with its DDP run on 2 processes, tp and cp (one
data-parallel rank) with its run on 1. The ``resume_<layout>`` cases stop a run at step 2
and resume it in a new Trainer (`resumed`); the test compares them with ``<layout>``'s
uninterrupted run.
"""

import os

from transformers import TrainerCallback

from meshfit.transformers import SFTConfig, SFTTrainer, Trainer, TrainingArguments

import sft
from snippets import COMMON, model, result, rows

CASES = {
    "zero1": dict(parallel="dp_shard=2,zero_stage=1"),
    "zero2": dict(parallel="dp_shard=2,zero_stage=2", save_strategy="steps", save_steps=2,
                  save_only_model=True),
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
# load_best_model_at_end under ZeRO-3: the best checkpoint (step 2: the evaluation loss is
# lower there than at step 4) loaded back into the shards at the end.
CASES["best_zero3"] = dict(parallel="dp_shard=2,zero_stage=3", save_strategy="steps",
                           save_steps=2, eval_strategy="steps", eval_steps=2,
                           load_best_model_at_end=True, metric_for_best_model="loss",
                           per_device_eval_batch_size=4)
# Checkpoints with the optimizer state (transformers' default, save_only_model=False) on
# sharded layouts, resumed: each the layout of the case of the same name without "resume_".
RESUMED = ("zero3", "tp_sp", "disk_offload")
CASES.update({f"resume_{case}": dict(parallel=CASES[case]["parallel"]) for case in RESUMED})


def run(case: str, out: str) -> dict:
    if case.startswith("resume_"):
        return resumed(case, out)
    if case.startswith("sft_"):
        job = sft.trainer("sft_completion_only", out, config=SFTConfig,
                          trainer_class=SFTTrainer, **CASES[case])
        job.train()
        return {**result(job), "layout": job.accelerator.layout.request.describe()}
    args = TrainingArguments(output_dir=out, **{**COMMON, **CASES[case]})
    job = Trainer(model=model(), args=args, train_dataset=rows(32, 1),
                  eval_dataset=rows(12, 2) if args.load_best_model_at_end else None)
    job.train()
    got = result(job)
    got["layout"] = job.accelerator.layout.request.describe()
    if args.load_best_model_at_end:  # the weights the best checkpoint holds (process 0 reads)
        best = job.state.best_model_checkpoint
        got["best"] = (os.path.basename(best), _saved(best)) \
            if job.accelerator.is_main_process else None
    if args.save_only_model:  # the model saved whole from its shards (on every process)
        job.save_model(out + "/final")
        got["saved"] = _saved(out + "/final") if job.accelerator.is_main_process else None
    return got


def _saved(folder: str) -> dict:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(folder + "/model.safetensors").items()}


class StopAt(TrainerCallback):
    """Ends training after step `step` (as a job that was stopped there)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def resumed(case: str, out: str) -> dict:
    """Trained to step 2 (of 4) with a checkpoint every 2 steps, the newest kept
    (``save_total_limit=1``), then resumed by a new Trainer with ``resume_from_checkpoint=True``
    (the newest ``checkpoint-<step>`` in ``output_dir``), as a restarted script would; its
    checkpoint at step 4 replaces the one it resumed from."""
    args = {**COMMON, **CASES[case], "output_dir": out, "save_strategy": "steps",
            "save_steps": 2, "save_total_limit": 1}
    first = Trainer(model=model(), args=TrainingArguments(**args), train_dataset=rows(32, 1),
                    callbacks=[StopAt(2)])
    first.train()
    # The stopped job's end, in this process: what it holds goes (offload="disk": its state
    # files and the lock on <output_dir>/offload, which a second live Trainer is refused).
    first.accelerator.free_memory()
    again = Trainer(model=model(), args=TrainingArguments(**args), train_dataset=rows(32, 1))
    again.train(resume_from_checkpoint=True)
    again.accelerator.wait_for_everyone()  # (process 0 rotates after the others wrote)
    main = again.accelerator.is_main_process
    kept = sorted(f for f in os.listdir(out) if f.startswith("checkpoint-")) if main else None
    files = sorted(os.listdir(f"{out}/checkpoint-4")) if main else None
    return {**result(again), "layout": again.accelerator.layout.request.describe(),
            "kept": kept, "files": files}
