"""`Accelerator.save_state` / `load_state`: everything a loop needs to continue exactly (the
whole model out: `meshfit.accelerator.export`).

A checkpoint holds, under Accelerate's names, ``model`` (``model_1``, ...; a pipeline's stages
as one), ``optimizer`` (state by parameter name, also ZeRO-1's partitions and FSDP2's shards),
``scheduler``, ``scaler``, ``dataloader``, ``custom_<i>``, ``rng`` (per rank) and
``accelerator`` (step counters), as one DCP checkpoint (`meshfit.checkpoint.save`; the
format is always DCP's): each rank writes its shards, the folder is committed atomically with
a manifest, and loading checks files, parameter names and shapes against it, then reshards to
this job's layout (DDP, ZeRO-1/2/3, TP, PP combined; any world size). With
``automatic_checkpoint_naming`` the folder is ``project_dir/checkpoints/checkpoint_<i>`` (the
oldest beyond ``total_limit`` deleted first; a folder given is ignored) and `load_state`
without a folder reads the newest, as with Accelerate. ``async_save=True`` (or ``"thread"``)
copies the state to host memory and writes it in the background (a thread, over a gloo group
of its own) until `finish_save` commits it (`wait_for_checkpoint`, the next save,
`load_state`, `end_training`); ``async_save="process"`` stages it into shared memory and has a
process of this rank's own write it (`meshfit.checkpoint.save`: no writer thread holds
this process's GIL; it is spawned, so a script needs ``if __name__ == "__main__":``). As with Accelerate, `load_state` leaves data loaders as they are (a script
skips batches itself) unless they are stateful: then each continues where it stood.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshfit import __version__
from meshfit import distributed as mdist
from meshfit._compat.dcp import stager_copies_classes
from meshfit.accelerator.registry import PendingSave, Registry
from meshfit.checkpoint import state as ckstate
from meshfit.checkpoint.saved import hf_config
from meshfit.checkpoint.load import load_dcp, read_index
from meshfit.checkpoint.manifest import CheckpointError, Manifest, start_verify
from meshfit.checkpoint.save import close_writer_process, commit, save_dcp, save_dcp_async
from meshfit.distributed.settle import barrier as settled_barrier
from meshfit.models.plans.regroup import regrouped_params, regrouped_tp

# Functions here take the `Accelerator` ("acc"), whose public attributes say where this
# process stands (its runtime, layout, precision, step counters, project configuration),
# and its `Registry` of prepared objects, which they save and fill (the Accelerator is not
# imported here: it imports this module).
Accelerator = Any

__all__ = ["check_registrable", "finish_save", "load_state", "save_state"]

log = logging.getLogger("meshfit")


def _key(kind: str, i: int) -> str:
    return kind if i == 0 else f"{kind}_{i}"


def _models(acc: Accelerator, registry: Registry) -> list[list[torch.nn.Module]]:
    """Each prepared model as the modules holding its parameters under their full names."""
    return [list(entry.modules) if hasattr(entry, "stage_indices")
            else [acc.runtime.unwrap(entry)] for entry in registry.models]


def _owner(models: list[list[torch.nn.Module]], optimizer) -> list[torch.nn.Module]:
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for modules in models:
        if any(id(p) in params for m in modules for p in m.parameters()):
            return modules
    raise ValueError("save_state: an optimizer's parameters belong to no prepared model; "
                     "prepare the model it optimizes with the same Accelerator")


def _ties(acc: Accelerator, registry: Registry) -> list[list[str]]:
    """Names that denote one weight (a tied embedding and head): one parameter of a whole
    model, or one copy per pipeline stage."""
    groups = []
    for entry, modules in zip(registry.models, _models(acc, registry)):
        if hasattr(entry, "stage_indices"):
            groups += [list(t.names) for t in entry._tied]
            continue
        by_id: dict[int, list[str]] = {}
        for m in modules:
            for name, p in m.named_parameters(remove_duplicate=False):
                by_id.setdefault(id(p), []).append(name)
        groups += [names for names in by_id.values() if len(names) > 1]
    return groups


def _alias(ties: list[list[str]], manifest: Manifest, saved: set[str], key: str):
    """name -> the name under which the checkpoint holds that weight's optimizer state
    (`ties`: this job's, `_ties`; `saved`: the checkpoint's keys)."""
    present = {k.split(".", 2)[2].rsplit(".", 1)[0] for k in saved
               if k.startswith(f"{key}.state.")}
    groups = ties + [list(g) for g in manifest.model.get("ties", [])]

    def alias(name: str) -> str:
        if name in present:
            return name
        tied = (other for group in groups if name in group for other in group)
        return next((other for other in tied if other in present), name)  # missing: DCP says
    return alias


def _hf_configs(models) -> list[dict | None]:
    """Each model's transformers config (for `meshfit export --to hf`), None for others."""
    return [hf_config(modules[0]) for modules in models]


