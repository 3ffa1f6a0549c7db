"""What a student reads names nothing of the maintainers' machines or process: no absolute path, user name, virtual
environment or scratch path, no maintainer's make target, no "NOTES", "seed" (as in "the seed's table"),
"committed", test file, `benchmarks/experiments` (in a lesson: the appendix cites the experiments), and no lesson
grading the course against its own targets.

Read: every course notebook (the instructor copies, the appendix, the student copies), each cell's source and its
stored outputs (printed text, text/plain, HTML, markdown, errors), and the messages checkers print: the string
literals of lessonlib/exercises/*.py and lessonlib/hints.py (docstrings excepted: they are read by maintainers, in
the source, not printed into a lesson). A few regular expressions over a few megabytes of text: well under a second.
"""

from __future__ import annotations

import ast
import getpass
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "notebooks" / "student").glob("*.ipynb"))
CHECKER_FILES = sorted((ROOT / "lessonlib" / "exercises").glob("*.py")) + [ROOT / "lessonlib" / "hints.py"]

# name: (pattern, where it applies: "all", "prose" = not code-cell source, or "lessons" = every notebook but the
# appendix, whose job is to name the experiments behind the lessons' results and the files they wrote).
RULES = {
    "an absolute path": (r"(?<![\w.:/~-])/(?:home|root|work|tmp|Users|usr/local|opt|mnt|content|var/folders)/"
                         r"|\b[A-Z]:\\\\?[\w$]", "all"),
    "a virtual environment's path": (r"(?<![\w-])\.venv[/\\]|\b(?:site|dist)-packages[/\\]", "all"),
    "a scratch path": (r"(?<![\w./-])scratch/", "all"),
    "a maintainer's make target": (r"\bmake (?:relink|student-notebooks|grade)\b", "all"),
    "NOTES": (r"\bNOTES\b", "all"),
    # "the seed's table", "a seed's claim", "the two seeds": the course's source texts. A random seed is a seed of a
    # generator ("same seed, same tokens", "a mask drawn from a seed", `torch.manual_seed(0)`) and passes.
    "seed": (r"(?i)\bseeds?'s?(?=\s)|\bseeds'|\bthe (?:two )?seeds?\b(?!\s*[=(])|\bseed (?:texts?|notebooks?|course)\b",
             "all"),
    "committed": (r"(?i)\bcommitted\b", "all"),
    "a test file": (r"\btest_\w+\.py\b|(?<![\w./-])tests/", "all"),
    "benchmarks/experiments": (r"benchmarks/experiments", "lessons"),
    "targets met or missed": (r"(?i)\btargets?\b(?:[^\n.;]|\.(?=\d)){0,80}?\b(?:met|missed)\b|\btargets? the course set\b", "all"),
}


def _user_names() -> list[str]:
    """The name of whoever runs the test: found in a path (/x/NAME/, NAME@host) it is a machine's."""
    try:
        name = getpass.getuser()
    except Exception:  # no user database entry (some containers)
        return []
    return [name] if len(name) >= 2 else []


def offences(text: str, code: bool = False, appendix: bool = False) -> list[str]:
    """Each rule ``text`` breaks, with the words around it: ``rule: ...context...``."""
    found = []
    rules = dict(RULES)
    for name in _user_names():
        rules[f"the user name {name!r}"] = (rf"[/\\]{re.escape(name)}[/\\]|\b{re.escape(name)}@[\w-]", "all")
    for rule, (pattern, where) in rules.items():
        if (where == "prose" and code) or (where == "lessons" and appendix):
            continue
        for match in re.finditer(pattern, text):
            around = text[max(0, match.start() - 50):match.end() + 50]
            found.append(f"{rule}: ...{' '.join(around.split())}...")
    return found


def _output_text(output) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":
        return "\n".join([output.ename, output.evalue, *output.traceback])
    data = output.get("data", {})
    return "\n".join(data[kind] if isinstance(data[kind], str) else "".join(data[kind])
                     for kind in ("text/plain", "text/html", "text/markdown") if kind in data)


def notebook_offences(path: Path) -> list[str]:
    found = []
    for number, cell in enumerate(nbformat.read(path, as_version=4).cells):
        where = f"cell {number} ({cell.get('id', '?')})"
        appendix = path.stem == "appendix_measurements"
        found += [f"{where} source: {o}" for o in offences(cell.source, cell.cell_type == "code", appendix)]
        for output in cell.get("outputs", []):
            found += [f"{where} output: {o}" for o in offences(_output_text(output), appendix=appendix)]
    return found


def checker_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each string literal in ``path`` that is not a docstring; an f-string's literal parts joined."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    strings, inside_fstrings = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = [v.value if isinstance(v, ast.Constant) else "{}" for v in node.values]
            inside_fstrings.update(id(v) for v in node.values)
            strings.append((node.lineno, "".join(str(p) for p in parts)))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                and id(node) not in inside_fstrings):
            strings.append((node.lineno, node.value))
    return strings


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_notebook_names_nothing_of_the_maintainers(path):
    found = notebook_offences(path)
    assert not found, f"{path.relative_to(ROOT)}: {len(found)} found:\n" + "\n".join(found)


@pytest.mark.parametrize("path", CHECKER_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_checker_messages_name_nothing_of_the_maintainers(path):
    found = [f"line {line}: {o}" for line, text in checker_strings(path) for o in offences(text)]
    assert not found, f"{path.relative_to(ROOT)}:\n" + "\n".join(found)


@pytest.mark.parametrize("text, rule", [
    ("lessonlib found at /work/main/lessonlib, nothing installed", "an absolute path"),
    ("see /home/alice/course", "an absolute path"),
    (r"C:\Users\bob\course", "an absolute path"),
    ("UserWarning in .venv/lib/python3.11/site-packages/torch/x.py", "a virtual environment's path"),
    ("written to scratch/run.json", "a scratch path"),
    ("run `make relink` after editing", "a maintainer's make target"),
    ("see benchmarks/NOTES.md", "NOTES"),
    ("the seed's table", "seed"),
    ("Two more measure a seed's claim", "seed"),
    ("once its run is committed", "committed"),
    ("tests/test_prose_figures.py checks it", "a test file"),
    ("see benchmarks/experiments/", "benchmarks/experiments"),
    ("the course's target: at most 1.5 (met)", "targets met or missed"),
    ("knee 2.00x transformers' (target: at least 2x): met at its knee rate", "targets met or missed"),
    ("targets the course set", "targets met or missed"),
])
def test_each_rule_finds_what_it_guards(text, rule):
    assert any(o.startswith(rule) for o in offences(text)), (text, offences(text))


@pytest.mark.parametrize("text", [
    "torch.manual_seed(0)", "gen = torch.Generator().manual_seed(1)", "simulate(seed=3)", "random.seed(4)",
    "with a fixed random seed", "same seed, same tokens", "the mask drawn in the kernel from a seed",
    "seed: int = ROUNDING_SEED", "Sampling: temperature, top-p, a seed", "torch.manual_seed(seed)", "https://colab.research.google.com/github/o/r/blob/v1/notebooks/x.ipynb",
    "the engine's targets. The kernel met its bound", "a committee", "NOTE: the notes", "1/4 of the tiles", "a/b/c",
])
def test_what_a_lesson_may_say(text):
    assert offences(text) == [], offences(text)


def test_the_appendix_may_cite_the_experiments_and_a_lesson_may_not():
    text = "python -m benchmarks.experiments.decode_step_profile writes benchmarks/experiments/results/x.json"
    assert offences(text, appendix=True) == []
    assert any(o.startswith("benchmarks/experiments") for o in offences(text))
