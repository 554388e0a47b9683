"""Every measured figure in README.md and docs/ appears in the committed result file it cites.

The marking: a figure is *measured* when it sits in a sentence, or in a table whose caption (the
paragraph right above it) cites a result file, as a path in backticks or a link:
`benchmarks/results/<file>`, `raw/<file>` (short for benchmarks/results/raw/) or `results/<file>`
(how the site serves benchmarks/results/). The figures of such a sentence or table are its numbers
with a decimal point, and its whole numbers followed by a unit of time, bandwidth or share (µs, ms,
s, GB/s, TB/s, %); versions (2.11.0), dates, bounds (≤ 25 µs), counts and configuration sizes are
not figures. Each figure must be a number of a cited file, to the precision printed: 2.21 matches
2.2103 in a JSON or 2.21 in a raw log. A sentence that cites nothing presents no measurement;
figures kept without a surviving source sit under a heading that says "Unsourced history".

On performance.md and in the README, every table of figures has a cited caption, and every sentence
that gives a time in µs with decimals either cites its file or sits under such a heading, so that a
new number cannot land there without its source. benchmarks/results/raw/README.md names the machine and date of
every raw file.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
STRICT = [ROOT / "README.md", ROOT / "docs" / "performance.md"]  # every figure there must cite its file

CITATION = re.compile(r"(?:benchmarks/results/|raw/|results/)[\w.-]+\.(?:json|txt)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
# A number not glued to a word (h200x2, sm_90, fp8, 4k), with an optional unit after it.
NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)*)(?![\w.]*\d)(?![A-Za-z_])\s?(µs|ms|s\b|GB/s|TB/s|%)?")
FILE_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z*(\[`])")
UNSOURCED = re.compile(r"^#+ .*unsourced history", re.I)


def _resolve(citation: str) -> Path:
    for prefix, folder in (("benchmarks/results/", RESULTS), ("raw/", RESULTS / "raw"), ("results/", RESULTS)):
        if citation.startswith(prefix):
            return folder / citation[len(prefix) :]
    raise AssertionError(citation)


def figures(text: str) -> list[str]:
    """The measured figures of a sentence or table, as printed (see the module's docstring)."""
    text = LINK_TARGET.sub("]", CODE_SPAN.sub(" ", text))
    found = []
    for m in NUMBER.finditer(text):
        number, unit = m.group(1), m.group(2)
        if number.count(".") > 1 or re.match(r"-\d\d", text[m.end(1) : m.end(1) + 3]):
            continue  # a version, or a date's year
        if re.search(r"[≤≥<>]\s*$", text[: m.start()]):
            continue  # a bound (a target, a limit), not a measurement
        if "." in number or unit:
            found.append(number)
    return found


def _paragraphs(page: Path):
    """(first line, lines, under an "Unsourced history" heading) for each paragraph, list item and
    table of a page, outside code blocks and comments; a heading yields (line, None, ...)."""
    current: list[str] = []
    start, in_code, in_comment, unsourced = 0, False, False, False
    for n, line in enumerate(page.read_text().splitlines() + [""], 1):
        stripped = line.strip()
        in_code ^= stripped.startswith("```")
        if in_comment or stripped.startswith("<!--"):
            in_comment = "-->" not in stripped
            continue
        heading = stripped.startswith("#") and not in_code
        new_item = stripped.startswith(("- ", "* ", "!")) or re.match(r"\d+\. ", stripped)
        table_edge = current and stripped.startswith("|") != current[-1].startswith("|")
        if current and (not stripped or in_code or heading or new_item or table_edge):
            yield start, current, unsourced
            current = []
        if heading:
            unsourced = bool(UNSOURCED.match(stripped))
            yield n, None, unsourced
        elif stripped and not in_code and not stripped.startswith("```"):
            start = start if current else n
            current.append(stripped)


def _blocks(page: Path):
    """(line, text, citations, unsourced, is a table) for each table (its caption's citations
    included) and each prose sentence of a page."""
    caption = ""
    for start, lines, unsourced in _paragraphs(page):
        if lines is None:  # a heading: a table right after it has no caption
            caption = ""
            continue
        text = " ".join(lines)
        if lines[0].startswith("|"):
            yield start, text, CITATION.findall(caption) + CITATION.findall(text), unsourced, True
        else:
            for sentence in SENTENCE_END.split(text):
                yield start, sentence, CITATION.findall(sentence), unsourced, False
        caption = text


def _values(path: Path) -> list[float]:
    return [float(x) for x in FILE_NUMBER.findall(path.read_text(errors="replace"))]


def missing(figures_: list[str], files: list[Path]) -> list[str]:
    """The figures that no cited file holds, to the precision printed."""
    values = [v for f in files for v in _values(f)]
    out = []
    for figure in figures_:
        places = len(figure.partition(".")[2])
        if not any(abs(v - float(figure)) <= 0.5 * 10**-places + 1e-9 for v in values):
            out.append(figure)
    return out


def _cited_blocks():
    assert PAGES[1:], f"docs/**/*.md matched no page under {ROOT / 'docs'}"
    for page in PAGES:
        for line, text, citations, _unsourced, _table in _blocks(page):
            if citations:
                yield page.relative_to(ROOT), line, text, citations


def test_pages_cite_result_files():
    assert sum(1 for _ in _cited_blocks()) >= 20


def test_every_cited_result_file_is_committed_under_benchmarks_results():
    bad = [f"{page}:{line}: {c}" for page, line, _, cs in _cited_blocks() for c in cs if not _resolve(c).is_file()]
    assert not bad, f"these pages cite result files that do not exist: {bad}"


def test_every_measured_figure_appears_in_the_file_it_cites():
    bad = []
    for page, line, text, citations in _cited_blocks():
        lost = missing(figures(text), [_resolve(c) for c in citations if _resolve(c).is_file()])
        if lost:
            bad.append(f"{page}:{line}: {lost} not in {citations}: {text[:120]}")
    assert not bad, "figures that their cited files do not hold:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", STRICT, ids=lambda p: p.name)
