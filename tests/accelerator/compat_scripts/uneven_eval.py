"""Evaluation on a dataset that does not divide by the global batch, in the style of
Accelerate's ``by_feature/multi_process_metrics.py``: predictions and references are
gathered with ``gather_for_metrics`` (the samples that completed the last round are dropped
there), also as Python objects (``use_gather_object``), and the accuracy is computed on
exactly the evaluation set. The training loader is uneven too (even_batches pads it)."""

import argparse

import torch
from torch.utils.data import DataLoader

from accelerate import Accelerator
from accelerate.utils import set_seed
from common import RandomClassification, TinyClassifier, TinyConfig, parameters

CONFIG = {"lr": 5e-2, "num_epochs": 2, "seed": 7, "batch_size": 4, "eval_batch_size": 5,
          "n_train": 30, "n_eval": 23}


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    set_seed(config["seed"])
    train_dataloader = DataLoader(RandomClassification(config["n_train"], TinyConfig()),
                                  batch_size=config["batch_size"], shuffle=True)
    eval_dataloader = DataLoader(RandomClassification(config["n_eval"], TinyConfig(), seed=3),
                                 batch_size=config["eval_batch_size"], shuffle=False)
    model = TinyClassifier(TinyConfig())
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader)
    record = {"loss": [], "seen": [], "eval": [], "len": (len(train_dataloader),
                                                         len(eval_dataloader))}
    for epoch in range(config["num_epochs"]):
        model.train()
        for batch in train_dataloader:
            outputs = model(x=batch["x"], labels=batch["labels"])
            accelerator.backward(outputs["loss"])
            optimizer.step()
            optimizer.zero_grad()
            record["loss"].append(outputs["loss"].item())
            record["seen"].append(batch["index"].tolist())
        model.eval()
        correct, total, samples = 0, 0, []
        gathered_objects, remainders = [], []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(x=batch["x"])
            predictions = outputs["logits"].argmax(dim=-1)
            predictions, references, index = accelerator.gather_for_metrics(
                (predictions, batch["labels"], batch["index"]))
            correct += (predictions == references).sum().item()
            total += references.numel()
            samples += index.tolist()
            names = [f"sample-{i}" for i in batch["index"].tolist()]
            gathered_objects += accelerator.gather_for_metrics(names)
            logits = accelerator.gather_for_metrics(outputs["logits"], use_gather_object=True)
            remainders.append((accelerator.gradient_state.end_of_dataloader,
                               accelerator.gradient_state.remainder, len(logits)))
        record["eval"].append({"accuracy": correct / total, "total": total, "samples": samples,
                               "objects": gathered_objects, "remainders": remainders})
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.3f}")
    record["params"] = parameters(accelerator.unwrap_model(model))
    return record


def main():
    parser = argparse.ArgumentParser(description="Metrics over an uneven evaluation set.")
    parser.add_argument("--mixed_precision", type=str, default=None,
                        choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU only")
    args = parser.parse_args()
    training_function(dict(CONFIG), args)


if __name__ == "__main__":
    main()
