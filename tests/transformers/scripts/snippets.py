"""The single-GPU guide's techniques, each a `TrainingArguments(...)` + `Trainer(...)`
snippet, written for transformers (``from transformers import Trainer, TrainingArguments``);
under meshfit the test suite changes that one import (`driver.py`). Tiny Llama built from a
config (no downloads), random tokens, 4 optimizer steps, fp32 unless the snippet says.

`run(case, out)` returns what the test compares: every logged row (losses, gradient norms,
learning rates, evaluation losses) and the final parameters.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers import Trainer, TrainingArguments

COMMON = dict(per_device_train_batch_size=4, max_steps=4, logging_steps=1, report_to="none",
              use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
              optim="adamw_torch")
CASES = {
    "fp32": dict(),
    "batch_size": dict(per_device_train_batch_size=2),
    "accumulation": dict(gradient_accumulation_steps=2),
    "checkpointing": dict(gradient_checkpointing=True),
    "bf16": dict(bf16=True),
    "fp16": dict(fp16=True),
    "adamw_torch_fused": dict(optim="adamw_torch_fused"),
    "adafactor": dict(optim="adafactor"),
    "adamw_bnb_8bit": dict(optim="adamw_bnb_8bit"),
    "custom_optimizer": dict(),
    "compile": dict(torch_compile=True, torch_compile_backend="aot_eager"),
    "evaluation": dict(eval_strategy="steps", eval_steps=2, logging_steps=2,
                       per_device_eval_batch_size=4),
    "resume": dict(save_strategy="steps", save_steps=2),
}
KEYS = ("loss", "grad_norm", "learning_rate", "eval_loss", "step")


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    return LlamaForCausalLM(config)


def rows(n: int, seed: int) -> list:
    tokens = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": t, "labels": t} for t in tokens]


def result(trainer) -> dict:
    log = [{k: v for k, v in row.items() if k in KEYS} for row in trainer.state.log_history]
    # (sharded layouts hold DTensors: each whole, a collective every process takes part in)
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
              for k, v in trainer.model.state_dict().items()}
    return {"log": log, "params": params}


def trainer(case: str, out: str, **extra) -> Trainer:
    args = TrainingArguments(output_dir=out, **{**COMMON, **CASES[case], **extra})
    net = model()
    optimizers = (None, None)
    if case == "custom_optimizer":
        sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        optimizers = (sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda s: 1 / (1 + s)))
    return Trainer(model=net, args=args, train_dataset=rows(32, 1),
                   eval_dataset=rows(12, 2) if "eval_strategy" in CASES[case] else None,
                   optimizers=optimizers)


def run(case: str, out: str) -> dict:
    if case != "resume":
        job = trainer(case, out)
        job.train()
        return result(job)
    whole = trainer(case, out)
    whole.train()
    # A second job from the checkpoint of step 2 (as a restarted script would).
    again = trainer(case, out + "-resumed")
    again.train(resume_from_checkpoint=f"{out}/checkpoint-2")
    return {"whole": result(whole), "resumed": result(again)}
