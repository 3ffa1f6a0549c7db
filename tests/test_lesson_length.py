"""Each lesson is read in one sitting: at most 2,500 markdown words and 40 minutes of reading.

Words: whitespace-separated tokens of all markdown cells of the instructor copy (the student copy has the same
markdown). Reading time, a simple stated model of what a student reads and looks at, once through:

* prose at 238 words a minute (the average silent reading rate of English non-fiction, Brysbaert 2019, "How many
  words do we read per minute?", J. Memory and Language 109);
* code: 10 s per code cell plus 2 s per non-blank line of its source, as the student copy shows it (stubs, not the
  instructor's solutions: writing them is the exercise, not reading);
* 30 s per figure or interactive view (an image or a widget in a stored output);
* 0.5 s per line of printed text in the stored outputs (tables and listings are scanned, not read word by word;
  library source printed into a lesson counts here).

Cheap: it reads sixteen notebooks' JSON.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb") if re.match(r"\d\d_", p.name))
MAX_WORDS = 2500
MAX_MINUTES = 40.0
WORDS_PER_MINUTE = 238
SECONDS_PER_CODE_CELL, SECONDS_PER_CODE_LINE = 10, 2
SECONDS_PER_FIGURE = 30
SECONDS_PER_PRINTED_LINE = 0.5
FIGURE_TYPES = ("image/png", "image/svg+xml", "image/jpeg", "application/vnd.jupyter.widget-view+json")


def _printed_lines(output) -> int:
    if output.output_type == "stream":
        return len(output.text.rstrip("\n").split("\n"))
    data = output.get("data", {})
    if "text/plain" in data and not any(kind in data for kind in FIGURE_TYPES):
        return len(data["text/plain"].rstrip("\n").split("\n"))
    return 0


def reading(instructor: Path, student: Path | None = None) -> dict:
    """Words, figures, code and printed lines of one lesson, and the minutes the model above gives them."""
    lesson = nbformat.read(instructor, as_version=4)
    shown = nbformat.read(student, as_version=4) if student and student.exists() else lesson
    words = sum(len(cell.source.split()) for cell in lesson.cells if cell.cell_type == "markdown")
    code = [cell for cell in shown.cells if cell.cell_type == "code"]
    code_lines = sum(1 for cell in code for line in cell.source.split("\n") if line.strip())
    outputs = [output for cell in lesson.cells if cell.cell_type == "code" for output in cell.outputs]
    figures = sum(1 for output in outputs if any(kind in output.get("data", {}) for kind in FIGURE_TYPES))
    printed = sum(_printed_lines(output) for output in outputs)
    seconds = (words / WORDS_PER_MINUTE * 60 + SECONDS_PER_CODE_CELL * len(code)
               + SECONDS_PER_CODE_LINE * code_lines + SECONDS_PER_FIGURE * figures + SECONDS_PER_PRINTED_LINE * printed)
    return {"words": words, "code cells": len(code), "code lines": code_lines, "figures": figures,
            "printed lines": printed, "minutes": round(seconds / 60, 1)}


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_is_read_in_one_sitting(path):
    counts = reading(path, ROOT / "notebooks" / "student" / path.name)
    print(path.stem, counts)
    assert counts["words"] <= MAX_WORDS, f"{path.name}: {counts['words']} markdown words (at most {MAX_WORDS}): {counts}"
    assert counts["minutes"] <= MAX_MINUTES, (f"{path.name}: {counts['minutes']} minutes of reading (at most "
                                              f"{MAX_MINUTES:g}): {counts}")


def test_the_count_sees_words_code_figures_and_printed_lines(tmp_path):
    """The model on a made-up lesson whose reading time is known: 476 words (2 min), 2 code cells of 4 lines in all (28 s),
    a figure (30 s), 8 printed lines (4 s): 182 s."""
    lesson = nbformat.v4.new_notebook()
    lesson.cells = [nbformat.v4.new_markdown_cell(" ".join(["word"] * 400)),
                    nbformat.v4.new_code_cell("a = 1\n\nb = 2\nprint(a)"),
                    nbformat.v4.new_markdown_cell("word " * 76),
                    nbformat.v4.new_code_cell("plot()\n")]
    lesson.cells[1].outputs = [nbformat.v4.new_output("stream", text="1\n" * 8)]
    lesson.cells[3].outputs = [nbformat.v4.new_output("display_data", data={"image/png": "", "text/plain": "<Figure>"})]
    path = tmp_path / "99_made_up.ipynb"
    nbformat.write(lesson, path)
    assert reading(path) == {"words": 476, "code cells": 2, "code lines": 4, "figures": 1, "printed lines": 8,
                             "minutes": 3.0}
