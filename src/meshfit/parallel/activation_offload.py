"""Activation offloading: the tensors each transformer block saves for the backward pass go
to host memory during the forward and come back for the backward.

    offloader = apply_activation_offload(model, device=torch.device("cuda"))
    loss = model(x).sum(); loss.backward()         # as before; the saved tensors travelled
    offloader.stats                                # what went: tensors, bytes, fetched

Each block's call runs under ``torch.autograd.graph.saved_tensors_hooks`` (entered around
the whole call, `meshfit.parallel.activation_call`): the pack hook copies a saved tensor to
host memory and returns a handle, the unpack hook returns the tensor back on the device.
The device keeps one block's activations at a time in the forward and two in the backward
(the one in use and the next, prefetched), instead of all of them; the host holds the rest.
TRL's ``activation_offloading``, torchtune's ``OffloadActivations`` and DeepSpeed do the
same.

On CUDA (`StreamTransfers`) the copies go through page-locked (pinned) host memory on a side
stream, so they overlap the compute: the side stream waits for the work that produced a
tensor, copies it out, and the device memory is not reused before the copy has read it
(``record_stream``); in the backward, the first tensor asked for of a block brings the whole
block back and starts bringing the previous block (the next one the backward needs) on the
side stream, and the compute stream waits only for the tensor it uses. That path runs only
where a GPU is present. Everywhere else (`SyncTransfers`: the CPU, and tensor subclasses
other than DTensor, moved with ``Tensor.to``), the copies are made on the calling thread; on a
CPU-only run the device memory is the host memory, so offloading saves nothing there and
costs the copies, but the same hooks, groups and prefetch order run (what the CPU tests
check, equal to the run without offloading bit for bit).

What is moved: tensors on the device that are not parameters (FSDP2's unsharded parameters
are ``nn.Parameter``: they are gathered again for the backward, not saved), are contiguous
(a non-contiguous saved tensor is mostly a parameter's transpose, a view of memory that
stays on the device anyway) and of at least `min_bytes` (1 KiB on CUDA: a copy of a few
bytes costs more than it frees). A tensor saved twice in one block is moved once.

With activation checkpointing, offloading applies to what checkpointing keeps: the
non-reentrant checkpoint saves a block's inputs through the same hooks (outside its own),
so the inputs go to the host, and the recomputation in the backward runs on the device as
before. Every layout keeps its hooks: DDP and FSDP2's run inside the block's call, tensor
parallel's DTensors move their local shard (``to_local``) and are rebuilt around it with
their mesh, placements, shape and stride (``DTensor.from_local``), pipeline stages offload
their own blocks.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from meshfit.models.gpt import GPT
from meshfit.parallel.activation import find_blocks
from meshfit.parallel.activation_call import add_around_call, arounds, remove_around_call

__all__ = ["ActivationOffloader", "StreamTransfers", "SyncTransfers", "apply_activation_offload",
           "offloader_of", "remove_activation_offload"]

_NAME = "activation_offload"


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor, without importing DTensor (0.5 s at the start of every
    process) where no layout did: none can exist before its module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


# --------------------------------------------------------------------------- the copies
class SyncTransfers:
    """Copies on the calling thread (the CPU; tensor subclasses other than DTensor)."""

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu", copy=True)

    def to_device(self, host: torch.Tensor, device: torch.device):
        """(the tensor on `device`, what to wait for before using it: None here)."""
        return (host if device.type == "cpu" else host.to(device)), None

    def wait(self, tensor: torch.Tensor, ready) -> None:
        """Nothing to wait for: the copy is done."""


class StreamTransfers(SyncTransfers):
    """CUDA: pinned host memory and a side stream (the module docstring). A DTensor's local
    shard travels this way (`ActivationOffloader` unwraps it); other tensor subclasses take
    the synchronous path of `SyncTransfers`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device)

    def __deepcopy__(self, memo):  # (a copied model gets its own side stream)
        return StreamTransfers(self.device)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if type(tensor) is not torch.Tensor:
            return super().to_host(tensor)
        current = torch.cuda.current_stream(tensor.device)
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        self.side.wait_stream(current)  # the tensor is written by work queued before
        with torch.cuda.stream(self.side):
            host.copy_(tensor.detach(), non_blocking=True)
        tensor.record_stream(self.side)  # its memory outlives the copy that reads it
        return host  # (a later copy back runs on the same stream: after this one)

    def to_device(self, host: torch.Tensor, device: torch.device):
        if type(host) is not torch.Tensor:
            return super().to_device(host, device)
        with torch.cuda.stream(self.side):
            tensor = host.to(device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.side)
        return tensor, ready

    def wait(self, tensor: torch.Tensor, ready) -> None:
        if ready is None:
            return
        current = torch.cuda.current_stream(tensor.device)
        current.wait_event(ready)
        tensor.record_stream(current)  # allocated on the side stream, used on this one


# --------------------------------------------------------------------------- the hooks
class _Group:
    """The tensors one block call moved, in forward order (weakly: autograd owns them), and
    the group of the block called before it (the next one the backward needs)."""

    __slots__ = ("__weakref__", "fetched", "handles", "prev", "started")

    def __init__(self, prev: _Group | None):
        self.handles: list[weakref.ref] = []
        self.prev = weakref.ref(prev) if prev is not None else None
        self.fetched = False  # brought back (by its own backward, or prefetched)
        self.started = False  # its backward asked for a tensor


class _Handle:
    """One moved tensor: its host copy until fetched, then its device copy; `dtensor`: a
    DTensor's (mesh, placements, shape, stride), its local shard being what moved."""

    __slots__ = ("__weakref__", "device", "dtensor", "group", "host", "ready", "tensor")

    def __init__(self, host: torch.Tensor, device: torch.device, group: _Group, dtensor=None):
        self.host, self.device, self.group, self.dtensor = host, device, group, dtensor
        self.tensor, self.ready = None, None


