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

NUMBER_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
                "ten": 10, "eleven": 11, "twelve": 12, "a dozen": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
                "sixteen": 16, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "a hundred": 100,
                "a thousand": 1000}
_WORDS = "|".join(sorted(NUMBER_WORDS, key=len, reverse=True))
FRACTION_WORDS = {"half": 1 / 2, "a third": 1 / 3, "a quarter": 1 / 4, "a tenth": 1 / 10}
_NUMBER = r"\d(?:[\d,]*\d)?(?:\.\d+)?"
_UNIT = (r"(?:µs|us|ms|ns|s|GB/s|TB/s|TFLOP/s|GiB|MiB|KiB|MB|GB|KB|TB|tokens?/s|tok/s|%|x|×|units?|FLOPs?|bytes?|"
         r"registers|passes|kernels?|launch(?:es)?)")
# What a count in words counts ("nine kernels", "one fused launch", "three reads"): "one" only counts these.
_COUNTED = (r"(?:kernels?|launch(?:es)?|pass(?:es)?|reads?|writes?|loads?|stores?|GEMMs?|operators?|multiprocessors|"
            r"SMs|tiles|programs|warps|stages|copies|calls|layers|heads|requests|rounds|splits|barriers)")
_ADJECTIVE = r"(?:fused|separate|extra|more|fewer|small|large|GPU|CUDA|Triton|elementwise|eager|cuBLAS|kernel)"
# A verdict: a comparison the data decides.
_VERDICT = (r"faster|slower|fastest|slowest|beats?|loses|outruns?|ties|wins?|costs?\sthe\ssame|saves?\slittle|"
            r"saves?\snothing|no\sfaster|no\sslower|as\sfast\sas|pays?\soff|negligible|dominates?")
FIGURE = re.compile(rf"""
      (?<![\w.=/§#]) {_NUMBER} \s? {_UNIT} (?![\w/])             # a number with its unit: 4,226 GB/s, 15%, 5.3x
    | × \s? {_NUMBER}                                           # a factor written first: ×0.65
    | \b (?:about|around|roughly|nearly|almost|under|over|at\smost|at\sleast|up\sto) \s {_NUMBER}   # about 21
    | \b (?:{_WORDS}) \s (?:{_ADJECTIVE}\s)? {_COUNTED} \b     # a count in words: nine kernels, one fused launch
    | \b (?:a\sfew|several|tens\sof|hundreds\sof|thousands\sof) \s (?:such\s)?
          (?:percent|times|microseconds|milliseconds|steps|kernels|launches|tokens|bytes)\b   # a vague quantity
    | \b (?:a\stenth|a\squarter|a\sthird|half) \s (?:of|the|as)\b      # a vague fraction: half the speed
    | (?<![\w-]) (?:{_VERDICT})\b                                # a verdict
""", re.IGNORECASE | re.VERBOSE)
# Any other number in markdown: "132 multiprocessors", "65 reads", "16 is vLLM's default". (Not read in the strings
# lessonlib prints: there bare numbers are formulas and indices, "program_id(0)", "lengths += 1".)
BARE = re.compile(rf"(?<![\w.,=/$§#-]) {_NUMBER} (?![\w]|\.\d|[-/]\w)", re.VERBOSE)
# Not read: display and inline LaTeX, code spans, link targets, HTML tags.
UNREAD = re.compile(r"\$\$.*?\$\$|\$[^$]*\$|`[^`]*`|\]\([^)]*\)|<[^>]+>")
# Numbers that name a place, not a quantity: "lesson 02", "section 6", "§7", "exercise 3", "puzzle 1", "step 2",
# "sm_90", "Python 3.11"; a heading's number and a numbered list's; a year in a citation is a date, registered as
# Given where it is cited.
REFERENCE = re.compile(r"(?:\b(?:lessons?|sections?|exercises?|puzzles?|parts?|steps?|cells?|figures?|questions?|"
                       r"items?|chapters?|appendix|Python|sm_?|version|v)\s?|§\s?)$", re.IGNORECASE)
_NUMBERED_LINE = re.compile(r"^(\s*#+\s*|\s*(?:[-*]\s+)?)(\d+(?:\.\d+)*)(?=[.)]\s|\s·)", re.MULTILINE)
# What vague words mean, wherever a Measured entry's figure uses them: the band its computed value must lie in.
VAGUE = {"a few percent": (1.0, 5.0), "a few": (2.0, 5.0), "several times": (3.0, 10.0), "several": (3.0, 9.0),
         "tens of": (20.0, 99.0), "hundreds of": (200.0, 999.0), "thousands of": (2000.0, 9999.0)}


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
    if vague(figure):
        low, high = vague(figure)[1:]
        return (low + high) / 2
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


def _unnumbered(source: str) -> str:
    """``source`` with headings' and list items' numbers turned to letters (same length): they name places."""
    return _NUMBERED_LINE.sub(lambda m: m.group(1) + "N" * len(m.group(2)), source)


