"""The documentation cannot show code that does not run, nor a copy that differs from its source.

Every ```python block in docs/ is either a copy of a file (or a marked section of one)
under examples/, which tests/tooling/test_examples.py runs, or is titled as a fragment
that is not run. A page holds a copy between marker lines that name its source, written
there by docs/hooks/includes.py so that the repository shows the code the site shows;
every copy equals its source as it is now, and every numbered example appears on a page.
docs/design.md's module graph and "used by" column equal what docs/hooks/imports.py reads
from the imports. `make docs` (mkdocs build --strict) checks links and references.
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
FRAGMENT = re.compile(r'^ title="Fragment: [^"]+\(not run\)"$')


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


includes = _hook("includes")
imports = _hook("imports")


def _python_blocks():
    assert PAGES, f"docs/**/*.md matched no page under {ROOT / 'docs'}"
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]  # the line above the fence
            copy = includes.BEGIN.match(before)
            yield page.relative_to(ROOT), m.group("info"), m.group("body"), copy and copy.group("source")


def _copies():
    # Every copy of python code in the pages, as (page, path, section).
    for page, _info, _body, source in _python_blocks():
        if source:
            path, _, section = source.partition(":")
            yield page, path, section or None


def test_the_docs_have_python_blocks_to_check():
    assert len(list(_python_blocks())) >= 10


def test_every_python_block_is_a_copy_of_an_example_or_is_titled_as_a_fragment():
    bad = []
    for page, info, body, source in _python_blocks():
        lines = body.strip().splitlines()
        if FRAGMENT.match(info) or source:
            continue
        bad.append(f"{page}: {lines[:1]}")
    assert not bad, (
        'python blocks must be copies of examples/ (write a fence holding `--8<-- "examples/..."` and run '
        f"python docs/hooks/includes.py; the tests run those files) or be titled "
        f'```python title="Fragment: ... (not run)"; these are neither: {bad}'
    )


def test_every_copy_names_an_existing_example_and_section():
    seen = 0
    for page, path, section in _copies():
        seen += 1
        assert path.startswith("examples/"), f"{page} copies {path}: show code from examples/ only"
        src = ROOT / path
        assert src.is_file(), f"{page} copies {path}, which does not exist"
        if section:
            text = src.read_text()
            for kind in ("start", "end"):
                assert f"# --8<-- [{kind}:{section}]" in text, f"{page}: {path} has no [{kind}:{section}] marker"
    assert seen


def test_every_numbered_example_is_shown_on_a_page():
    shown = {path for _, path, _ in _copies()}
    examples = sorted((ROOT / "examples").glob("[0-9][0-9]_*.py"))
    assert examples, "examples/[0-9][0-9]_*.py matched no file"
    for example in examples:
        assert f"examples/{example.name}" in shown, f"no page shows examples/{example.name}"


def test_every_tutorial_page_shows_its_numbered_example():
    pages = sorted((ROOT / "docs" / "tutorials").glob("[0-9][0-9]-*.md"))
    assert pages, "docs/tutorials/[0-9][0-9]-*.md matched no page"
    for page in pages:
        number = page.name[:2]
        assert re.search(rf"^<!-- from examples/{number}_[a-z_]+\.py", page.read_text(), re.M), (
            f"{page.name} shows no code"
        )


def test_every_copy_on_a_page_is_its_source_as_it_is_now():
    # The README's program is one too (examples/torchrun_job.py's job).
    assert includes.stale() == [], "run python docs/hooks/includes.py: these pages hold stale copies"


def test_no_page_holds_an_include_that_the_repository_would_show_as_a_bare_line():
    bare = [
        f"{page.relative_to(ROOT)}:{n}"
        for page in includes.pages()
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if line.strip().startswith("--8<--")
    ]
    assert not bare, f"run python docs/hooks/includes.py to turn these includes into copies: {bare}"


def test_a_copy_is_rewritten_from_its_section_and_found_stale_when_it_differs(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# x\n")
    (tmp_path / "src.py").write_text(
        'def f():\n    """Doc.\n\n    --8<-- [start:part]\n    a  b\n      c\n    --8<-- [end:part]\n    """\n'
    )
    page = tmp_path / "docs" / "page.md"
    page.write_text('Text.\n\n```text\n--8<-- "src.py:part"\n```\n\nMore.\n')
    assert includes.stale(tmp_path) == ["docs/page.md"]  # an include not yet rendered is stale
    text, copies = includes.render(page, tmp_path)
    assert text.split("\n")[2:8] == [
        "<!-- from src.py:part (generated: python docs/hooks/includes.py; edit the source, not this copy) -->",
        "```text",
        "a  b",  # dedented, as the site showed a docstring's section
        "  c",
        "```",
        "<!-- end -->",
    ]
    assert [(c.path, c.section, c.info) for c in copies] == [("src.py", "part", "text")]
    page.write_text(text)
    assert includes.stale(tmp_path) == []
    page.write_text(text.replace("  c", "  d"))  # a copy edited by hand
    assert includes.stale(tmp_path) == ["docs/page.md"]
    (tmp_path / "src.py").write_text("no section here\n")
    with pytest.raises(includes.IncludeError, match=r"src.py has no \[start:part\]"):
        includes.stale(tmp_path)


def test_the_design_page_module_graph_and_used_by_column_are_read_from_the_imports():
    assert imports.render() == (ROOT / "docs" / "design.md").read_text(), "run python docs/hooks/imports.py"


def test_the_import_reader_sees_late_type_only_and_either_or_imports(tmp_path):
    pkg = tmp_path / "symmsync"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__", "a", "b", "c", "d", "sub/__init__"):
        (pkg / f"{name}.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text(
        "from typing import TYPE_CHECKING\nfrom .. import a\nfrom ..b import x\n"
        "if TYPE_CHECKING:\n    from ..c import Y\n"
        "if a.flag:\n    from .. import c as impl\nelse:\n    from .. import d as impl\n"
        "def f():\n    import symmsync.d\n    from . import z\n"
    )
    edges = imports.graph(tmp_path)["sub.leaf"]
    assert (edges.load, edges.late, edges.typing) == ({"a", "b", "c | d"}, {"d", "sub"}, {"c"})


def test_the_built_site_links_pages_as_files_so_it_works_opened_from_disk():
    # With directory URLs, a page is dir/index.html and links name dir/: opened from disk
    # (file://), such a link shows the directory's listing instead of the page.
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^use_directory_urls: false$", config, re.M), "mkdocs.yml must set use_directory_urls: false"
