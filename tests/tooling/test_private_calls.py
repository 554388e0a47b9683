"""No module of symmsync calls another module's private method.

Read with ``ast`` (nothing is imported): a private method is a ``_name`` (not a dunder) defined
in a class of some module; a call of it is an attribute ``x._name`` on anything but ``self`` or
``cls``. Such an access outside every module that defines ``_name`` reaches into another
module's object: the caller should use a public, checked entry point instead (the torch ops
call ``eager``, ``eager_dispatch``, ``eager_write``, ``launch_now``).
"""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "symmsync"


def _private_methods(trees):
    defined = defaultdict(set)  # name -> modules whose classes define it
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        name = item.name
                        if name.startswith("_") and not name.startswith("__"):
                            defined[name].add(path)
    return defined


def private_calls_across_modules(root=ROOT):
    trees = {p.relative_to(root.parent).as_posix(): ast.parse(p.read_text()) for p in sorted(root.rglob("*.py"))}
    defined = _private_methods(trees)
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr not in defined:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if path not in defined[node.attr]:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)} (defined in {sorted(defined[node.attr])})")
    return found


def test_the_reader_finds_modules_and_private_methods():
    trees = {p: ast.parse(p.read_text()) for p in ROOT.rglob("*.py")}
    assert len(trees) > 50, f"read {len(trees)} modules under {ROOT}"
    assert len(_private_methods({str(p): t for p, t in trees.items()})) > 50


def test_no_module_calls_another_modules_private_method():
    found = private_calls_across_modules()
    assert found == [], "calls of another module's private method:\n" + "\n".join(found)


def test_the_check_bites(tmp_path):
    pkg = tmp_path / "symmsync"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "class A:\n    def _run(self):\n        return 1\n    def run(self):\n        return self._run()\n"
    )
    (pkg / "b.py").write_text("def use(a):\n    return a._run()\n")
    assert private_calls_across_modules(pkg) == ["symmsync/b.py:2: a._run (defined in ['symmsync/a.py'])"]
