"""Write docs/design.md's module graph, and the "used by" column of its facts table, from the imports.

Every module under symmsync/ is read with ``ast`` (nothing is imported). An edge is an
import of another symmsync module: at the top of a module (made while it loads), inside a
function (*late*: made when the function runs) or under ``if TYPE_CHECKING:`` (``..>``,
for type hints only). A top-level ``if``/``else`` that imports one module in each branch
is one edge to either, written ``a | b``. ``from . import name`` is an edge to the
submodule ``name`` where there is one, else to the package itself.

The graph block is the fenced block after the line that begins "Now, read from the imports"
in docs/design.md; it ends with the circles of imports that run while modules load and
those that pass through a late import. The "used by" column of the table headed
``| fact | its one home | used by |`` lists, for each row, the modules (and ``examples``,
``benchmarks``) that import one of the row's home modules or use one of the names it
gives: the home is the run of backticked items that opens the "its one home" cell, with
a parenthesis right after it that opens with a backticked item. An item ``x.py`` or
``pcp/x.py`` is a module; ``Fence.kernel_args`` or ``buf.capabilities`` an attribute (any
``.kernel_args`` counts); ``driver()`` or ``MainKVLayout`` a name (imported or read).

Usage: ``python docs/hooks/imports.py`` rewrites both in docs/design.md; ``--check`` only
says whether they differ and exits 1 if they do; ``--print`` prints the graph block.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "python docs/hooks/imports.py"
DESIGN = "docs/design.md"
GRAPH_INTRO = "Now, read from the imports"
LAYERS_INTRO = "The layers, read from the imports"
TABLE_HEADER = "| fact | its one home | used by |"
OUTSIDE = ("examples", "benchmarks")  # users outside the package, named by their folder
WIDTH = 110
NOTHING = "(nothing of symmsync)"


@dataclass
class Edges:
    """One module's imports of other symmsync modules.

    Attributes:
        load: modules imported while it loads; an entry ``a | b`` is one of two, chosen by an ``if``.
        late: modules imported inside a function.
        typing: modules imported under ``if TYPE_CHECKING:``.
        names: every name it imports or reads as an attribute (``x.name``).
        defines: every name it defines (a function, a class, an assignment to ``name`` or ``x.name``).
    """

    load: set[str] = field(default_factory=set)
    late: set[str] = field(default_factory=set)
    typing: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)
    defines: set[str] = field(default_factory=set)

    def key(self) -> tuple:
        return tuple(tuple(sorted(s)) for s in (self.load, self.late, self.typing))


def module_name(path: Path, package: Path) -> str:
    """``symmsync`` for the package, else the dotted name inside it (``pcp.writer``, ``backends``)."""
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or "symmsync"


def _is_package(name: str, package: Path) -> bool:
    return name == "symmsync" or (package / name.replace(".", "/") / "__init__.py").is_file()


def _exists(name: str, package: Path) -> bool:
    return _is_package(name, package) or (package / (name.replace(".", "/") + ".py")).is_file()


def _inside(dotted: str) -> str | None:
    """``symmsync.x.y`` as ``x.y``; ``symmsync`` as itself; None for any other package."""
    if dotted == "symmsync":
        return dotted
    return dotted.removeprefix("symmsync.") if dotted.startswith("symmsync.") else None


def _targets(node: ast.Import | ast.ImportFrom, me: str, package: Path) -> set[str]:
    if isinstance(node, ast.Import):
        return {t for a in node.names if (t := _inside(a.name)) is not None}
    if node.level == 0:
        base = _inside(node.module or "")
        if base is None:
            return set()
    else:
        parts = [] if me == "symmsync" else me.split(".")
        if not _is_package(me, package):
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        base = ".".join(parts) or "symmsync"
    out = set()
    for alias in node.names:
        sub = alias.name if base == "symmsync" else f"{base}.{alias.name}"
        out.add(sub if _is_package(base, package) and _exists(sub, package) else base)
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_in(nodes: list[ast.stmt], me: str, package: Path) -> set[str]:
    return {t for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom)) for t in _targets(n, me, package)}


def _walk(nodes: list[ast.stmt], me: str, package: Path, edges: Edges, kind: str) -> None:
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            getattr(edges, kind).update(_targets(node, me, package) - {me})
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _walk(node.body, me, package, edges, "typing" if kind == "typing" else "late")
        elif isinstance(node, ast.If) and _type_checking(node.test):
            _walk(node.body, me, package, edges, "typing")
            _walk(node.orelse, me, package, edges, kind)
        elif isinstance(node, ast.If) and kind == "load":
            one, other = _imports_in(node.body, me, package), _imports_in(node.orelse, me, package)
            if len(one) == 1 and len(other) == 1 and one != other:  # one module or the other, chosen once
                edges.load.add(" | ".join(sorted(one | other, key=_order)))
                continue
            _walk(node.body, me, package, edges, kind)
            _walk(node.orelse, me, package, edges, kind)
        else:  # a class body, try, with, for, while, match: their imports run when they do
            for name in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, name, None) or []:
                    inner = child.body if isinstance(child, (ast.ExceptHandler, ast.match_case)) else [child]
                    _walk(inner, me, package, edges, kind)


def _names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The names a module imports or reads as attributes, and those it defines."""
    used, defined = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            (defined if isinstance(node.ctx, ast.Store) else used).add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.ImportFrom):
            used.update(a.name for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
    return used, defined


def read(path: Path, package: Path) -> Edges:
    """The edges of the module at ``path``, a file under ``package`` (the symmsync folder)."""
    tree = ast.parse(path.read_text(), str(path))
    used, defined = _names(tree)
    edges = Edges(names=used, defines=defined)
    _walk(tree.body, module_name(path, package), package, edges, "load")
    return edges


def graph(root: Path = ROOT) -> dict[str, Edges]:
    """Every module of the package and its edges."""
    package = root / "symmsync"
    return {module_name(p, package): read(p, package) for p in sorted(package.rglob("*.py"))}


def _order(name: str) -> tuple:
    # Modules of the top level first, private ones after public ones, then by name.
    return (name.count("."), name.startswith("_"), name)


def _circles(g: dict[str, Edges], kinds: tuple[str, ...]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (Tarjan), each sorted, in order."""
    adj = {m: {t for k in kinds for e in getattr(g[m], k) for t in e.split(" | ") if t in g} for m in g}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for t in sorted(adj[m]):
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            members = []
            while True:
                t = stack.pop()
                members.append(t)
                if t == m:
                    break
            if len(members) > 1:
                out.append(sorted(members, key=_order))

    for m in sorted(g, key=_order):
        if m not in index:
            visit(m)
    return sorted(out, key=lambda c: _order(c[0]))


def _depth(g: dict[str, Edges]) -> dict[str, int]:
    """How many load-time imports lie below each module at most (a circle counted once)."""
    depth: dict[str, int] = {}

    def visit(m: str, path: frozenset) -> int:
        if m not in depth:
            below = [t for e in g[m].load for t in e.split(" | ") if t in g and t not in path]
            depth[m] = 1 + max((visit(t, path | {m}) for t in below), default=-1)
        return depth[m]

    for m in sorted(g):
        visit(m, frozenset())
    return depth


def _line(left: str, e: Edges) -> list[str]:
    """``left -> load; late: late  ..> typing``, wrapped under its first target."""
    glue = "\0"  # holds "late:" and "..>" to the target after them when wrapping
    text = ", ".join(sorted(e.load, key=_order))
    if e.late:
        text += ("; " if text else "") + f"late:{glue}" + ", ".join(sorted(e.late, key=_order))
    if e.typing:
        text += (f"  ..>{glue}" if text else f"..>{glue}") + ", ".join(sorted(e.typing, key=_order))
    # " | " joins the two modules of a choice: keep them on one line too.
    text = (text or NOTHING).replace(" | ", f"{glue}|{glue}")
    lines = textwrap.wrap(text, WIDTH, initial_indent=left, subsequent_indent=" " * len(left), break_on_hyphens=False)
    return [line.replace(glue, " ") for line in lines]


def _group(m: str, package: Path) -> str:
    # The package's own modules form the first group; each subpackage is one group after it.
    top = m.split(".")[0]
    return top if top != "symmsync" and _is_package(top, package) else ""


def graph_block(root: Path = ROOT) -> str:
    """The module graph as docs/design.md shows it.

    One line per module, or per set of modules of one group with the same imports; the
    package's own modules first, then each subpackage's, each group from the modules with
    the most load-time imports below them down to the leaves. Then the circles.
    """
    package = root / "symmsync"
    g = graph(root)
    depth = _depth(g)
    rows: dict[tuple, list[str]] = {}
    for m in sorted(g, key=lambda m: (_group(m, package), -depth[m], _order(m))):
        rows.setdefault((_group(m, package), g[m].key()), []).append(m)
    width = max(len(m) for m in g)
    lines = []
    for members in rows.values():
        lines += _line(f"{', '.join(members):<{width}} -> ", g[members[0]])
    at_load = _circles(g, ("load",))
    late = [c for c in _circles(g, ("load", "late")) if c not in at_load]
    lines.append("")
    lines.append("circles while loading: " + ("; ".join(", ".join(c) for c in at_load) or "none"))
    lines.append("circles through a late import: " + ("; ".join(", ".join(c) for c in late) or "none"))
    return "\n".join(lines)


def _folder(m: str, package: Path) -> str:
    """The folder (subpackage) a module lives in, or ``""`` for the top level."""
    parts = m.split(".")
    return parts[0] if len(parts) > 1 or (m != "symmsync" and _is_package(m, package)) else ""


def _summary(path: Path) -> str:
    """The first sentence of a module's docstring (up to its first period that ends a sentence)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split())
    text = re.sub(r":\w+:`~?\.?([^`]+)`", r"\1", text).replace("``", "")  # the roles' names, plainly
    m = re.search(r"\.(\s|$)", text)
    return (text[: m.start()] if m else text).strip()


def layers_block(root: Path = ROOT) -> str:
    """The layer picture as docs/design.md shows it: every folder, from the top down (a folder
    above every folder it imports), with the first sentence of its docstring, its modules and
    the folders it imports; then the top level's modules; then the circles between folders."""
    package = root / "symmsync"
    g = graph(root)
    folders: dict[str, list[str]] = {}
    for m in g:
        folders.setdefault(_folder(m, package), []).append(m)
    above: dict[str, set[str]] = {f: set() for f in folders}
    for m, e in g.items():
        for entry in (*e.load, *e.late, *e.typing):
            for t in entry.split(" | "):
                if t in g and _folder(t, package) != _folder(m, package) and _folder(t, package):
                    above[_folder(m, package)].add(_folder(t, package))
    depth: dict[str, int] = {}

    def visit(f: str, path: frozenset) -> int:
        if f not in depth:
            depth[f] = 1 + max((visit(t, path | {f}) for t in above[f] if t not in path), default=-1)
        return depth[f]

    for f in folders:
        visit(f, frozenset())
    lines = []
    for f in sorted((f for f in folders if f), key=lambda f: (-depth[f], f)):
        doc = _summary(package / f / "__init__.py")
        lines += textwrap.wrap(f"{f}/  {doc}", WIDTH, subsequent_indent="    ")
        mods = ", ".join(sorted((m.split(".", 1)[1] for m in folders[f] if "." in m), key=_order)) or "-"
        lines += textwrap.wrap(f"modules: {mods}", WIDTH, initial_indent="    ", subsequent_indent="      ")
        imports = ", ".join(f"{t}/" for t in sorted(above[f], key=lambda t: (-depth[t], t))) or "nothing of the folders"
        lines += textwrap.wrap(f"imports: {imports}", WIDTH, initial_indent="    ", subsequent_indent="      ")
    top = sorted(folders[""], key=_order)
    lines += textwrap.wrap(
        "top level: " + ", ".join(top) + " (the package's face, what every layer raises and checks with, the test runner)",
        WIDTH,
        subsequent_indent="    ",
    )
    adj = {f: above[f] for f in folders if f}
    circles = [c for c in _circles({f: Edges(load=adj[f]) for f in adj}, ("load",))]
    lines.append("")
    lines.append("circles between folders: " + ("; ".join(", ".join(c) for c in circles) or "none"))
    return "\n".join(lines)


HOME_ITEM = re.compile(r"`([^`]+)`")


def home_items(cell: str) -> list[str]:
    """The backticked items that open a "its one home" cell, and a parenthesis right after them
    that opens with a backticked item: ``"`core/failure.py` (`view.failure`)"`` gives both."""
    items, rest = [], cell.strip()
    while True:
        m = re.match(r"(?:[,;]\s*|\(\s*(?=`)|\)\s*)?`([^`]+)`\s*", rest) if items or rest.startswith("`") else None
        if not m:
            return items
        items.append(m.group(1))
        rest = rest[m.end() :]
        if rest.startswith(")"):
            rest = rest[1:].lstrip()


def readers(root: Path = ROOT) -> dict[str, Edges]:
    """Every module of the package, and every file of examples/ and benchmarks/ (as
    ``examples/name.py``), with what it imports and reads."""
    package = root / "symmsync"
    out = graph(root)
    for folder in OUTSIDE:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            used, defined = _names(tree)
            e = Edges(names=used, defines=defined)
            for node in ast.walk(tree):  # outside the package, only absolute imports reach it
                if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0):
                    e.load.update(_targets(node, "", package))
            out[f"{folder}/{path.relative_to(root / folder)}"] = e
    return out


def users(items: list[str], everyone: dict[str, Edges]) -> list[str]:
    """The modules (and ``examples``, ``benchmarks``) that import a module among ``items``, or
    import or read a name or attribute among them that they do not define themselves; the home
    modules left out. A function's users (an item ``driver()``) are its module's importers.

    Args:
        items: a home's items, as :func:`home_items` gives them.
        everyone: what :func:`readers` gives.
    """
    modules = {i.removesuffix(".py").replace("/", ".") for i in items if i.endswith(".py")}
    modules = {m.removesuffix(".__init__") if m != "__init__" else "symmsync" for m in modules}
    names = {i.split(".")[-1] for i in items if not i.endswith((".py", "()"))}
    found = set()
    for reader, e in everyone.items():
        imported = {t for s in (e.load, e.late, e.typing) for entry in s for t in entry.split(" | ")}
        if reader not in modules and (imported & modules or (e.names & names) - e.defines):
            found.add(reader.split("/")[0])
    return sorted(found, key=lambda m: (m in OUTSIDE, _order(m)))


def _table_rows(lines: list[str]) -> range:
    start = next((i for i, line in enumerate(lines) if line.strip() == TABLE_HEADER), None)
    if start is None:
        raise ValueError(f"{DESIGN} has no table headed {TABLE_HEADER!r}")
    stop = next((i for i in range(start + 2, len(lines)) if not lines[i].startswith("|")), len(lines))
    return range(start + 2, stop)


def render(root: Path = ROOT) -> str:
    """docs/design.md with its graph block and its "used by" column written from the imports.

    Raises:
        ValueError: the page lacks the graph's introduction, its fenced block or the table; or a
            row's home names nothing this script can read.
    """
    lines = (root / DESIGN).read_text().split("\n")
    intro = next((i for i, line in enumerate(lines) if line.startswith(GRAPH_INTRO)), None)
    if intro is None:
        raise ValueError(f"{DESIGN} has no paragraph beginning {GRAPH_INTRO!r}")
    opening = next(i for i in range(intro, len(lines)) if lines[i].startswith("```"))
    closing = next(i for i in range(opening + 1, len(lines)) if lines[i] == "```")
    lines[opening + 1 : closing] = graph_block(root).split("\n")
    layers = next((i for i, line in enumerate(lines) if line.startswith(LAYERS_INTRO)), None)
    if layers is None:
        raise ValueError(f"{DESIGN} has no paragraph beginning {LAYERS_INTRO!r}")
    opening = next(i for i in range(layers, len(lines)) if lines[i].startswith("```"))
    closing = next(i for i in range(opening + 1, len(lines)) if lines[i] == "```")
    lines[opening + 1 : closing] = layers_block(root).split("\n")
    everyone = readers(root)
    for i in _table_rows(lines):
        cells = lines[i].split(" | ")
        items = home_items(cells[1])
        if len(cells) != 3 or not items:
            raise ValueError(f"{DESIGN}:{i + 1}: a row needs a backticked home and three cells: {lines[i]!r}")
        for item in items:
            if item.endswith(".py") and not (root / "symmsync" / item).is_file():
                raise ValueError(f"{DESIGN}:{i + 1}: symmsync/{item} does not exist; name the fact's home as it is now")
        cells[2] = (", ".join(users(items, everyone)) or "(none)") + " |"
        lines[i] = " | ".join(cells)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help=f"exit 1 if {DESIGN} differs; write nothing")
    parser.add_argument("--print", action="store_true", help="print the graph block; write nothing")
    args = parser.parse_args(argv)
    if args.print:
        print(graph_block())
        return 0
    page = ROOT / DESIGN
    try:
        text = render()
    except ValueError as e:
        print(f"imports: {e}", file=sys.stderr)
        return 2
    if text == page.read_text():
        return 0
    if args.check:
        print(
            f"{DESIGN}: the module graph or the used-by column differs from the imports; run {COMMAND}", file=sys.stderr
        )
        return 1
    page.write_text(text)
    print(f"rewrote {DESIGN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
