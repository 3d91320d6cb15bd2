"""``python -m meshfit COMMAND [ARGS...]``: the ``meshfit`` command (`meshfit.cli.main`)."""

import sys

from meshfit.cli.main import main

sys.exit(main())
