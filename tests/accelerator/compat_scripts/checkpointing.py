"""Checkpoints and resuming, in the style of Accelerate's ``by_feature/checkpointing.py``:
``save_state`` every few steps and at the end of each epoch (with a registered object of
the script's own), then a fresh run that ``load_state``s a checkpoint, skips the batches the
checkpointed run had consumed in its epoch (``skip_first_batches``) and trains to the end.
Also automatically named checkpoints (``ProjectConfiguration``): the newest ``total_limit``
kept, ``load_state()`` picks the newest."""

import argparse
import os

import torch
from torch.utils.data import DataLoader

from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from common import RandomClassification, TinyClassifier, TinyConfig, linear_warmup, parameters

CONFIG = {"lr": 2e-2, "num_epochs": 2, "seed": 3, "batch_size": 4, "n_train": 44,
          "checkpointing_steps": 4}


class RunningMean:
    """The script's own state, saved with the checkpoint (register_for_checkpointing)."""

    def __init__(self):
        self.total, self.count = 0.0, 0

    def update(self, value: float) -> None:
        self.total, self.count = self.total + value, self.count + 1

    def state_dict(self) -> dict:
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.count = float(state["total"]), int(state["count"])


def train(config, args, resume_from_checkpoint=None):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(config["seed"])
    train_dataloader = DataLoader(RandomClassification(config["n_train"], TinyConfig()),
                                  batch_size=config["batch_size"], shuffle=True)
    model = TinyClassifier(TinyConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    steps = config["num_epochs"] * len(train_dataloader)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup(2, steps))
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    meter = RunningMean()
    accelerator.register_for_checkpointing(meter)
    overall_step, starting_epoch, resume_step = 0, 0, None
    if resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {resume_from_checkpoint}")
        accelerator.load_state(resume_from_checkpoint)
        training_difference = os.path.splitext(os.path.basename(resume_from_checkpoint))[0]
        if "epoch" in training_difference:
            starting_epoch = int(training_difference.replace("epoch_", "")) + 1
        else:
            resume_step = int(training_difference.replace("step_", ""))
            starting_epoch = resume_step // len(train_dataloader)
            resume_step -= starting_epoch * len(train_dataloader)
        overall_step = starting_epoch * len(train_dataloader)
    record = {"loss": [], "lr": [], "seen": []}
    for epoch in range(starting_epoch, config["num_epochs"]):
        model.train()
        if resume_step is not None and epoch == starting_epoch:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            overall_step += resume_step
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            outputs = model(x=batch["x"], labels=batch["labels"])
            accelerator.backward(outputs["loss"])
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            meter.update(outputs["loss"].item())
            overall_step += 1
            record["loss"].append(outputs["loss"].item())
            record["lr"].append(lr_scheduler.get_last_lr()[0])
            record["seen"].append(batch["index"].tolist())
            if resume_from_checkpoint is None and overall_step % config["checkpointing_steps"] == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))
        if resume_from_checkpoint is None:
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
    record["meter"] = meter.state_dict()
    record["params"] = parameters(accelerator.unwrap_model(model))
    record["rng"] = torch.randint(0, 10**6, (3,)).tolist()  # the generators, restored too
    return record


def automatic_naming(config, args):
    project_dir = os.path.join(args.output_dir, "auto")
    accelerator = Accelerator(cpu=args.cpu, project_config=ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2))
    set_seed(config["seed"])
    model = accelerator.prepare(TinyClassifier(TinyConfig()))
    saved = []
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        accelerator.save_state()
        saved.append(parameters(accelerator.unwrap_model(model)))
    accelerator.wait_for_everyone()
    folders = sorted(os.listdir(os.path.join(project_dir, "checkpoints")))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state()
    loaded = parameters(accelerator.unwrap_model(model))
    return {"folders": folders, "iteration": accelerator.save_iteration,
            "loaded_last": all(torch.equal(loaded[k], saved[-1][k]) for k in loaded)}


def training_function(config, args):
    results = {"full": train(config, args)}
    accelerator = Accelerator(cpu=args.cpu)
    accelerator.wait_for_everyone()  # every checkpoint is on disk
    for name, step in (("from_step", 1), ("from_step_2", 2)):  # 2 processes: 2nd epoch
        folder = os.path.join(args.output_dir, f"step_{step * config['checkpointing_steps']}")
        results[name] = train(config, args, folder)
    results["from_epoch"] = train(config, args, os.path.join(args.output_dir, "epoch_0"))
    results["automatic"] = automatic_naming(config, args)
    return results


def main():
    parser = argparse.ArgumentParser(description="Checkpoints and resuming.")
    parser.add_argument("--mixed_precision", type=str, default=None,
                        choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU only")
    parser.add_argument("--output_dir", type=str, default=".")
    args = parser.parse_args()
    training_function(dict(CONFIG), args)


if __name__ == "__main__":
    main()
