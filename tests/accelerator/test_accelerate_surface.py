"""The rest of the surface Accelerate's examples and scripts use, against Accelerate itself
(in-process, one process): their import lines resolve under meshfit, Accelerate's own
configuration objects are taken wherever meshfit's are, and `init_empty_weights`,
`get_logger`, `merge_fsdp_weights`, `skip_first_batches` and `split_between_processes` on a
``datasets.Dataset`` do what Accelerate's do. (Accelerate's test scripts, LocalSGD and the
multi-process behaviour: test_accelerate_suite.py.)"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch.utils.data import DataLoader

accelerate = pytest.importorskip("accelerate")
import accelerate.utils as hf  # noqa: E402

# The import statements of Accelerate's examples (examples/*.py and examples/by_feature/*.py
# of Accelerate 1.15; DeepSpeed's and Megatron-LM's dummy optimizers left out: meshfit refuses
# those plugins), as a script switched to meshfit has them.
EXAMPLE_IMPORTS = """
from accelerate import Accelerator, DataLoaderConfiguration, DistributedType
from accelerate import FullyShardedDataParallelPlugin, init_empty_weights, notebook_launcher
from accelerate import PartialState, skip_first_batches
from accelerate.local_sgd import LocalSGD
from accelerate.logging import get_logger
from accelerate.utils import find_executable_batch_size, set_seed, ProfileKwargs
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from accelerate.utils import is_npu_available, is_xpu_available, is_schedulefree_available
from accelerate.utils import merge_fsdp_weights, gather_object
"""


def as_meshfit(source: str) -> str:
    return re.sub(r"^(\s*)(from|import)(\s+)accelerate\b", r"\1\2\3meshfit", source,
                  flags=re.MULTILINE)


def test_the_examples_imports_resolve():
    exec(compile(as_meshfit(EXAMPLE_IMPORTS), "<examples>", "exec"), {})  # noqa: S102


def test_accelerates_own_objects_are_taken_where_meshfits_are(monkeypatch):
    from meshfit import Accelerator
    from meshfit.utils import DistributedDataParallelKwargs, GradScalerKwargs

    monkeypatch.setenv("MESHFIT_CPU", "1")
    acc = Accelerator(
        kwargs_handlers=[hf.DistributedDataParallelKwargs(find_unused_parameters=True),
                         hf.GradScalerKwargs(init_scale=1024.0)],
        dataloader_config=accelerate.DataLoaderConfiguration(even_batches=False),
        gradient_accumulation_plugin=hf.GradientAccumulationPlugin(num_steps=3),
        project_config=hf.ProjectConfiguration(project_dir="runs", total_limit=2))
    assert isinstance(acc.ddp_handler, DistributedDataParallelKwargs)
    assert acc.ddp_handler.find_unused_parameters is True
    assert isinstance(acc.scaler_handler, GradScalerKwargs) and acc.scaler_handler.init_scale \
        == 1024.0
    assert acc.even_batches is False and acc.gradient_accumulation_steps == 3
    assert acc.project_configuration.total_limit == 2
    hook = hf.DistributedDataParallelKwargs(comm_hook=hf.DDPCommunicationHookType.FP16)
    assert str(Accelerator(kwargs_handlers=[hook]).ddp_handler.comm_hook) == "fp16"


def _devices(module: torch.nn.Module) -> dict:
    return {name: t.device.type for name, t in [*module.named_parameters(),
                                                 *module.named_buffers()]}


@pytest.mark.parametrize("include_buffers", [False, True])
def test_init_empty_weights_as_accelerates(include_buffers):
    from meshfit import init_empty_weights

    def build():
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))

    with accelerate.init_empty_weights(include_buffers=include_buffers):
        want = _devices(build())
    with init_empty_weights(include_buffers=include_buffers):
        got = _devices(build())
    assert got == want and "meta" in got.values()
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # restored on leaving


def test_get_logger_writes_on_the_main_process(caplog):
    from meshfit.logging import get_logger

    logger = get_logger("meshfit.test_surface", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="meshfit.test_surface"):
        logger.info("step %d", 3)
        logger.info("everywhere", main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["step 3", "everywhere"]


def test_merge_fsdp_weights_as_accelerates(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from meshfit.utils import merge_fsdp_weights

    torch.manual_seed(0)
    weights = {"layer.weight": torch.randn(4, 3), "layer.bias": torch.randn(4)}
    dcp.save({"model": weights}, checkpoint_id=str(tmp_path / "sharded"), no_dist=True)
    hf.merge_fsdp_weights(str(tmp_path / "sharded"), str(tmp_path / "theirs"))
    merge_fsdp_weights(tmp_path / "sharded", tmp_path / "ours")
    theirs = load_file(tmp_path / "theirs" / "model.safetensors")
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    assert theirs.keys() == ours.keys() == weights.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in weights)
    with pytest.raises(ValueError, match="no sharded checkpoint"):
        merge_fsdp_weights(tmp_path / "ours", tmp_path / "again")


def test_skip_first_batches_of_a_plain_loader_as_accelerates():
    from meshfit import skip_first_batches

    loader = DataLoader(list(range(10)), batch_size=3)
    want = [b.tolist() for b in accelerate.skip_first_batches(loader, 2)]
    assert [b.tolist() for b in skip_first_batches(loader, 2)] == want == [[6, 7, 8], [9]]


def test_split_between_processes_gives_a_datasets_dataset_its_rows():
    datasets = pytest.importorskip("datasets")
    from meshfit.accelerator.shared_state import share

    data = datasets.Dataset.from_list([{"k": v} for v in range(5)])
    parts = [share(data, 2, r, apply_padding=True, device=torch.device("cpu"))
             for r in range(2)]
    assert [p["k"] for p in parts] == [[0, 1, 2], [3, 4, 4]]
    assert [share(data, 2, r, apply_padding=False, device=torch.device("cpu"))["k"]
            for r in range(2)] == [[0, 1, 2], [3, 4]]


def test_a_loader_shuffled_by_the_users_generator_keeps_its_order(monkeypatch):
    """As Accelerate: the prepared loader draws from the user's generator itself, so a script
    re-seeding it after `prepare` (Accelerate's test_script does) gets plain PyTorch's order."""
    from meshfit import Accelerator

    monkeypatch.setenv("MESHFIT_CPU", "1")
    g = torch.Generator()
    loader = DataLoader(list(range(12)), batch_size=4, shuffle=True, generator=g)
    prepared = Accelerator().prepare(loader)
    g.manual_seed(42)
    want = [b.tolist() for _ in range(3) for b in loader]
    g.manual_seed(42)
    assert [b.tolist() for _ in range(3) for b in prepared] == want
