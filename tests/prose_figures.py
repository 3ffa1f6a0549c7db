"""Every figure in the instructor notebooks' markdown, and why it is true.

A *figure* is what the patterns below find in a markdown cell: a number with a unit ("4,226 GB/s", "15%", "5.3x",
"9 passes"), a count in words ("nine kernels"), a vague quantity ("a few percent", "several times") or a verdict
("faster", "slower", "beats", "ties"). Each must lie inside the quote of one entry of ``FIGURES`` for its cell:

* ``Measured``: the figure, computed here from ``lessonlib/results/*.json``, a traffic model, or the notebook's
  stored outputs, must round to what the text says (or lie within the stated band);
* ``Holds``: a verdict, computed here the same way, must hold;
* ``Given``: a number that is not measured (a definition, a shape, a hardware constant with its source, a source
  text's quoted claim, a derivation the cell itself shows), with the reason.

A figure printed by code needs no entry: the markdown then has no number ("the line above prints ..."). Code spans,
LaTeX and link targets are not read. ``tests/test_prose_figures.py`` runs the check; the entries live in
``tests/prose_registry.py``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Callable

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

NUMBER_WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
                "eleven": 11, "twelve": 12, "a dozen": 12}
_WORDS = "|".join(NUMBER_WORDS)
FRACTION_WORDS = {"half": 1 / 2, "a third": 1 / 3, "a quarter": 1 / 4, "a tenth": 1 / 10}
_NUMBER = r"\d(?:[\d,]*\d)?(?:\.\d+)?"
_UNIT = (r"(?:µs|us|ms|ns|s|GB/s|TB/s|TFLOP/s|GiB|MiB|KiB|MB|GB|KB|TB|tokens?/s|tok/s|%|x|×|units?|FLOPs?|bytes?|"
         r"registers|passes|kernels?|launch(?:es)?)")
FIGURE = re.compile(rf"""
      (?<![\w.=/]) {_NUMBER} \s? {_UNIT} (?![\w/])             # a number with its unit: 4,226 GB/s, 15%, 5.3x
    | × \s? {_NUMBER}                                           # a factor written first: ×0.65
    | \b (?:about|around|roughly|nearly|almost|under|over|at\smost|at\sleast) \s {_NUMBER}   # about 21
    | \b (?:{_WORDS}) \s (?:\w+\s)? (?:kernels|launches|passes)\b   # a count in words: nine kernels
    | \b (?:a\sfew|several|tens\sof|a\shundred|hundreds\sof) \s (?:percent|times|microseconds|milliseconds)\b
    | \b (?:a\stenth|a\squarter|a\sthird|half) \s (?:of|the|as)\b      # a vague quantity: a few percent
    | (?<![\w-]) (?:faster|slower|fastest|slowest|beats?|loses|outruns?|ties)\b   # a verdict
