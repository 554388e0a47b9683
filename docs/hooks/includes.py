"""Copy included code into the pages, so that the repository shows what the site shows.

A page shows a file of examples/, or a marked section of a file (a tutorial's code, the
memory-model contract of ``symmsync/language/__init__.py``), as a copy between two marker lines::

    <!-- from examples/02_fences.py:step (generated: python docs/hooks/includes.py; edit the source, not this copy) -->
    ```python
    ...the section, as the source has it...
    ```
    <!-- end -->

The source stays the one home of the text: this script rewrites every copy from it, and
``--check`` (run by tests/tooling/test_docs.py) fails while a copy differs. To show a new
section, write a fence holding one include line, as pymdownx.snippets spells it, and run
the script; it turns the fence into a copy::

    ```python
    --8<-- "examples/02_fences.py:step"
    ```

A section is the lines between ``--8<-- [start:NAME]`` and ``--8<-- [end:NAME]`` (marker
lines of other sections left out), dedented; a whole file is shown without its marker
lines. Trailing blank lines are dropped. The fence keeps the language and title the page
gave it, and is made longer than any run of backticks in the text.

Usage: ``python docs/hooks/includes.py`` rewrites the copies; ``--check`` only lists the
stale ones and exits 1 if there are any.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "python docs/hooks/includes.py"
BEGIN = re.compile(r"^<!-- from (?P<source>\S+) \(generated: [^)]*\) -->$")
END = "<!-- end -->"
INCLUDE = re.compile(r'^--8<-- "(?P<source>[^"]+)"$')
SOURCE = re.compile(r"^(?P<path>[^:]+)(?::(?P<section>[a-z][-_0-9a-z]*))?$")
SECTION_MARKER = re.compile(r"-+8<-+[ \t]+\[[ \t]*(?P<kind>start|end)[ \t]*:[ \t]*(?P<name>[a-z][-_0-9a-z]*)[ \t]*\]")
FENCE = re.compile(r"^(?P<ticks>`{3,})(?P<info>[^`]*)$")


class IncludeError(Exception):
    """A copy or an include names a file or a section that does not exist, or is malformed."""


@dataclass(frozen=True)
class Copy:
    """One copy of a source's text on a page.

    Attributes:
        page: the page, relative to the repository root.
        line: the 1-based line of its begin marker (or of the include's fence, before the first run).
        path: the source file, relative to the repository root.
        section: the marked section of it, or None for the whole file.
        info: what follows the fence's backticks (``python``, ``text``, ``python title="..."``).
    """

    page: str
    line: int
    path: str
    section: str | None
    info: str

    @property
    def source(self) -> str:
        """The source as the markers name it: ``path`` or ``path:section``."""
        return f"{self.path}:{self.section}" if self.section else self.path


def pages(root: Path = ROOT) -> list[Path]:
    """Every page that may hold copies: docs/**/*.md and the README."""
    return sorted((root / "docs").rglob("*.md")) + [root / "README.md"]


def source_text(root: Path, path: str, section: str | None, where: str) -> str:
    """The text a copy of ``path`` (or of its ``section``) shows.

    Raises:
        IncludeError: the file, or the section's start or end marker, is missing.
    """
    src = root / path
    if not src.is_file():
        raise IncludeError(f"{where}: {path} does not exist; point the copy at the file that holds the text now")
    lines = src.read_text().split("\n")
    if section is None:
        kept = [line for line in lines if not SECTION_MARKER.search(line)]
    else:
        kept, inside, ended = [], False, False
        for line in lines:
            m = SECTION_MARKER.search(line)
            if m and m.group("name") == section:
                if m.group("kind") == "end" and inside:
                    ended = True
                    break
                inside = inside or m.group("kind") == "start"
            elif inside and not m:
                kept.append(line)
        if not ended:
            raise IncludeError(
                f"{where}: {path} has no [start:{section}] ... [end:{section}] section; "
                "point the copy at the file that holds the section now"
            )
        kept = textwrap.dedent("\n".join(kept)).split("\n")
    while kept and not kept[-1].strip():
        kept.pop()
    return "\n".join(kept)


def _parse_source(text: str, where: str) -> tuple[str, str | None]:
    m = SOURCE.match(text)
    if not m:
        raise IncludeError(f"{where}: {text!r} is not path or path:section")
    return m.group("path"), m.group("section")


def _block(copy: Copy, text: str) -> list[str]:
    runs = [len(r) for r in re.findall(r"`{3,}", text)]
    ticks = "`" * max([3] + [n + 1 for n in runs])
    marker = f"<!-- from {copy.source} (generated: {COMMAND}; edit the source, not this copy) -->"
    return [marker, ticks + copy.info, *text.split("\n"), ticks, END]


def render(page: Path, root: Path = ROOT) -> tuple[str, list[Copy]]:
    """The page's text with every copy (and every fenced include) rewritten from its source.

    Returns:
        The new text and the copies it holds, in page order.

    Raises:
        IncludeError: a copy is not closed, has no fence, or names a missing source or section;
            or an include line stands outside a fence of its own, where it would show nothing.
    """
    name = str(page.relative_to(root))
    lines = page.read_text().split("\n")
    out: list[str] = []
    copies: list[Copy] = []
    i = 0
    while i < len(lines):
        where = f"{name}:{i + 1}"
        begin = BEGIN.match(lines[i])
        fence = FENCE.match(lines[i])
        include = INCLUDE.match(lines[i + 1]) if fence and i + 2 < len(lines) else None
        if begin:
            path, section = _parse_source(begin.group("source"), where)
            opener = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if not opener:
                raise IncludeError(f"{where}: a copy's begin marker must be followed by its fence (```python)")
            try:
                stop = lines.index(END, i + 1)
            except ValueError:
                raise IncludeError(f"{where}: the copy of {begin.group('source')} has no {END} line") from None
            info, i = opener.group("info"), stop + 1
        elif include and lines[i + 2] == fence.group("ticks"):
            path, section = _parse_source(include.group("source"), where)
            info, i = fence.group("info"), i + 3
        elif fence:  # any other fence is the page's own text, include lines in it too
            close = next((j for j in range(i + 1, len(lines)) if lines[j] == fence.group("ticks")), len(lines) - 1)
            out += lines[i : close + 1]
            i = close + 1
            continue
        else:
            if INCLUDE.match(lines[i].strip()):
                raise IncludeError(f"{where}: an include outside a fence of its own; write it as a fenced block")
            out.append(lines[i])
            i += 1
            continue
        copy = Copy(name, len(out) + 1, path, section, info)
        out += _block(copy, source_text(root, path, section, where))
        copies.append(copy)
    return "\n".join(out), copies


def copies(root: Path = ROOT) -> list[Copy]:
    """Every copy on every page, as the pages will hold them once rendered."""
    return [c for page in pages(root) for c in render(page, root)[1]]


def stale(root: Path = ROOT) -> list[str]:
    """The pages whose copies differ from their sources (or that still hold fenced include lines)."""
    return [str(p.relative_to(root)) for p in pages(root) if render(p, root)[0] != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="list the stale pages, exit 1 if any; write nothing")
    args = parser.parse_args(argv)
    try:
        if args.check:
            bad = stale()
            for name in bad:
                print(f"{name}: a copy differs from its source; run {COMMAND}", file=sys.stderr)
            return 1 if bad else 0
        for page in pages():
            text, _ = render(page)
            if text != page.read_text():
                page.write_text(text)
                print(f"rewrote {page.relative_to(ROOT)}")
    except IncludeError as e:
        print(f"includes: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
