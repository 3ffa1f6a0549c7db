"""What a student reads is what the course measured: every figure in an instructor notebook's markdown is printed by
code, registered with the computation that makes it true (tests/prose_registry.py), or given with its reason; a stale
figure fails and names its notebook and cell (tests/prose_figures.py says what counts as a figure)."""

import copy
import random
import re

import pytest

from lessonlib import results
from lessonlib.results import Op
from tests import prose_figures as prose
from tests.prose_generated import GENERATED
from tests.prose_registry import FIGURES

NOTEBOOKS = sorted(p.stem for p in prose.NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_figure_is_printed_registered_or_given_and_every_registered_figure_holds(name):
    problems = prose.problems(name, FIGURES)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", prose.student_facing_files())
def test_every_figure_lessonlib_shows_a_student_is_computed_or_registered_and_holds(path):
    problems = prose.generated_problems(path, GENERATED)
    assert not problems, "\n".join(problems)


def test_every_entry_names_a_notebook_and_gives_its_reasons():
    for entry in FIGURES:
        assert entry.notebook in NOTEBOOKS, entry
        if isinstance(entry, (prose.Holds, prose.Given)) or getattr(entry, "within", None) is not None:
            assert entry.why, entry


def planted(name: str, cell: str, old: str, new: str) -> list:
    """A copy of a notebook's cells with ``old`` replaced by ``new`` in one cell."""
    cells = copy.deepcopy(prose.notebook(name).cells)
    target = next(c for c in cells if c.get("id") == cell)
    assert old in target.source, (cell, old)
    target.source = target.source.replace(old, new)
    return cells


def test_a_stale_number_planted_in_a_cell_fails_and_names_the_notebook_and_the_cell():
    stale = f"{random.uniform(2, 9):.1f}x"  # fresh each run; the byte ratio is 5.25, so never this
    stale = "2.2x" if stale == "5.3x" else stale
    cells = planted("01_operator_fusion", "82f80785", "Eager moves 5.3x the bytes", f"Eager moves {stale} the bytes")
    problems = prose.problems("01_operator_fusion", FIGURES, cells)
    index = next(i for i, c in enumerate(cells) if c.get("id") == "82f80785")
    mine = [p for p in problems if f"notebooks/01_operator_fusion.ipynb cell {index} (82f80785)" in p]
    assert any("no longer says 'Eager moves 5.3x the bytes'" in p for p in mine), problems
    assert any(f"the figure '{stale}' is neither printed by code nor registered" in p for p in mine), problems


def test_a_figure_registered_with_the_stale_text_fails_on_its_computed_value():
    cells = planted("01_operator_fusion", "f0907044", "counted nine", "counted eight")
    stale = prose.Measured("01_operator_fusion", "f0907044", "the profiler counted eight kernels on the H200",
                           "eight kernels", lambda: 9)
    problems = prose.problems("01_operator_fusion", (stale,), cells)
    assert any("the text says 'eight kernels' (8) but the source gives 9" in p for p in problems), problems


def test_every_measured_figure_fails_when_the_source_moves_past_its_band():
    for entry in [e for e in FIGURES if isinstance(e, prose.Measured)]:
        band = prose.rounding(entry.figure) if entry.within is None else entry.within
        moved = prose.Measured(entry.notebook, entry.cell, entry.quote, entry.figure,
                               lambda e=entry, b=band: e.measured() + 2 * b + 1)
        cells = {c.get("id"): (0, c.source) for c in prose.notebook(entry.notebook).cells}
        assert prose.check_entry(moved, cells), entry


def test_a_verdict_that_does_not_hold_fails():
    entry = prose.Holds("02_flash_attention", "52eb79e3", "cuDNN is faster", lambda: False, "planted")
    cells = {c.get("id"): (0, c.source) for c in prose.notebook("02_flash_attention").cells}
    assert "does not hold" in prose.check_entry(entry, cells)[0]


def test_the_patterns_find_each_kind_of_figure_and_skip_code_and_latex():
    text = ("Eager is slower: 15% of 4,226 GB/s in nine kernels, 5.3x the bytes, ×0.65, about 21, a few percent, "
            "half the speed; `7 GB` and $3x$ and [a](x/8%) are not read; near-ties are not a verdict.")
    found = [f for _, f in prose.figures(text)]
    assert found == ["slower", "15%", "4,226 GB/s", "nine kernels", "5.3x", "×0.65", "about 21", "a few percent",
                     "half the"], found
    text = ("## 3. A heading\n1. A list item: lesson 02, section 6, §7, exercise 3 and sm_90 name places; 132 "
            "multiprocessors, 65 reads, at most 255 and 16 as a default are figures; T=8192 is a shape; SDPA runs "
            "in one launch, and one fused launch saves little; the two cost the same; a gap of a few such steps.")
    found = [f for _, f in prose.figures(text)]
    assert found == ["132", "65", "at most 255", "16", "one launch", "one fused launch", "saves little",
                     "cost the same", "a few such steps"], found
    assert [f for _, f in prose.figures("program_id(0) + 1 is one fused launch", bare=False)] == ["one fused launch"]


def test_a_figure_rounds_to_its_last_printed_digit():
    assert prose.value("4,226 GB/s") == 4226 and prose.rounding("4,226 GB/s") == 0.5
    assert prose.value("5.3x") == 5.3 and prose.rounding("5.3x") == pytest.approx(0.05)
    assert prose.value("nine kernels") == 9 and prose.rounding("nine kernels") == 0
    assert prose.value("5/3") == pytest.approx(5 / 3) and prose.value("15%") == 15


def test_no_lesson_talks_of_project_plumbing_or_an_unnamed_seed():
    """In markdown and in code (a comment or a printed line is read too): a student has no issue tracker."""
    plumbing = re.compile(r"\bissue \d+|\bthe seed\b|\bseed texts?\b|\bthe seeds?'s?\b", re.IGNORECASE)
    for name in NOTEBOOKS:
        for index, cell in enumerate(prose.notebook(name).cells):
            assert not plumbing.search(cell.source), (name, index, plumbing.search(cell.source).group(0))


def test_the_swiglu_sweep_comment_quotes_the_recorded_sweep():
    comment = (prose.ROOT / "lessonlib/ops/swiglu.py").read_text().split("BLOCK = 2048")[0].split("# Columns")[1]
    run = results.load("fusion-h200")
    sweep = [r["gbps"] for r in run.select(op=Op.SWIGLU, T=8192, I=14336) if r.get("sweep")]
    copy_gbps = run.one(op=Op.COPY, impl="copy (same bytes)", T=8192, I=14336)["gbps"]
    assert f"fastest, {max(sweep):,.0f} GB/s" in comment and f"{min(sweep):,.0f}" in comment, comment
    assert f"copy of the same bytes ran at {copy_gbps:,.0f} GB/s" in " ".join(comment.replace("#", "").split())



# --- planted stale text: each must be caught ------------------------------------------------------------------------

STALE = [  # (what the text said when the check was written, a stale version)
    ("132 multiprocessors", "114 multiprocessors"),
    ("65 reads", "97 reads"),
    ("at most 255", "at most 511"),
    ("16 is vLLM's default", "32 is vLLM's default"),
    ("the two cost the same", "the two cost the same"),  # a verdict planted where nothing registers it
    ("int8 weights saves little", "int8 weights saves little"),
]


def plant_anywhere(old: str, new: str) -> tuple[str, list, str]:
    """(notebook, its cells with ``new`` in place of ``old``, the cell's id): where the lessons still say ``old``,
    there; else ``new`` appended to a markdown cell of lesson 03, where nothing registers it."""
    for name in NOTEBOOKS:
        for cell in prose.notebook(name).cells:
            if cell.cell_type == "markdown" and old in prose.flat(cell.source):
                cells = copy.deepcopy(prose.notebook(name).cells)
                target = next(c for c in cells if c.get("id") == cell.get("id"))
                target.source = prose.flat(target.source).replace(old, new)
                return name, cells, cell.get("id")
    name = "03_paged_attention"
    cells = copy.deepcopy(prose.notebook(name).cells)
    target = next(c for c in cells if c.cell_type == "markdown")
    target.source += f"\n\nPlanted: {new}."
    return name, cells, target.get("id")


@pytest.mark.parametrize("old, new", STALE)
def test_the_stale_figures_a_reader_found_are_caught(old, new):
    name, cells, cell = plant_anywhere(old, new)
    problems = set(prose.problems(name, FIGURES, cells)) - set(prose.problems(name, FIGURES))
    figure = [f for _, f in prose.figures(new)][0]
    assert any(f"the figure {figure!r}" in p or "no longer says" in p for p in problems), problems


def test_a_vague_word_means_what_the_check_says_not_anything_up_to_four():
    """"a gap of a few such steps" for a gap of 0.8 of one step: "a few" is 2 to 5, and no entry may widen it."""
    cells = {"c": (0, "the top two logits are a gap of a few such steps apart")}
    said = "a gap of a few such steps"
    assert prose.check_entry(prose.Measured("06_vllm", "c", said, "a few such steps", lambda: 0.8), cells)
    assert not prose.check_entry(prose.Measured("06_vllm", "c", said, "a few such steps", lambda: 3.0), cells)
    widened = prose.Measured("06_vllm", "c", said, "a few such steps", lambda: 3.0, within=4.0, why="planted")
    assert "may not widen it" in prose.check_entry(widened, cells)[0]


def stale(figure: str) -> str:
    """``figure`` with its number moved: "nine kernels" -> "ten kernels", "5.3x" -> "6.3x", "15%" -> "16%";
    a verdict turned round: "faster" -> "slower"."""
    swaps = {"faster": "slower", "slower": "faster", "fastest": "slowest", "slowest": "fastest", "beats": "trails",
             "wins": "loses", "loses": "wins", "ties": "beats", "cost the same": "cost twice as much",
             "costs the same": "costs twice as much", "saves little": "saves much", "negligible": "large"}
    lower = figure.lower()
    for word, other in swaps.items():
        if lower == word:
            return other
    words = sorted(prose.NUMBER_WORDS, key=len, reverse=True)
    for word in words:
        if re.match(rf"{word}\b", lower):
            n = prose.NUMBER_WORDS[word] + 1
            spelled = next((w for w, v in prose.NUMBER_WORDS.items() if v == n), str(n))
            return spelled + figure[len(word):]
    number = re.search(prose._NUMBER, figure)
    if number:
        digits = number.group(0)
        last = re.search(r"(\d)(?!.*\d)", digits)
        moved = digits[:last.start()] + str((int(last.group(1)) + 1) % 10) + digits[last.end():]
        return figure[:number.start()] + moved + figure[number.end():]
    return "many times"  # a vague quantity: a claim of another size


def planted_entries():
    """Every registered figure and verdict (markdown and lessonlib's strings), once each."""
    for entry in (*FIGURES, *GENERATED):
        if isinstance(entry, prose.Measured):
            yield entry, entry.figure
        elif isinstance(entry, prose.Holds):
            verdicts = [f for _, f in prose.figures(entry.quote, bare=False) if re.fullmatch(r"[a-z ]+", f.lower())]
            if verdicts:
                yield entry, verdicts[0]


def test_every_registered_figure_and_verdict_planted_stale_in_its_text_is_caught():
    """The text edited, the data and the registry not: a count in words, a number, a verdict word, a legend or a
    table line that now says something else must fail, in the notebooks and in what lessonlib shows."""
    kinds = {"count in words": 0, "verdict": 0, "number": 0, "lessonlib's strings": 0}
    for entry, figure in planted_entries():
        wrong = stale(figure)
        if entry.notebook.endswith(".py"):
            source = (prose.ROOT / entry.notebook).read_text()
            assert figure in source, (entry, figure)
            before = set(prose.generated_problems(entry.notebook, GENERATED))
            problems = set(prose.generated_problems(entry.notebook, GENERATED, source.replace(figure, wrong)))
            problems -= before  # what the plant alone caused
            kinds["lessonlib's strings"] += 1
        else:
            cells = planted(entry.notebook, entry.cell, figure, wrong) if figure in next(
                c for c in prose.notebook(entry.notebook).cells if c.get("id") == entry.cell).source else None
            if cells is None:  # the figure spans a line break in the cell's source
                continue
            problems = set(prose.problems(entry.notebook, FIGURES, cells)) - set(prose.problems(entry.notebook, FIGURES))
            word = re.match(rf"(?:{prose._WORDS})\b", figure.lower())
            kinds["count in words" if word else "number" if re.search(r"\d", figure) else "verdict"] += 1
        assert problems, (entry, figure, wrong)
    assert all(n >= 3 for n in kinds.values()) and sum(kinds.values()) >= 10 + len(STALE), kinds