def _regrouped(models) -> int:
    """The TP degree a fused q|k|v projection was regrouped for (GPT-2's c_attn under tp;
    1: none): such weights are stored head-grouped for that degree."""
    return max([regrouped_tp(m) for ms in models for root in ms for m in root.modules()]
               or [1])


def _regrouped_names(models) -> list[dict[str, list[int]]]:
    """Each model's head-grouped parameters (``[chunks, tp, dim]`` by name), over all ranks:
    what `meshfit export` needs to write them in the model's own layout."""
    mine = []
    for modules in models:
        found: dict[str, list[int]] = {}
        for root in modules:
            root = getattr(root, "module", root)  # (DDP never holds TP layers; FSDP2 is in place)
            found.update({k: list(v) for k, v in regrouped_params(root).items()})
        mine.append(found)
    return _over_ranks(mine)


def _shapes(models, *, pipeline: bool, states: list[dict] | None = None
            ) -> list[dict[str, list[int]]]:
    """Each model's parameter names and global shapes (`states`: their `model_state`s, if
    built already). Under a pipeline, merged over all ranks (a rank holds only its stages'
    part); otherwise every rank holds every name, with global shapes (DTensors), and this
    rank's view is the whole."""
    states = states if states is not None else [ckstate.model_state(m) for m in models]
    mine = [{k: list(v.shape) for k, v in s.items() if isinstance(v, torch.Tensor)}
            for s in states]
    return _over_ranks(mine) if pipeline else mine


def _over_ranks(mine: list[dict]) -> list[dict]:
    """Each model's dict (`mine`: this rank's), merged over all ranks."""
    if not mdist.is_initialized():
        return mine
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [{k: v for part in everyone for k, v in part[i].items()} for i in range(len(mine))]


def _collect(acc: Accelerator, registry: Registry, models) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for i, modules in enumerate(models):
        state[_key("model", i)] = ckstate.model_state(modules)
    for i, opt in enumerate(registry.optimizers):
        state[_key("optimizer", i)] = ckstate.saved_form(
            ckstate.optimizer_state(_owner(models, opt.optimizer), opt.optimizer))
    for i, sched in enumerate(registry.schedulers):
        state[_key("scheduler", i)] = sched.scheduler.state_dict()
    for i, loader in enumerate(registry.loaders):
        state[_key("dataloader", i)] = loader.state_dict()
    for i, obj in enumerate(registry.custom):
        state[f"custom_{i}"] = obj.state_dict()
    if acc.precision.scaler is not None:
        state["scaler"] = acc.precision.scaler.state_dict()
    state["rng"] = {f"rank{acc.env.rank}": ckstate.rng_state()}
    state["accelerator"] = {"optimizer_steps": registry.optimizer_steps,
                            "micro_step": acc.grad_state.step}
    return state


def check_registrable(obj: Any) -> None:
    """Refuse an object `register_for_checkpointing` cannot save and load."""
    if not (callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))):
        raise ValueError(f"register_for_checkpointing: {type(obj).__name__} has no "
                         "state_dict() and load_state_dict(); register objects that do")


def save_state(acc: Accelerator, registry: Registry, output_dir, *, step: int | None = None,
               async_save: bool | str = False) -> Path:
    """Write the checkpoint into `output_dir` (or the next automatic folder) and count the
    save (``save_iteration``)."""
    if async_save not in (False, True, "thread", "process"):
        raise ValueError(f"save_state(async_save={async_save!r}): give False, True (a writer "
                         "thread), 'thread' or 'process' (a writer process)")
    config = acc.project_configuration
    if config.automatic_checkpoint_naming:
        output_dir = _automatic_folder(acc)
    elif output_dir is None:
        raise ValueError("save_state() needs an output_dir (or ProjectConfiguration("
                         "automatic_checkpoint_naming=True))")
    acc.runtime.check_files()  # (offload_params: no changed file goes into a checkpoint)
    folder = _write(acc, registry, output_dir, step=step, async_save=async_save)
    config.iteration += 1
    return folder