class ActivationOffloader:
    """Moves the tensors saved inside each `group()` to host memory and back (the module
    docstring). `device`: the run's device (tensors elsewhere stay where they are);
    `transfers`: how to copy (default: `StreamTransfers` on CUDA, else `SyncTransfers`);
    `min_bytes`: smaller tensors stay (default 1 KiB on CUDA, 0 elsewhere)."""

    def __init__(self, device: torch.device | str = "cpu", *, transfers=None,
                 min_bytes: int | None = None):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.transfers = transfers if transfers is not None else (
            StreamTransfers(self.device) if cuda else SyncTransfers())
        self.min_bytes = min_bytes if min_bytes is not None else (1024 if cuda else 0)
        self.stats = {"tensors": 0, "bytes": 0, "kept": 0, "fetched": 0, "dtensors": 0}
        """Tensors and bytes moved to the host, tensors kept on the device, tensors brought
        back, DTensors among those moved (cumulative; tests and
        benchmarks/activation_memory.py read them)."""
        self._last: weakref.ref | None = None

    def __getstate__(self) -> dict:  # (a pickled model: no groups; CUDA's stream made anew)
        cuda = isinstance(self.transfers, StreamTransfers)
        return {**self.__dict__, "_last": None, "transfers": None if cuda else self.transfers}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.transfers is None:
            self.transfers = StreamTransfers(self.device)

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Offload what autograd saves in this context (one block's call)."""
        last = self._last() if self._last is not None else None
        group = _Group(last)
        self._last = weakref.ref(group)
        seen: dict[int, tuple[torch.Tensor, _Handle]] = {}  # id -> (tensor, handle)
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: self._pack(group, seen, t), self._unpack):
                yield
        finally:
            seen.clear()  # the device tensors themselves: freed once nothing else holds them

    def moves(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`, saved inside a group, goes to the host."""
        device = tensor.device  # ("cuda" means the current one: any index matches)
        return (device.type == self.device.type
                and self.device.index in (None, device.index)
                and not isinstance(tensor, nn.Parameter)
                and tensor.is_contiguous()
                and tensor.numel() * tensor.element_size() >= self.min_bytes)

    def _pack(self, group: _Group, seen: dict, tensor: torch.Tensor):
        if not self.moves(tensor):
            self.stats["kept"] += 1
            return tensor
        known = seen.get(id(tensor))
        if known is not None:  # (the dict holds the tensor: its id is not reused meanwhile)
            return known[1]
        dtensor = None
        if _is_dtensor(tensor):  # the local shard moves; the metadata stays here
            dtensor = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
            with torch.no_grad():
                local = tensor.to_local()
            handle = _Handle(self.transfers.to_host(local), local.device, group, dtensor)
            self.stats["dtensors"] += 1
        else:
            handle = _Handle(self.transfers.to_host(tensor), tensor.device, group)
        group.handles.append(weakref.ref(handle))
        seen[id(tensor)] = (tensor, handle)
        self.stats["tensors"] += 1
        self.stats["bytes"] += tensor.numel() * tensor.element_size()
        return handle

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        group = packed.group
        if not group.started:  # the block's backward starts: it, and the next one, come back
            group.started = True
            if not group.fetched:
                self._fetch(group)
            prev = group.prev() if group.prev is not None else None
            if prev is not None and not prev.fetched:
                self._fetch(prev)
        if packed.tensor is None:  # (moved after its group was fetched: a late save)
            self._fetch_one(packed)
        self.transfers.wait(packed.tensor, packed.ready)
        if packed.dtensor is None:
            return packed.tensor
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = packed.dtensor
        with torch.no_grad():
            return DTensor.from_local(packed.tensor, mesh, placements, run_check=False,
                                      shape=shape, stride=stride)

    def _fetch(self, group: _Group) -> None:
        group.fetched = True
        for ref in group.handles:
            handle = ref()
            if handle is not None and handle.tensor is None:
                self._fetch_one(handle)

    def _fetch_one(self, handle: _Handle) -> None:
        handle.tensor, handle.ready = self.transfers.to_device(handle.host, handle.device)
        handle.host = None  # the host copy is freed (pinned: once the copy has read it)
        self.stats["fetched"] += 1


# --------------------------------------------------------------------------- the model
def apply_activation_offload(model: nn.Module, *, device: torch.device | str | None = None,
                             min_bytes: int | None = None) -> ActivationOffloader:
    """Offload the saved activations of each transformer block of `model` (the blocks
    `meshfit.parallel.activation.find_blocks` finds; a meshfit GPT pipeline stage's own
    blocks, none for a stage without any); returns the `ActivationOffloader`. `device`:
    where the model runs (default: its first parameter's device). Apply after activation
    checkpointing or before: the two compose either way."""
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    offloader = ActivationOffloader(device, min_bytes=min_bytes)
    blocks = list(model.layers.values()) if isinstance(model, GPT) else find_blocks(model)
    for block in blocks:
        add_around_call(block, _NAME, offloader.group)
    return offloader


def remove_activation_offload(model: nn.Module) -> None:
    """Undo `apply_activation_offload` on every module of `model`."""
    for module in model.modules():
        remove_around_call(module, _NAME)


def offloader_of(model: nn.Module) -> ActivationOffloader | None:
    """The `ActivationOffloader` of `model`'s blocks, None where none was applied."""
    for module in model.modules():
        factory = arounds(module).get(_NAME)
        if factory is not None:
            return factory.__self__
    return None
