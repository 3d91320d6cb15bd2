"""Learning-rate schedules with a prepared scheduler, in the style of Accelerate's
``cv_example.py`` (OneCycleLR sized by ``len(train_dataloader)``) and ``nlp_example.py``
(linear warm-up): the scheduler steps with the optimizer (once per process per optimizer
step unless batches are split), on every call with ``step_scheduler_with_optimizer=False``,
and once per step with ``split_batches=True``. The training loader shuffles with a
generator of its own."""

import argparse

import torch
from torch.utils.data import DataLoader

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from common import RandomClassification, TinyClassifier, TinyConfig, linear_warmup, parameters

CONFIG = {"lr": 1e-2, "num_epochs": 2, "seed": 11, "batch_size": 4, "n_train": 36,
          "gradient_accumulation_steps": 2}


def run(accelerator, config, kind):
    set_seed(config["seed"])
    generator = torch.Generator().manual_seed(config["seed"] + 1)
    train_dataloader = DataLoader(RandomClassification(config["n_train"], TinyConfig()),
                                  batch_size=config["batch_size"], shuffle=True,
                                  generator=generator)
    model = TinyClassifier(TinyConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    if kind == "onecycle":
        lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=config["lr"], epochs=config["num_epochs"],
            steps_per_epoch=len(train_dataloader))
    else:
        steps = config["num_epochs"] * len(train_dataloader)
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup(4, steps))
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    record = {"lr": [], "loss": [], "seen": []}
    for epoch in range(config["num_epochs"]):
        model.train()
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                outputs = model(x=batch["x"], labels=batch["labels"])
                accelerator.backward(outputs["loss"])
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            record["lr"].append(lr_scheduler.get_last_lr()[0])
            record["loss"].append(outputs["loss"].item())
            record["seen"].append(batch["index"].tolist())
    record["skipped"] = accelerator.optimizer_step_was_skipped
    record["params"] = parameters(accelerator.unwrap_model(model))
    return record


def training_function(config, args):
    results = {}
    k = config["gradient_accumulation_steps"]
    for kind in ("linear", "onecycle", "every_call", "split_batches"):
        accelerator = Accelerator(
            cpu=args.cpu, mixed_precision=args.mixed_precision, gradient_accumulation_steps=k,
            step_scheduler_with_optimizer=kind != "every_call",
            dataloader_config=DataLoaderConfiguration(split_batches=kind == "split_batches"))
        results[kind] = run(accelerator, config, kind)
    return results


def main():
    parser = argparse.ArgumentParser(description="Learning-rate schedules.")
    parser.add_argument("--mixed_precision", type=str, default=None,
                        choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU only")
    args = parser.parse_args()
    training_function(dict(CONFIG), args)


if __name__ == "__main__":
    main()
