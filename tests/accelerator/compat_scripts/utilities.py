"""The rest of Accelerate's calls around a loop: where the process stands (``distributed_type``,
``state``), splitting work between processes, padding, reducing and gathering objects, a
trigger to stop every process at once, decorators for one process, a DDP communication hook
and gradient clipping by value, profiling, and freeing memory between two trainings."""

import argparse
from datetime import timedelta

import torch
from torch.utils.data import DataLoader

from accelerate import Accelerator, DistributedType
from accelerate.utils import (DDPCommunicationHookType, DistributedDataParallelKwargs,
                              InitProcessGroupKwargs, ProfileKwargs, broadcast_object_list,
                              gather_object, set_seed)
from common import RandomClassification, TinyClassifier, TinyConfig, parameters

CONFIG = {"seed": 23, "lr": 0.1, "batch_size": 4, "n_train": 24, "clip_value": 0.05}


def training_function(config, args):
    kwargs_handlers = [
        DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16,
                                      gradient_as_bucket_view=True),
        InitProcessGroupKwargs(timeout=timedelta(seconds=900)),
        ProfileKwargs(activities=["cpu"], record_shapes=True)]
    accelerator = Accelerator(cpu=args.cpu, kwargs_handlers=kwargs_handlers)
    rank, world = accelerator.process_index, accelerator.num_processes
    out = {"where": (str(accelerator.distributed_type), accelerator.use_distributed,
                     world, accelerator.is_last_process, accelerator.state.num_processes,
                     accelerator.mixed_precision,
                     accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU))}

    prompts = [f"prompt {i}" for i in range(7)]
    with accelerator.split_between_processes(prompts) as mine:
        out["split"] = list(mine)
    with accelerator.split_between_processes(prompts, apply_padding=True) as mine:
        out["split_padded"] = gather_object(list(mine))
    with accelerator.split_between_processes({"a": list(range(5)), "b": list("vwxyz")}) as mine:
        out["split_dict"] = mine
    with accelerator.split_between_processes(torch.arange(10), apply_padding=True) as mine:
        out["split_tensor"] = accelerator.gather(mine)

    ragged = torch.arange(rank + 2, dtype=torch.float32) + 10 * rank
    out["padded"] = accelerator.gather(accelerator.pad_across_processes(ragged, pad_index=-1))
    out["padded_first"] = accelerator.gather(accelerator.pad_across_processes(
        ragged, pad_index=-1, pad_first=True))
    value = torch.tensor([1.0 + rank, 2.0 * rank])
    out["reduce"] = {r: accelerator.reduce(value, r) for r in ("sum", "mean", "max")}
    out["reduce_scale"] = accelerator.reduce(value, "sum", scale=2.0)
    out["gather_object"] = gather_object([{"rank": rank, "text": "x" * (rank + 1)}])
    out["broadcast"] = broadcast_object_list([f"from {rank}", rank * 3])

    @accelerator.on_main_process
    def only_main():
        return "main"

    @accelerator.on_process(process_index=world - 1)
    def only_last():
        return "last"

    out["decorated"] = (only_main(), only_last())
    order = []
    with accelerator.main_process_first():
        order.append("main first")
    with accelerator.local_main_process_first():
        order.append("local main first")
    out["order"] = order

    # a short training run: DDP with the fp16 communication hook, clipping by value
    set_seed(config["seed"])
    train_dataloader = DataLoader(RandomClassification(config["n_train"], TinyConfig()),
                                  batch_size=config["batch_size"], shuffle=True)
    model = TinyClassifier(TinyConfig())
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    losses, stopped_at = [], None
    for step, batch in enumerate(train_dataloader):
        outputs = model(x=batch["x"], labels=batch["labels"])
        accelerator.backward(outputs["loss"])
        accelerator.clip_grad_value_(model.parameters(), config["clip_value"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(outputs["loss"].item())
        if step == 2 and accelerator.is_main_process:
            accelerator.set_trigger()
        if accelerator.check_trigger():
            stopped_at = step
            break
    out["train"] = {"losses": losses, "stopped_at": stopped_at,
                    "skipped": accelerator.optimizer_step_was_skipped,
                    "params": parameters(accelerator.unwrap_model(model))}
    with accelerator.profile() as profiler:
        with torch.no_grad():
            model(x=torch.randn(2, TinyConfig().in_features))
    out["profiled"] = len(profiler.key_averages()) > 0
    model, optimizer, train_dataloader = accelerator.free_memory(model, optimizer,
                                                                 train_dataloader)
    out["freed"] = (model, optimizer, train_dataloader)
    return out


def main():
    parser = argparse.ArgumentParser(description="Accelerate's utilities.")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU only")
    args = parser.parse_args()
    print(training_function(dict(CONFIG), args))


if __name__ == "__main__":
    main()
