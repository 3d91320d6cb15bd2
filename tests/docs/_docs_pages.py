"""The manual's pages read as the docs tests need them: fenced blocks with the comment before
each one that says how it is tested, the shell commands in a block, headings and their
anchors (GitHub's and MkDocs' spellings), links, and the test and benchmark paths a page
cites."""

from __future__ import annotations

import re
import shlex
import textwrap
import unicodedata
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"
MKDOCS_YML = REPO / "mkdocs.yml"

SHELL = ("", "bash", "sh", "shell", "console", "text")
"""Info strings of blocks whose lines may be commands."""
MARKERS = ("run after", "run", "test", "not run")
"""``<!-- run -->``, ``<!-- run after: CODE -->``, ``<!-- test: CODE -->``,
``<!-- not run: REASON -->``: how the block after the comment is tested."""

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_MARKER = re.compile(r"<!--\s*(run after|run|test|not run)\b(:?)(.*)-->", re.S)
# A line that starts a meshfit command: "meshfit SUBCOMMAND ...", "meshfit --flag", a bare
# "meshfit", also under srun; not an output line such as "meshfit train: chat ...".
_COMMAND = re.compile(r"^(?:srun\s+)?meshfit(?:\s+--?[\w-]+(?=\s|$)|\s+[a-z][\w-]*(?=\s|$)|$)")
_CITED = re.compile(r"(?<![\w./-])((?:tests|benchmarks|scripts|examples)/[\w./-]*[\w/])"
                    r"(?:::(\w+))?")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    """The README and every page of the manual."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


@dataclass(frozen=True)
class Block:
    """One fenced block of a page, and the marker comment just before it (if any)."""

    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None  # one of MARKERS, "malformed" for another comment, None for none
    marker_text: str  # the code, commands or reason after the marker's colon

    @property
    def id(self) -> str:
        return f"{rel(self.path)}:{self.line}"

    def commands(self) -> list[list[str]]:
        """The block's meshfit command lines, each as its argv after ``meshfit``."""
        return command_lines(self.text) if self.lang in SHELL else []

    @property
    def needs_marker(self) -> bool:
        return self.lang in ("python", "py", "toml") or bool(self.commands())


def blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start, body = i, []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence)
                                      and not lines[i].strip().strip(fence[0])):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent)
                        else lines[i].lstrip())
            i += 1
        i += 1
        marker, marker_text = _marker(lines, start)
        out.append(Block(path, start + 1, lang, "\n".join(body), marker, marker_text))
    return out


def _marker(lines: list[str], fence: int) -> tuple[str | None, str]:
    """The HTML comment that ends on the last non-blank line before the fence."""
    end = fence - 1
    while end >= 0 and not lines[end].strip():
        end -= 1
    if end < 0 or not lines[end].rstrip().endswith("-->"):
        return None, ""
    begin = end
    while begin >= 0 and not lines[begin].lstrip().startswith("<!--"):
        begin -= 1
    if begin < 0:
        return None, ""
    comment = "\n".join(lines[begin:end + 1]).strip()
    m = _MARKER.fullmatch(comment)
    if not m:
        return "malformed", comment
    kind, colon, rest = m.groups()
    if (kind == "run") == bool(colon) or (kind == "run" and rest.strip()):
        return "malformed", comment  # "run" alone; the others with a colon and a text
    return kind, textwrap.dedent(rest).strip("\n")


def logical_lines(text: str) -> list[str]:
    """Shell lines with their backslash continuations joined."""
    out, current = [], ""
    for line in text.splitlines():
        line = line.rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append((current + line).strip())
        current = ""
    if current.strip():
        out.append(current.strip())
    return [line for line in out if line]


def command_lines(text: str) -> list[list[str]]:
    out = []
    for line in logical_lines(text):
        line = line.removeprefix("$ ")
        if line.startswith("#") or not _COMMAND.match(line):
            continue
        argv = shlex.split(line, comments=True)
        out.append(argv[2:] if argv[0] == "srun" else argv[1:])
    return out


# ---------------------------------------------------------------- headings, anchors, links
def headings(path: Path) -> list[str]:
    """The page's headings, outside fenced blocks."""
    out, fence = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(2)
            elif line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            continue
        if fence is None and (h := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            out.append(h.group(1))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = heading.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def mkdocs_slug(heading: str) -> str:
    """The anchor MkDocs gives it (Python-Markdown's ``toc.slugify``)."""
    text = unicodedata.normalize("NFKD", heading.replace("`", ""))
    text = text.encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    """Anchors that work both on GitHub and in the built site."""
    return {github_slug(h) for h in headings(path) if github_slug(h) == mkdocs_slug(h)}


def links(path: Path) -> list[str]:
    """Relative link targets of a page, outside fenced blocks."""
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^(\s*)(`{3,}|~{3,}).*?^\1\2\s*$", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][\w+.-]*:", t)]


def cited(path: Path) -> list[tuple[str, str | None]]:
    """The repository paths (tests, benchmarks, scripts, examples) a page cites, each with
    the ``::test_name`` after it, if any."""
    return _CITED.findall(path.read_text(encoding="utf-8"))
