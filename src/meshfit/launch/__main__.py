"""``python -m meshfit.launch ARGS``: a worker's entry, as torch's agent starts each worker
under `meshfit.launch.run` (see `meshfit.launch.torchrun.enter_worker`)."""

import sys

from meshfit.launch.torchrun import enter_worker

enter_worker(sys.argv[1:])