def figures(source: str, bare: bool = True) -> list[tuple[int, str]]:
    """(position in ``flat(source)``, figure) for every figure the text states outside code and LaTeX; ``bare``:
    numbers without a unit too (markdown), unless they name a place (:data:`REFERENCE`)."""
    text = flat(_unnumbered(source))
    masked = UNREAD.sub(lambda m: " " * len(m.group(0)), text)
    found = [(m.start(), m.group(0)) for m in FIGURE.finditer(masked)]
    if bare:
        taken = [(at, at + len(figure)) for at, figure in found]
        found += [(m.start(), m.group(0)) for m in BARE.finditer(masked)
                  if not any(start <= m.start() < end for start, end in taken)
                  and not REFERENCE.search(masked[max(0, m.start() - 12):m.start()])]
    return sorted(found)


def vague(figure: str) -> tuple[str, float, float] | None:
    """(the vague words, low, high) where ``figure`` states a vague quantity: its stated meaning (:data:`VAGUE`)."""
    for words, (low, high) in VAGUE.items():  # longest first: "a few percent" before "a few"
        if figure.lower().startswith(words):
            return words, low, high
    return None


def check_entry(entry, cells: dict) -> list[str]:
    """What is wrong with one entry against its notebook's cells ({id: (index, source)})."""
    where = (entry.notebook if entry.notebook.endswith(".py")  # a string lessonlib shows
             else f"notebooks/{entry.notebook}.ipynb cell {cells.get(entry.cell, ('?',))[0]} ({entry.cell})")
    if entry.cell not in cells:
        return [f"{where}: no such cell"]
    if flat(entry.quote) not in flat(cells[entry.cell][1]):
        return [f"{where}: the text no longer says {entry.quote!r}: change the cell back or the entry"]
    if isinstance(entry, Measured):
        if entry.figure not in entry.quote:
            return [f"{where}: the figure {entry.figure!r} is not in its quote"]
        got = entry.measured()
        if vague(entry.figure):
            words, low, high = vague(entry.figure)
            if entry.within is not None:
                return [f"{where}: {words!r} has a stated meaning ({low:g} to {high:g}); the entry may not widen it"]
            if not low <= got <= high:
                return [f"{where}: the text says {entry.figure!r}, which means {low:g} to {high:g}, but the source "
                        f"gives {got:.4g} in {entry.quote!r}"]
            return []
        said = value(entry.figure)
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


# --- what lessonlib prints, draws and says to a student ------------------------------------------------------------

# The modules whose strings reach a student: legends, titles, tables, checker messages, hints, printed verdicts.
# (Errors that ops/ and engine/ raise on bad input state the rule the code enforces, not a finding.)
STUDENT_FACING = ("lessonlib/plots", "lessonlib/widgets", "lessonlib/claims", "lessonlib/exercises",
                  "lessonlib/serving", "lessonlib/cases", "lessonlib/hints.py", "lessonlib/measured.py",
                  "lessonlib/results.py", "lessonlib/traffic.py", "lessonlib/kv_memory.py", "lessonlib/cuda_graphs.py",
                  "lessonlib/compiler.py")


def student_facing_files() -> list[str]:
    paths = []
    for entry in STUDENT_FACING:
        path = ROOT / entry
        paths += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return [str(p.relative_to(ROOT)) for p in paths if p.exists()]


def strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string a module can show: its string constants, less docstrings and the two branches
    of a conditional expression (``"faster" if a < b else "slower"``: a verdict the code computes from the data)."""
    import ast

    tree = ast.parse(source)
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skip.add(id(body[0].value))
        if isinstance(node, ast.IfExp):
            skip.update(id(branch) for branch in (node.body, node.orelse) if isinstance(branch, ast.Constant))
        if isinstance(node, ast.FormattedValue) and node.format_spec is not None:  # f"{x:28s}": a format, not text
            skip.update(id(part) for part in ast.walk(node.format_spec))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
            and len(node.value.split()) > 1]  # a single word ("100%", "C0") is a setting, not a sentence


def generated_problems(path: str, entries, source: str | None = None) -> list[str]:
    """Every stale or unregistered figure in the strings of one student-facing module (``source`` in its place)."""
    source = (ROOT / path).read_text() if source is None else source
    shown = strings(source)
    whole = "\n".join(text for _, text in shown)
    mine = [e for e in entries if e.notebook == path]
    found = [p for e in mine for p in check_entry(e, {e.cell: (0, whole)})]
    for line, text in shown:
        flattened = flat(text)
        spans = [(m.start(), m.start() + len(flat(e.quote))) for e in mine
                 for m in re.finditer(re.escape(flat(e.quote)), flattened)]
        for at, figure in figures(text, bare=False):
            if not any(start <= at and at + len(figure) <= end for start, end in spans):
                found.append(f"{path} line {line}: the figure {figure!r} in {flattened[:100]!r} is neither computed "
                             f"from the data nor registered in tests/prose_generated.py")
    return found
