"""Private torch and transformers names, behind one door per library.

meshfit reaches a private name (``torch.x._y``, ``module._attr``) only where no public API
does the job yet. Each library has one module here (`dcp`: torch.distributed.checkpoint and
torch.serialization; `fsdp`: FSDP2's internals; ...), and nothing outside this package
names a private torch or transformers attribute (`tests/test_compat.py` reads the source
to check it), so that a torch or transformers upgrade that moves a name breaks one file,
and a test says which name and which version, instead of a rank failing deep in a run.

Every module here follows one shape:

- a docstring per private name it uses: why meshfit needs it, and the public API that would
  replace it (so that it is removed the day that API exists);
- ``missing() -> list[str]``: the private names it uses that the installed library does not
  have (each as ``"torch 2.13.0: torch.distributed.x._y"``); `tests/test_compat.py` fails
  with these lines, one per name.

The modules (one per library, or per part of torch with its own internals):

    data              the DataLoader worker's identity
    dcp               torch.distributed.checkpoint and torch.serialization
    distributed       c10d's process groups, DeviceMesh's flattened axes, DDP's ignore list
    dynamo            torch.compile: dynamo's counters, inductor's modes, the compiled wrapper
    elastic           torchrun's agent stopping its workers
    fsdp              FSDP2's managed parameters, their shards and held gradients
    nn                torch.nn.Module's slots and hooks, the normalisation layers' bases
    ops               ATen's private operators (SDPA's kernels), the dispatcher's types
    optim             LR schedulers' step bookkeeping, the fused optimizers' devices
    pipelining        pipeline stages' warm-up, a schedule's re-initialisation
    tensor_parallel   the ParallelStyle contract and torch's styles' hooks
    transformers      the attention implementation a model runs
    _probe            how `missing()` looks a name up, and the line it returns

This package is at the bottom layer: it imports torch or transformers (lazily where the
importer must stay torch-free) and nothing of meshfit outside it.
"""