def _number(path: Path) -> int:
    found = re.findall(r"(\d+)", path.name)
    return int(found[-1]) if found else -1


def _automatic_folder(acc: Accelerator) -> Path:
    """``project_dir/checkpoints/checkpoint_<iteration>``, after the main process deleted the
    oldest folders beyond ``total_limit``; every rank waits for it."""
    config = acc.project_configuration
    if config.project_dir is None:
        raise ValueError("automatic_checkpoint_naming needs a project_dir")
    root = Path(config.project_dir) / "checkpoints"
    if acc.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        folders = sorted((p for p in root.iterdir() if p.is_dir()), key=_number)
        if config.total_limit is not None and len(folders) + 1 > config.total_limit:
            for old in folders[: len(folders) + 1 - config.total_limit]:
                shutil.rmtree(old)
    folder = root / f"checkpoint_{config.iteration}"
    if folder.exists():
        raise ValueError(f"Checkpoint directory {folder} ({config.iteration}) already "
                         "exists. Please manually override `self.save_iteration` with what "
                         "iteration to start with.")
    acc.wait_for_everyone()
    return folder


def _newest_folder(acc: Accelerator) -> Path:
    """The automatically named checkpoint folder with the highest number."""
    if not acc.project_configuration.automatic_checkpoint_naming:
        raise ValueError("No input_dir provided and automatic checkpoint naming is "
                         "disabled.")
    root = Path(acc.project_dir) / "checkpoints"
    folders = [p for p in root.iterdir() if p.is_dir() and re.search(r"\d+", p.name)]
    if not folders:
        raise ValueError(f"load_state(): {root} holds no checkpoint")
    return max(folders, key=_number)


def _write(acc: Accelerator, registry: Registry, output_dir, *, step: int | None,
           async_save: bool | str) -> Path:
    """Write the checkpoint into `output_dir` (a temporary folder beside it, renamed once every
    rank has written and the manifest is in), or start writing it (`async_save`)."""
    finish_save(acc, registry)  # one save in flight at a time
    folder = Path(output_dir)
    models = _models(acc, registry)
    state = _collect(acc, registry, models)
    step = registry.optimizer_steps if step is None else step
    state["accelerator"]["step"] = step  # the manifest's step, inside the checksummed data
    layout = acc.layout
    manifest = Manifest(
        step=step, world_size=acc.num_processes,
        layout={"dims": {a: getattr(layout.dims, a) for a in layout.dims.enabled()},
                "engine": layout.engine.value, "zero_stage": layout.zero_stage},
        model={"shapes": _shapes(models, pipeline=layout.dims.pp > 1,
                                 states=[state[_key("model", i)] for i in range(len(models))]),
               "ties": _ties(acc, registry), "hf_config": _hf_configs(models),
               "regrouped_for_tp": _regrouped(models), "regrouped": _regrouped_names(models)},
        versions={"meshfit": __version__, "torch": torch.__version__})
    if async_save:
        _start_writing(registry, state, folder, manifest,
                       mode="process" if async_save == "process" else "thread")
        return folder
    return commit(save_dcp(state, folder), folder, manifest)


def _start_writing(registry: Registry, state: dict[str, Any], folder: Path,
                   manifest: Manifest, *, mode: str) -> None:
    """Start the background write of `state` (`mode`: by a thread or a process of this rank),
    over a gloo group of its own; `finish_save` commits it."""
    if registry.save_group is None and mdist.is_initialized():
        registry.save_group = dist.new_group(backend="gloo")  # the writer's own group
    if mode == "process" and registry.save_stager is None:
        # Lazy: DCP's staging takes most of a second to import; only process saves use it.
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # Staged into shared memory (kept between saves), which the writer process maps.
        registry.save_stager = DefaultStager(StagingOptions(
            use_pinned_memory=torch.cuda.is_available(), use_shared_memory=True,
            use_async_staging=False, use_non_blocking_copy=False))
        stager_copies_classes(registry.save_stager)  # (torch 2.11 fails on a class)
    tmp, future = save_dcp_async(state, folder, process_group=registry.save_group, mode=mode,
                                 stager=registry.save_stager if mode == "process" else None)
    registry.pending_save = PendingSave(tmp, folder, manifest, future)


