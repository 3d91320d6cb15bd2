"""The launcher behind `meshfit launch` and `meshfit train`: torch.distributed.run (torchrun's
elastic agent), run in this process on the argument list meshfit builds, with safer defaults:

* a single-node job binds its rendezvous to 127.0.0.1 on a free port (torchrun's default is
  29500 on every interface, which collides between jobs);
* ``--gpus 0,2`` chooses the devices and their order;
* every argument is checked before any process starts (a --master-port in use included);
* a single-node job with ``--max-restarts`` is restarted by meshfit, the whole group with a new
  agent on a fresh loopback port per attempt (multi-node jobs keep torchrun's restarts);
* workers die with the launcher (Linux's parent-death signal), Ctrl-C or SIGTERM end the job
  with one line, and a failure is summed up in one line naming the rank that failed first;
* `accelerate launch`'s common flags work beside meshfit's own, with Accelerate's meaning,
  and inside a SLURM job its ``SLURM_*`` variables give what the flags leave open.

    resolve.py    `LaunchConfig` (what to start where) from the flags, accelerate's flags,
                  SLURM and the defaults; the GPUs the workers see
    slurm.py      what a SLURM job's variables say (node lists, tasks per node, rendezvous)
    torchrun.py   torchrun's arguments; `run`: the job through torch.distributed.run; its
                  rendezvous stores on loopback only; node 0's port checked before starting;
                  each worker's start, stopping them, the one-line failure summary
    __main__.py   ``python -m meshfit.launch``: the entry torch's agent runs for each worker
    finished.py   exit code 0 means finished: code a command calls cannot end its process
                  (``os._exit(0)``, ``os.exec*``), and workers mark that they finished

No module imports torch when it loads: a bad flag is refused before torch is imported. The
command lines are in `meshfit.cli.launch`.
"""

from meshfit.launch.resolve import LaunchConfig, config_from_args, gpu_environment
from meshfit.launch.slurm import expand_nodelist, expand_tasks_per_node
from meshfit.launch.torchrun import loopback_stores, master_port_in_use, run

__all__ = ["LaunchConfig", "config_from_args", "expand_nodelist", "expand_tasks_per_node",
           "gpu_environment", "loopback_stores", "master_port_in_use", "run"]
