"""Griffe extension: render symmsync's reST-flavoured docstrings as Markdown in the API reference.

The docstrings are Google style, but two habits come from reStructuredText and would show
as written: a paragraph ending in ``::`` before an indented literal block (the block
renders as code either way; only the colon doubles), simple tables drawn with ``===``
rules, and Sphinx roles such as ``:class:`~symmsync.FenceTimeout``` (shown as code). This
rewrites them when the site is built; the source stays as it is. It also drops the lines
that mark a section for docs/hooks/includes.py (``--8<-- [start:contract]``): they name
what a page copies, not part of the text.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):`(~?)([^`]+)`")
_RULE = re.compile(r"^(\s*)(=+)(\s+=+)+\s*$")
_SECTION_MARKER = re.compile(r"-+8<-+[ \t]+\[[ \t]*(start|end)[ \t]*:")


def _columns(rule: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"=+", rule)]


def _cells(line: str, cols: list[tuple[int, int]]) -> list[str]:
    out = []
    for i, (start, _) in enumerate(cols):
        stop = cols[i + 1][0] if i + 1 < len(cols) else len(line)
        out.append(line[start:stop].strip())
    return out


def _tables(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _RULE.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        cols = _columns(lines[i])
        indent = m.group(1)
        j = i + 1
        rows: list[list[str]] = []
        rules = 1
        while j < len(lines) and rules < 3:
            if _RULE.match(lines[j]):
                rules += 1
            elif lines[j].strip():
                cells = _cells(lines[j], cols)
                if rows and not cells[0] and rules == 2:  # a continuation line of the row above
                    rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
                else:
                    rows.append(cells)
            j += 1
        if rules < 3 or len(rows) < 2:  # not a table after all
            out.append(lines[i])
            i += 1
            continue
        out.append(indent + "| " + " | ".join(rows[0]) + " |")
        out.append(indent + "|" + "---|" * len(cols))
        out += [indent + "| " + " | ".join(r) + " |" for r in rows[1:]]
        i = j
    return out


def _role(m: re.Match) -> str:
    name = m.group(2).split(".")[-1] if m.group(1) else m.group(2)
    return f"`{name}`"


def _markdown(text: str) -> str:
    text = _ROLE.sub(_role, text)
    lines = [re.sub(r"(\S)::$", r"\1:", line) for line in text.splitlines() if not _SECTION_MARKER.search(line)]
    return "\n".join(_tables(lines))


class RstDocstrings(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _markdown(obj.docstring.value)