def finish_save(acc: Accelerator, registry: Registry, *, close: bool = False
                ) -> Path | None:
    """Commit an asynchronous save once written (a collective); returns its folder, or None.
    `close`: then also end the writer process of ``async_save="process"`` saves (a later
    such save starts another)."""
    try:
        return _commit_pending(acc, registry)
    finally:
        if close and registry.save_stager is not None:
            close_writer_process()
            registry.save_stager.close()
            registry.save_stager = None


def _commit_pending(acc: Accelerator, registry: Registry) -> Path | None:
    pending, registry.pending_save = registry.pending_save, None
    if pending is None:
        return None
    tmp, folder, manifest, future = pending
    try:
        future.result()
        problem = None
    except Exception as err:  # (a writer process killed, a full disk: on any rank)
        text = str(err).strip()
        # (a writer process's death: every rank names the rank whose writer died)
        problem = (getattr(err, "rank", acc.process_index),
                   type(err).__name__ + (f": {text.splitlines()[-1][:200]}" if text else ""))
    problems = [problem]
    if mdist.is_initialized():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    failed = sorted(p for p in problems if p)
    if failed:
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        rank, why = failed[0]
        raise CheckpointError(f"the background save of {folder} failed on rank {rank} ({why}); "
                              "it was removed, the checkpoints before it are untouched")
    return commit(tmp, folder, manifest)


def load_state(acc: Accelerator, registry: Registry, input_dir=None, *,
               loaders: bool = True) -> Manifest:
    """Fill every prepared and registered object from `input_dir` (None: the newest automatic
    folder; `loaders`: the data loaders too); returns the checkpoint's manifest."""
    if input_dir is None:
        input_dir = _newest_folder(acc)
    finish_save(acc, registry)
    folder = Path(input_dir).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"load_state: {folder} is not a folder; give a checkpoint "
                              "written by save_state")
    # The file list, the sizes and the index's checksum now, on every rank; each data file's
    # checksum when the reader first opens it, before any of its bytes is read (a large
    # checkpoint is read from the disk once: the read after the check finds the page cache).
    check = start_verify(folder, hash_files=False)
    manifest = check.manifest
    index = read_index(folder)  # through the restricted unpickler, before anything else
    saved = set(index.state_dict_metadata)
    models = _models(acc, registry)
    templates = [ckstate.model_state(modules) for modules in models]
    _check_fits(acc, folder, manifest, models, templates)
    parts, finish = _read_plan(acc, registry, models, templates, manifest, saved,
                               loaders=loaders)
    check.result()
    load_dcp(parts, folder, index=index, manifest=manifest)
    saved_step = parts["accelerator"].get("step")
    if saved_step is not None and int(saved_step) != manifest.step:  # before anything is set
        raise CheckpointError(f"{folder}: manifest.json says step {manifest.step}, the "
                              f"checkpoint's data says step {int(saved_step)}; the manifest "
                              "was edited or belongs to another checkpoint")
    for done in finish:
        done()
    acc.runtime.files_written(step=False)  # (offload_params: the loaded weights, sealed)
    _restore_counters(acc, registry, parts, manifest)
    if mdist.is_initialized():
        settled_barrier()
    return manifest


def _check_fits(acc: Accelerator, folder: Path, manifest: Manifest, models, templates
                ) -> None:
    """Refuse a checkpoint of other models (names, shapes) or of fused q|k|v weights grouped
    for another tensor-parallel degree, before anything is read."""
    _check_models(folder, manifest, _shapes(models, pipeline=acc.layout.dims.pp > 1,
                                            states=templates))
    saved_tp, mine = manifest.model.get("regrouped_for_tp", 1), _regrouped(models)
    if saved_tp != mine:
        raise CheckpointError(f"{folder}: its fused q|k|v weights (GPT-2's c_attn) are stored "
                              f"head-grouped for tp={saved_tp}, this job groups them for "
                              f"tp={mine}; resume with tp={saved_tp}")


