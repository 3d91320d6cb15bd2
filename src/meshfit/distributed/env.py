"""This process's place in the job: its ranks, its device and its process group (`init()`
reads torchrun's environment variables: see the package docstring)."""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "cpu_requested", "init", "is_initialized"]


def is_initialized() -> bool:
    """Whether this process is in a process group: the one spelling of torch's two-part
    question (a build without distributed support has no `is_initialized` to ask)."""
    return dist.is_available() and dist.is_initialized()


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its ranks, its device and the backend of its process group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: a single process with no process group
    restart: int = 0
    """How often the launcher's agent has restarted this job's workers (torchrun's
    TORCHELASTIC_RESTART_COUNT; 0 on the first attempt)."""

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; "
                         "launch with `meshfit launch` or torchrun, which set it") from None


_CPU_ENV = "MESHFIT_CPU"


def cpu_requested(cpu: bool | None) -> bool:
    if cpu is not None:
        return bool(cpu)
    value = os.environ.get(_CPU_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"environment variable {_CPU_ENV}={value!r} must be 1/true or 0/false")


def init(backend: str | None = None, timeout_s: float = 1800.0, *,
         cpu: bool | None = None) -> DistEnv:
    """Join the process group that torchrun (or `meshfit launch`) described.

    Picks NCCL and ``cuda:LOCAL_RANK`` when CUDA is available, gloo and the CPU otherwise.
    ``cpu=True`` (or the environment variable ``MESHFIT_CPU=1``) keeps to the CPU and gloo
    even where CUDA is available, as Accelerate's ``cpu=True`` does. With no launcher (no
    WORLD_SIZE), returns a single-process environment without creating a process group.
    Calling it again returns the same description.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        _check_launch_variables(world_size, rank, local_rank, local_world_size)
    cuda = torch.cuda.is_available() and not cpu_requested(cpu)
    if backend is not None and backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r} is not supported; use 'nccl' (GPUs) or 'gloo' (CPU)")
    if backend == "nccl" and not cuda:
        raise ValueError("backend='nccl' needs CUDA, which is not available here (or cpu=True / "
                         f"{_CPU_ENV}=1 was asked for); use backend='gloo'")
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA "
                             "devices are visible; start at most that many processes per node, "
                             f"or set {_CPU_ENV}=1 to run every process on the CPU")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "WORLD_SIZE" not in os.environ and not dist.is_initialized():
        return DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device,
                       backend=None)
    chosen = backend or ("nccl" if cuda else "gloo")
    restart = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(
                backend=chosen, timeout=timeout,
                # device_id binds NCCL's communicator eagerly to this rank's GPU.
                device_id=device if device.type == "cuda" else None,
                **_attempt_store(rank, world_size, restart, timeout))
        except (dist.DistStoreError, dist.DistNetworkError) as err:  # bounded by timeout_s
            raise TimeoutError(
                f"rank {rank}: the {world_size} ranks did not all join the process group "
                f"within timeout_s={timeout_s:g} s ({str(err).splitlines()[0]}); another rank "
                "failed or is stuck before joining (see its error), or start-up really takes "
                "longer: raise timeout_s ([train] timeout_s)") from None
    else:
        chosen = dist.get_backend()
        world_size, rank = dist.get_world_size(), dist.get_rank()
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank,
                   local_world_size=local_world_size, device=device, backend=chosen,
                   restart=restart)


def _check_launch_variables(world_size: int, rank: int, local_rank: int,
                            local_world_size: int) -> None:
    """One-line ValueError for a launcher environment that cannot describe a job (left over
    from another job, or set by hand), before any wait on other ranks."""
    fix = ("unset them, or start the processes with `meshfit launch` or torchrun, which set "
           "them consistently")
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE={world_size} must be >= 1; {fix}")
    if "RANK" not in os.environ:
        raise ValueError(f"WORLD_SIZE={world_size} is set but RANK is not; {fix}")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is not in 0..{world_size - 1} (WORLD_SIZE={world_size}); "
                         f"{fix}")
    if not 1 <= local_world_size <= world_size or not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world_size} do not fit "
                         f"WORLD_SIZE={world_size} (0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= "
                         f"WORLD_SIZE); {fix}")
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(n)]
    if world_size > 1 and missing:
        raise ValueError(f"WORLD_SIZE={world_size} needs {' and '.join(missing)} (the address "
                         f"of rank 0's store); {fix}")
    port = _env_int("MASTER_PORT", 1)
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={port} must be in 1..65535; {fix}")


def _attempt_store(rank: int, world_size: int, restart: int,
                   timeout: datetime.timedelta) -> dict:
    """Keyword arguments of `init_process_group` that keep each restart's keys apart.

    Under torchrun's agent the workers use the agent's store (TORCHELASTIC_USE_AGENT_STORE),
    and that store outlives a restart: torch's own `env://` path adds no per-attempt prefix,
    so the restarted ranks read the addresses the dead attempt published and fail with gloo
    "connectFullMesh ... Connection refused" (measured with torch 2.13: 3 of 3 restarts after
    a worker was killed). Every key of this attempt (default group and sub-groups alike) goes
    under ``meshfit/attempt_<restart>/`` instead. Without the agent store: torch's own path."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return {}
    store = dist.TCPStore(host_name=os.environ["MASTER_ADDR"], port=_env_int("MASTER_PORT", 0),
                          world_size=world_size, is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"meshfit/attempt_{restart}", store), "rank": rank,
            "world_size": world_size}


# What the backends say when the other end of a collective has gone (its process died or was
# killed): gloo's TCP pairs, NCCL's communicator after a peer's failure, the store.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote process exited", "ncclRemoteError", "NCCL communicator was aborted",
              "Socket Timeout", "failed to recv, got 0 bytes", "Connection refused")


def peer_lost(err: BaseException) -> str | None:
    """The backend's reason, in one line, when `err` says another rank of the job has gone
    (its own failure is what to report, by the launcher); None for any other error."""
    text = " ".join(str(err).split())
    if not isinstance(err, (RuntimeError, OSError)) or not any(p in text for p in _PEER_LOST):
        return None
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)  # the C++ source location
    text = text.split(". This is typically")[0]  # gloo's advice: the launcher names the rank
    return text if len(text) <= 200 else text[:197] + "..."