""", re.IGNORECASE | re.VERBOSE)
# Not read: display and inline LaTeX, code spans, link targets, HTML tags.
UNREAD = re.compile(r"\$\$.*?\$\$|\$[^$]*\$|`[^`]*`|\]\([^)]*\)|<[^>]+>")


@dataclass(frozen=True)
class Measured:
    """``figure`` (a part of ``quote``) must equal ``measured()`` to its last printed digit, or within ``within``."""
    notebook: str
    cell: str  # the cell's id
    quote: str  # the text around the figure, as the cell has it (whitespace aside)
    figure: str
    measured: Callable[[], float]
    within: float | None = None  # None: half a unit in the figure's last digit
    why: str = ""  # the reason for a band, where ``within`` is given


@dataclass(frozen=True)
class Holds:
    """A verdict in ``quote`` that ``holds()`` computes."""
    notebook: str
    cell: str
    quote: str
    holds: Callable[[], bool]
    why: str


@dataclass(frozen=True)
class Given:
    """Figures in ``quote`` that are not measured, and why."""
    notebook: str
    cell: str
    quote: str
    why: str


def flat(text: str) -> str:
    return " ".join(text.split())


def value(figure: str) -> float:
    """The number a figure states: "4,226 GB/s" 4226, "15%" 15, "5/3" 1.667, "nine kernels" 9."""
    words = figure.lower()
    for word, n in sorted({**NUMBER_WORDS, **FRACTION_WORDS}.items(), key=lambda item: -len(item[0])):
        if re.search(rf"\b{word}\b", words):
            return float(n)
    fraction = re.search(r"(\d+)\s*/\s*(\d+)(?!\s*\w*/s)", figure)
    if fraction and "/s" not in figure:
        return int(fraction.group(1)) / int(fraction.group(2))
    return float(re.search(_NUMBER, figure).group(0).replace(",", ""))


def rounding(figure: str) -> float:
    """Half a unit in the last digit the figure prints (0 for a count in words)."""
    if any(re.search(rf"\b{word}\b", figure.lower()) for word in {**NUMBER_WORDS, **FRACTION_WORDS}):
        return 0.0
    digits = re.search(_NUMBER, figure).group(0).replace(",", "")
    return float(Decimal("0.5").scaleb(Decimal(digits).as_tuple().exponent))


@functools.lru_cache(maxsize=None)
def notebook(name: str):
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)


def output(name: str, cell: str) -> str:
    """The stored text output of one code cell (streams and text/plain, joined)."""
    found = next(c for c in notebook(name).cells if c.get("id") == cell)
    parts = [o.get("text") or o.get("data", {}).get("text/plain", "") for o in found.get("outputs", [])]
    return "".join("".join(p) if isinstance(p, list) else p for p in parts)


def figures(source: str) -> list[tuple[int, str]]:
    """(position in ``flat(source)``, figure) for every figure the markdown states outside code and LaTeX."""
    text = flat(source)
    masked = UNREAD.sub(lambda m: " " * len(m.group(0)), text)
    return [(m.start(), m.group(0)) for m in FIGURE.finditer(masked)]


def check_entry(entry, cells: dict) -> list[str]:
    """What is wrong with one entry against its notebook's cells ({id: (index, source)})."""
    where = f"notebooks/{entry.notebook}.ipynb cell {cells.get(entry.cell, ('?',))[0]} ({entry.cell})"
    if entry.cell not in cells:
        return [f"{where}: no such cell"]
    if flat(entry.quote) not in flat(cells[entry.cell][1]):
        return [f"{where}: the text no longer says {entry.quote!r}: change the cell back or the entry"]
    if isinstance(entry, Measured):
        if entry.figure not in entry.quote:
            return [f"{where}: the figure {entry.figure!r} is not in its quote"]
        said, got = value(entry.figure), entry.measured()
        band = rounding(entry.figure) if entry.within is None else entry.within
        if abs(said - got) > band + 1e-9:
            return [f"{where}: the text says {entry.figure!r} ({said:g}) but the source gives {got:.4g} "
                    f"(allowed: ±{band:g}) in {entry.quote!r}"]
    if isinstance(entry, Holds) and not entry.holds():
        return [f"{where}: the verdict in {entry.quote!r} does not hold: {entry.why}"]
    return []


def problems(name: str, entries, cells: list | None = None) -> list[str]:
    """Every stale or unregistered figure of one notebook (its cells, or ``cells`` in their place)."""
    cells = notebook(name).cells if cells is None else cells
    by_id = {c.get("id"): (i, c.source) for i, c in enumerate(cells)}
    mine = [e for e in entries if e.notebook == name]
    found = [p for e in mine for p in check_entry(e, by_id)]
    for index, cell in enumerate(cells):
        if cell.cell_type != "markdown":
            continue
        text = flat(cell.source)
        spans = [(m.start(), m.start() + len(flat(e.quote))) for e in mine if e.cell == cell.get("id")
                 for m in re.finditer(re.escape(flat(e.quote)), text)]
        for at, figure in figures(cell.source):
            if not any(start <= at and at + len(figure) <= end for start, end in spans):
                context = text[max(0, at - 60):at + len(figure) + 40]
                found.append(f"notebooks/{name}.ipynb cell {index} ({cell.get('id')}): the figure {figure!r} is "
                             f"neither printed by code nor registered in tests/prose_registry.py: ...{context}...")
    return found
