"""Where the text comes from: the built-in corpus, user files, and the split by file.

The built-in corpus is the running interpreter's own standard library (``*.py`` under
``sysconfig.get_paths()["stdlib"]``): a dozen MB of real code on every machine that can run
this package, so a first training run needs no download and no network.

Folders named ``test``/``tests`` are left out of it, for two reasons: Debian and Ubuntu ship
``Lib/test`` as a separate package (``libpython3.X-testsuite``), so including it would make
the "same" corpus differ between installs of one Python version; and it holds deliberately
malformed files (bad encodings, bad syntax) and large generated fixtures that are poor
training text. ``site-packages`` is left out because it is whatever the user installed.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SourceFile", "Corpus", "stdlib_corpus_files", "data_source", "find_corpus",
           "is_validation"]

_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


@dataclass(frozen=True, kw_only=True)
class SourceFile:
    """One document of the corpus."""

    path: Path
    """Absolute path, used to read the file."""
    rel: str
    """Path relative to the corpus root with ``/`` separators: the file's identity for the
    split and the cache key, so both are the same wherever the corpus is mounted."""
    size: int
    """Size in bytes when the corpus was listed."""
    mtime_ns: int
    """Modification time when the corpus was listed; a change invalidates the cache."""


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """A sorted, de-duplicated list of files plus a description for the cache sidecar."""

    root: Path
    """The folder the ``rel`` paths are relative to (for a single file, its folder)."""
    description: str
    """Human-readable source, written to the sidecar JSON."""
    slug: str
    """Short name used in cache file names (``stdlib``, or the user path's basename)."""
    files: tuple[SourceFile, ...]
    """Files in sorted ``rel`` order: the order the token stream is written in."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def stdlib_corpus_files() -> list[Path]:
    """All ``*.py`` files of the running Python's standard library, sorted by relative path,
    without ``site-packages`` and test folders (see the module docstring for why)."""
    return [f.path for f in _stdlib_corpus().files]


def data_source(path: str | os.PathLike[str] | None = None,
                hf_dataset: str | os.PathLike[str] | None = None) -> str:
    """The rule for where a run's text comes from, and that source named as an error
    message spells it: ``data.hf_dataset=...`` (a ``datasets`` dataset on disk), else
    ``data.path=...`` (a text file or folder, which must exist), else the built-in corpus
    (``None`` and ``""`` are unset); never both. One-line ValueError otherwise."""
    path = "" if path is None else str(path)
    hf_dataset = "" if hf_dataset is None else str(hf_dataset)
    if hf_dataset and path:
        raise ValueError(f"data.path={path!r} and data.hf_dataset={hf_dataset!r} "
                         "are mutually exclusive; set only one of them")
    if hf_dataset:
        return f"data.hf_dataset={hf_dataset!r}"
    if not path:
        return "the built-in corpus (data.path unset)"
    if not Path(path).expanduser().exists():
        raise ValueError(f"data.path={path!r} does not exist; give a text file or a folder of "
                         "text files, or leave it empty for the built-in corpus")
    return f"data.path={path!r}"


def find_corpus(path: str | os.PathLike[str] | None) -> Corpus:
    """The built-in corpus for ``None``/``""``, else the user's text file or folder."""
    if path is None or str(path) == "":
        return _stdlib_corpus()
    data_source(path)  # one that exists
    p = Path(path).expanduser().resolve()
    if p.is_file():
        return Corpus(root=p.parent, description=f"file {p}", slug=_slug(p.name),
                      files=(_source_file(p, p.parent),))
    files = tuple(_source_file(f, p) for f in _walk(p, suffix=None, skip=frozenset(),
                                                    strict=f"data.path={str(path)!r}"))
    if not files:
        raise ValueError(f"data.path={str(path)!r} is a folder with no (non-hidden) files; put "
                         "text files in it or point data.path at a text file")
    return Corpus(root=p, description=f"folder {p}", slug=_slug(p.name), files=files)


def is_validation(rel: str, val_fraction: float) -> bool:
    """Stable per-file split: sha256 of the relative path, bucket mod 1000.

    Splitting by file rather than by position keeps near-duplicate text (a module and its
    copy, two halves of one file) from landing on both sides and inflating validation
    scores. sha256 rather than ``hash()``: Python's string hash is salted per process.
    """
    bucket = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big") % 1000
    return bucket < val_fraction * 1000


def _stdlib_corpus() -> Corpus:
    root = stdlib_root()
    files = tuple(_source_file(f, root)
                  for f in _walk(root, suffix=".py", skip=_STDLIB_SKIP_DIRS))
    return Corpus(root=root, description=f"python stdlib *.py under {root}", slug="stdlib",
                  files=files)


def _walk(root: Path, *, suffix: str | None, skip: frozenset[str],
          strict: str | None = None) -> list[Path]:
    """Files under ``root`` sorted by relative path, skipping ``skip`` and hidden entries
    (``.DS_Store``, ``.gitignore``: metadata, not text). Symlinked folders are not followed, so
    a link loop cannot hang the walk. With `strict` (the setting's name and value, for the
    message), a folder that cannot be listed is a one-line ValueError instead of silently
    missing text.
    """

    def unlisted(err: OSError) -> None:
        raise ValueError(f"{strict}: cannot list {err.filename} ({err.strerror or err}); make "
                         "it readable or point data.path elsewhere")

    found: list[tuple[str, Path]] = []
    for folder, dirs, names in os.walk(root, onerror=unlisted if strict else None):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip]
        for name in names:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            full = Path(folder, name)
            if full.is_file():  # drops broken links, sockets and fifos
                found.append((full.relative_to(root).as_posix(), full))
    found.sort(key=lambda item: item[0])
    return [full for _, full in found]


def _source_file(path: Path, root: Path) -> SourceFile:
    st = path.stat()
    return SourceFile(path=path, rel=path.relative_to(root).as_posix(), size=st.st_size,
                      mtime_ns=st.st_mtime_ns)


def _slug(name: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)
    return keep.strip("-")[:40] or "data"
