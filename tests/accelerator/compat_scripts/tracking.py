"""Experiment tracking, in the style of Accelerate's ``by_feature/tracking.py``: TensorBoard
through ``log_with``, the run's configuration recorded by ``init_trackers``, the training
loss per step and the accuracy per epoch through ``accelerator.log`` (main process only),
the SummaryWriter itself through ``get_tracker(..., unwrap=True)``, and ``end_training``.
The event files are read back and returned. (``end_training`` releases the process group:
this script runs last.)"""

import argparse
import os

import torch
from torch.utils.data import DataLoader

from accelerate import Accelerator
from accelerate.utils import LoggerType, set_seed
from common import RandomClassification, TinyClassifier, TinyConfig

CONFIG = {"lr": 3e-2, "num_epochs": 2, "seed": 17, "batch_size": 4, "n_train": 28,
          "n_eval": 11}


def read_events(folder):
    """{scalar tag: [(step, value)]} and the hyper-parameters recorded, from every event file
    under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    scalars, hparams = {}, {}
    for root, _, files in os.walk(folder):
        if not any(f.startswith("events.out.tfevents") for f in files):
            continue
        events = EventAccumulator(root)
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(tag))
        try:
            contents = events.PluginTagToContent("hparams").values()
        except KeyError:  # an event file without hyper-parameters
            contents = []
        for content in contents:
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
            for name, value in data.session_start_info.hparams.items():
                hparams[name] = value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind"))
    return {tag: sorted(values) for tag, values in scalars.items()}, hparams


def training_function(config, args):
    project_dir = os.path.join(args.output_dir, "tracking")
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              log_with=LoggerType.TENSORBOARD, project_dir=project_dir)
    set_seed(config["seed"])
    train_dataloader = DataLoader(RandomClassification(config["n_train"], TinyConfig()),
                                  batch_size=config["batch_size"], shuffle=True)
    eval_dataloader = DataLoader(RandomClassification(config["n_eval"], TinyConfig(), seed=5),
                                 batch_size=config["batch_size"])
    model = TinyClassifier(TinyConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader)
    accelerator.init_trackers("compat_run", {k: v for k, v in config.items()})
    overall_step = 0
    for epoch in range(config["num_epochs"]):
        model.train()
        total_loss = 0.0
        for batch in train_dataloader:
            outputs = model(x=batch["x"], labels=batch["labels"])
            loss = outputs["loss"]
            total_loss += loss.detach().float()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log({"train_loss": loss.item()}, step=overall_step)
            overall_step += 1
        model.eval()
        correct = total = 0
        for batch in eval_dataloader:
            with torch.no_grad():
                predictions = model(x=batch["x"])["logits"].argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics(
                (predictions, batch["labels"]))
            correct += (predictions == references).sum().item()
            total += references.numel()
        accelerator.log({"accuracy": correct / total, "epoch_loss": total_loss.item() /
                         len(train_dataloader), "epoch": epoch}, step=epoch)
    if accelerator.is_main_process:
        writer = accelerator.get_tracker("tensorboard", unwrap=True)
        writer.add_scalar("from_the_writer", 1.5, 0)
    accelerator.end_training()
    if accelerator.is_main_process:
        scalars, hparams = read_events(os.path.join(project_dir, "compat_run"))
        return {"scalars": scalars, "hparams": hparams}
    return {}


def main():
    parser = argparse.ArgumentParser(description="Tracking with TensorBoard.")
    parser.add_argument("--mixed_precision", type=str, default=None,
                        choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="train on the CPU only")
    parser.add_argument("--output_dir", type=str, default=".")
    args = parser.parse_args()
    print(training_function(dict(CONFIG), args))


if __name__ == "__main__":
    main()
