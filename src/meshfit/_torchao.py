"""Which torchao release works with which torch, and one line for a torchao that does not.

torchao declares no torch requirement on the package index, so pip installs its newest
release beside any torch. Before 0.17 each release is built against one torch release (its
Python API also runs on a few older ones); 0.17 and later need torch >= 2.11 (0.18 removed
the code paths for older torch: importing it on torch 2.9 fails with "cannot import name
'ScalingType' from 'torch.nn.functional'"). From torchao's compatibility table (pytorch/ao
issue 2919).

No torch import here: `scripts/torch-suite` runs this file to pick the torchao of a test
environment before meshfit is installed (``python src/meshfit/_torchao.py 2.9.1`` prints
``0.15.0``; nothing for a torch the newest torchao supports).
"""

from __future__ import annotations

import sys

# (torch major, minor[, patch]) -> the torchao release built against it.
_BUILT_FOR = {(2, 10): "0.16.0", (2, 9, 0): "0.14.1", (2, 9): "0.15.0", (2, 8): "0.13.0",
              (2, 7): "0.12.0", (2, 6): "0.12.0"}


def _release(version: str) -> tuple[int, ...]:
    public = version.split("+")[0]
    out = []
    for part in public.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out + [0] * (3 - len(out)))


def torchao_for(torch_version: str) -> str | None:
    """The torchao release to install beside `torch_version` (e.g. "2.9.1+cu128"), or None
    where the newest torchao supports it (torch >= 2.11)."""
    release = _release(torch_version)
    return _BUILT_FOR.get(release[:3]) or _BUILT_FOR.get(release[:2])


def torchao_error(use: str, err: BaseException) -> ValueError:
    """A one-line ValueError for torchao installed but not importable with this torch;
    `use` names what needed it (e.g. "float8=True")."""
    import importlib.metadata

    import torch

    try:
        have = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        have = "?"
    want = torchao_for(torch.__version__)
    fix = (f"pip install torchao=={want} (the release built for torch "
           f"{torch.__version__.split('+')[0]})" if want else "pip install --upgrade torchao")
    first = (str(err).splitlines() or [""])[0]
    return ValueError(f"{use}: torchao {have} does not import with torch {torch.__version__} "
                      f"({type(err).__name__}: {first}); {fix}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python _torchao.py TORCH_VERSION")
    print(torchao_for(sys.argv[1]) or "")