def test_every_figure_of_the_performance_pages_cites_its_file(page):
    bad = []
    for line, text, citations, unsourced, table in _blocks(page):
        timed = [f for f in figures(text) if "." in f] if table else re.findall(r"\d\.\d+\s?µs", text)
        if timed and not citations and not unsourced:
            bad.append(f"{page.name}:{line}: {text[:120]}")
    assert not bad, (
        "these give measured numbers without citing a file under benchmarks/results/ "
        "(cite it in the sentence or the table's caption, or move it under an 'Unsourced history' heading):\n"
        + "\n".join(bad)
    )


def test_every_raw_file_has_its_machine_and_date_in_the_index():
    index = (RESULTS / "raw" / "README.md").read_text()
    rows = {}
    for m in re.finditer(r"^\| `([\w.-]+)` \|([^|]*)\|([^|]*)\|", index, re.M):
        rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip())
    raw = sorted(path for path in (RESULTS / "raw").iterdir() if path.name != "README.md")
    assert raw, "benchmarks/results/raw/ holds no result file besides README.md"
    for path in raw:
        assert path.name in rows, f"benchmarks/results/raw/README.md does not list {path.name}"
        machine, date = rows[path.name]
        assert machine and re.fullmatch(r"\d{4}-\d\d-\d\d", date), (
            f"benchmarks/results/raw/README.md: give the machine and the date (YYYY-MM-DD) of {path.name}"
        )


def test_the_check_finds_a_figure_its_file_does_not_hold(tmp_path):
    log = tmp_path / "run.txt"
    log.write_text("symmsync Fence.fence()  2.2103  7.30\nhost 11.66 us, 69.7%\n")
    sentence = "A fence took 2.21 µs in graph replay and 7.3 µs eagerly (≤ 5 µs; torch 2.11.0, 2026-11-30), 70% of 9."
    assert figures(sentence) == ["2.21", "7.3", "70"]
    assert missing(figures(sentence), [log]) == []
    assert missing(["2.31", "11.7", "11.6"], [log]) == ["2.31", "11.6"]
