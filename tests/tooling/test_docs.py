"""The documentation cannot show code that does not run.

Every ```python block in docs/ is either an include of a file (or a marked section of
one) under examples/, which tests/tooling/test_examples.py runs, or is titled as a fragment
that is not run. Every include resolves, and every numbered example appears on a page.
`make docs` (mkdocs build --strict) checks links and references.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
INCLUDE = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<section>[a-z][-_0-9a-z]*))?"$')
FRAGMENT = re.compile(r'^ title="Fragment: [^"]+\(not run\)"$')


def _python_blocks():
    for page in PAGES:
        for m in FENCE.finditer(page.read_text()):
            yield page.relative_to(ROOT), m.group("info"), m.group("body")


def _includes():
    for page, _info, body in _python_blocks():
        for line in body.strip().splitlines():
            m = INCLUDE.match(line.strip())
            if m:
                yield page, m.group("path"), m.group("section")


def test_the_docs_have_python_blocks_to_check():
    assert len(list(_python_blocks())) >= 10


def test_every_python_block_includes_an_example_or_is_titled_as_a_fragment():
    bad = []
    for page, info, body in _python_blocks():
        lines = body.strip().splitlines()
        if FRAGMENT.match(info):
            continue
        if not lines or not all(INCLUDE.match(line.strip()) for line in lines):
            bad.append(f"{page}: {lines[:1]}")
    assert not bad, (
        'python blocks must be `--8<-- "examples/..."` includes (the tests run those files) or be titled '
        f'```python title="Fragment: ... (not run)"; these are neither: {bad}'
    )


def test_every_include_names_an_existing_example_and_section():
    seen = 0
    for page, path, section in _includes():
        seen += 1
        assert path.startswith("examples/"), f"{page} includes {path}: include code from examples/ only"
        src = ROOT / path
        assert src.is_file(), f"{page} includes {path}, which does not exist"
        if section:
            text = src.read_text()
            for kind in ("start", "end"):
                assert f"# --8<-- [{kind}:{section}]" in text, f"{page}: {path} has no [{kind}:{section}] marker"
    assert seen


def test_every_numbered_example_is_shown_on_a_page():
    shown = {path for _, path, _ in _includes()}
    for example in sorted((ROOT / "examples").glob("[0-9][0-9]_*.py")):
        assert f"examples/{example.name}" in shown, f"no page includes examples/{example.name}"


def test_every_tutorial_page_includes_its_numbered_example():
    for page in sorted((ROOT / "docs" / "tutorials").glob("[0-9][0-9]-*.md")):
        number = page.name[:2]
        assert re.search(rf'--8<-- "examples/{number}_[a-z_]+\.py', page.read_text()), f"{page.name} shows no code"


def test_the_built_site_links_pages_as_files_so_it_works_opened_from_disk():
    # With directory URLs, a page is dir/index.html and links name dir/: opened from disk
    # (file://), such a link shows the directory's listing instead of the page.
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^use_directory_urls: false$", config, re.M), "mkdocs.yml must set use_directory_urls: false"