def _read_plan(acc: Accelerator, registry: Registry, models, templates, manifest: Manifest,
               saved: set[str], *, loaders: bool
               ) -> tuple[dict[str, Any], list[Callable[[], None]]]:
    """Every part's template (what one DCP read fills, in one plan, one pass over the files)
    and what then gives each object its part, in this order."""
    parts: dict[str, Any] = {}
    finish: list[Callable[[], None]] = []
    for i, modules in enumerate(models):
        key = _key("model", i)
        parts[key] = templates[i]
        finish.append(lambda modules=modules, key=key: ckstate.set_model_state(modules,
                                                                              parts[key]))
    ties = _ties(acc, registry) if registry.optimizers else []
    for i, opt in enumerate(registry.optimizers):
        key = _key("optimizer", i)
        parts[key], done = ckstate.optimizer_load_plan(
            _owner(models, opt.optimizer), opt.optimizer,
            alias=_alias(ties, manifest, saved, key))
        finish.append(done)
    for i, sched in enumerate(registry.schedulers):
        _plan_restore(parts, finish, _key("scheduler", i), sched.scheduler)
    for i, loader in enumerate(registry.loaders if loaders else ()):
        key = _key("dataloader", i)
        # Only the fields the checkpoint holds (older ones have no shuffle state).
        fields = {k: v for k, v in loader.state_dict().items()
                  if any(s == f"{key}.{k}" or s.startswith(f"{key}.{k}.") for s in saved)}
        _plan_restore(parts, finish, key, loader, fields)
    for i, obj in enumerate(registry.custom):
        _plan_restore(parts, finish, f"custom_{i}", obj)
    if acc.precision.scaler is not None:
        _plan_restore(parts, finish, "scaler", acc.precision.scaler)
    parts["accelerator"] = {"optimizer_steps": 0, "micro_step": 0}
    if "accelerator.step" in saved:  # (checkpoints before it have no copy)
        parts["accelerator"]["step"] = -1
    if manifest.world_size == acc.num_processes:
        parts["rng"] = {f"rank{acc.env.rank}": ckstate.rng_state()}
    return parts, finish


def _restore_counters(acc: Accelerator, registry: Registry, parts: dict[str, Any],
                      manifest: Manifest) -> None:
    """The step counters, and this rank's random generators when saved on as many ranks."""
    registry.optimizer_steps = int(parts["accelerator"]["optimizer_steps"])
    acc.grad_state.step = int(parts["accelerator"]["micro_step"])
    if "rng" in parts:
        ckstate.set_rng_state(parts["rng"][f"rank{acc.env.rank}"])
    else:
        # Another world size: rank r's generators did not exist. Random draws (dropout)
        # continue from this job's own seeds; everything else resumes exactly.
        log.info("meshfit: load_state: saved on %d processes, loading on %d; random "
                 "generators are not restored", manifest.world_size, acc.num_processes)


def _plan_restore(parts: dict, finish: list, key: str, obj, template: dict | None = None
                  ) -> None:
    """`obj`'s part of the one read: its ``state_dict()`` (or `template`) as the template,
    then ``obj.load_state_dict`` of what was read."""
    parts[key] = obj.state_dict() if template is None else template
    finish.append(lambda: obj.load_state_dict(parts[key]))


def _check_models(folder: Path, manifest: Manifest, mine: list[dict]) -> None:
    saved = manifest.model.get("shapes", [])
    if len(saved) != len(mine):
        raise CheckpointError(f"{folder}: holds {len(saved)} model(s), this job prepared "
                              f"{len(mine)}; prepare the same models before load_state")
    for i, (a, b) in enumerate(zip(saved, mine)):
        for name in sorted(set(a) | set(b)):
            if name not in a:
                raise CheckpointError(f"{folder}: model {i} has no parameter {name!r}; it is "
                                      "a checkpoint of another model")
            if name not in b:
                raise CheckpointError(f"{folder}: holds parameter {name!r}, which model {i} "
                                      "of this job lacks; it is a checkpoint of another model")
            if a[name] != b[name]:
                raise CheckpointError(f"{folder}: parameter {name!r} has shape {a[name]} in "
                                      f"the checkpoint, {b[name]} in this model")
