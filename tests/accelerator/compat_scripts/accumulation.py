"""Gradient accumulation, in the style of Accelerate's ``by_feature/gradient_accumulation.py``:
a tiny classifier from a config, data made on the fly, shuffled batches, AdamW with a linear
warm-up schedule, gradient clipping on the synchronising micro-batches, two epochs whose
batches do not divide by the accumulation steps (the last micro-batch of each epoch steps the
optimizer). A second run configures accumulation with a GradientAccumulationPlugin that
does not step at the end of the data loader, so windows span epochs.

Run alone: ``python accumulation.py`` (one process) or under a launcher."""

import argparse

import torch
from torch.utils.data import DataLoader

from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, set_seed
from common import RandomClassification, TinyClassifier, TinyConfig, linear_warmup, parameters

CONFIG = {"lr": 3e-2, "num_epochs": 2, "seed": 42, "batch_size": 4, "n_train": 50,
          "gradient_accumulation_steps": 3, "max_grad_norm": 1.0}


def run(accelerator, config):
    set_seed(config["seed"])
    train_dataloader = DataLoader(RandomClassification(config["n_train"], TinyConfig()),
                                  batch_size=config["batch_size"], shuffle=True)
    model = TinyClassifier(TinyConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    steps = config["num_epochs"] * len(train_dataloader)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup(3, steps))
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    record = {"loss": [], "gathered_loss": [], "sync": [], "lr": [], "norm": [], "seen": []}
    for epoch in range(config["num_epochs"]):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                outputs = model(x=batch["x"], labels=batch["labels"])
                loss = outputs["loss"]
                # gathered before backward: a tensor that requires grad
                record["gathered_loss"].append(accelerator.gather(loss))
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), config["max_grad_norm"])
                    record["norm"].append(float(norm))
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            record["loss"].append(loss.item())
            record["sync"].append(accelerator.sync_gradients)
            record["lr"].append(lr_scheduler.get_last_lr()[0])
            record["seen"].append(batch["index"].tolist())
    record["params"] = parameters(accelerator.unwrap_model(model))
    return record


def training_function(config, args):
    results = {}
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=config["gradient_accumulation_steps"])
    results["steps"] = run(accelerator, config)
    plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_plugin=plugin)
    results["plugin"] = run(accelerator, config)
    return results


def main():
    parser = argparse.ArgumentParser(description="Gradient accumulation on a tiny model.")
    parser.add_argument("--mixed_precision", type=str, default=None,
                        choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU only")
    args = parser.parse_args()
    print(training_function(dict(CONFIG), args)["steps"]["loss"][-1])


if __name__ == "__main__":
    main()
