"""Long sequences split over the processes, in the style of Accelerate's
``examples/torch_native_parallelism/nd_parallel.py``: ``ParallelismConfig(cp_size=...)`` with
every process on the context-parallel axis, an FSDP2 plugin wrapping the Llama decoder
layers, each batch's input_ids, labels, shift_labels and position_ids cut with
``maybe_context_parallel``, the model's own loss (on shift_labels), the loss averaged over the
``dp_cp`` mesh. Accelerate's context parallel runs only with GPU attention kernels, so the
comparison is Accelerate on one process against meshfit on two (cp=2): the same losses and
weights.

Run alone: ``python context_parallel.py`` (one process) or under a launcher."""

import argparse
import os

import torch
import torch.distributed as dist
import transformers

from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import FullyShardedDataParallelPlugin, set_seed

CONFIG = {"lr": 0.5, "steps": 4, "seq_len": 32, "batch_size": 2, "vocab_size": 128, "seed": 42}


def forward(model, batch, optimizer, accelerator, parallelism_config):
    batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1)).unsqueeze(0)
    # labels only switch the model's loss on; shift_labels are the targets it uses
    buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
    with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1, 1],
                                            no_restore_buffers=set(buffers)):
        loss_group = (accelerator.torch_device_mesh["dp_cp"].get_group()
                      if parallelism_config.dp_cp_dim_names else None)
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if dist.is_initialized():  # (gloo has no AVG: a sum, then the mean)
            dist.all_reduce(loss, group=loss_group)
            loss = loss / dist.get_world_size(loss_group)
    return loss


def training_function(config, args):
    parallelism_config = ParallelismConfig(cp_size=int(os.environ.get("WORLD_SIZE", 1)))
    fsdp_plugin = None
    if parallelism_config.dp_shard_enabled or parallelism_config.cp_enabled:
        fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=args.cpu, parallelism_config=parallelism_config,
                              fsdp_plugin=fsdp_plugin)
    set_seed(config["seed"])
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=config["vocab_size"], max_position_embeddings=64))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(config["seed"])
    tokens = torch.randint(0, config["vocab_size"], (config["batch_size"], config["seq_len"] + 1),
                           generator=g)  # one batch, learnt over the steps
    losses = []
    for _ in range(config["steps"]):
        batch = {"input_ids": tokens[:, :-1].clone(), "labels": tokens[:, :-1].clone(),
                 "shift_labels": tokens[:, 1:].clone()}
        losses.append(forward(model, batch, optimizer, accelerator, parallelism_config).item())
    state = accelerator.get_state_dict(model)
    params = {k: v.detach().float().clone() for k, v in state.items()}
    return {"losses": losses, "params": params if accelerator.is_main_process else None,
            "mesh": parallelism_config.dp_cp_dim_names}


if __name__ == "__main__":
    print(training_function(CONFIG, argparse.Namespace(cpu=True)))
