"""What the grader's processes share about a submission's cells: which cells the runner runs (:func:`apart`), a
cell's source as it runs (:func:`_source`: magic lines emptied, registered with linecache), and the lock every
:mod:`ast` parse takes.

(Before issue 43 this module was *the scoring process*, which ran the pristine checkers beside the student's code;
the points are now decided by the judge, :mod:`~lessonlib.grading.judge`.)
"""

from __future__ import annotations

import linecache
import os
import re
import threading

MAGIC = re.compile(r"^(\s*)[%!].*$", re.M)  # an IPython magic or shell line: no meaning outside IPython

# CPython 3.11 keeps the counter that guards building an AST's Python objects per interpreter, not per thread: two
# threads parsing at once can raise "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905).
# The grader grades submissions on threads, so every parse here takes this lock.
AST_LOCK = threading.Lock()


def _source(index: int, source: str, folder: str) -> tuple[str, str]:
    """(a file name for the cell, its source less magic lines), registered with linecache as IPython does, so that
    ``inspect.getsource`` (and so ``@triton.jit``) reads the cell."""
    name = os.path.join(folder, f"cell{index}.py")  # no such file: a name of its own for each cell
    source = MAGIC.sub(lambda m: f"{m.group(1)}pass", source)
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    return name, source


SETUP = re.compile(r"lessonlib\.exercises import|from lessonlib import [^\n]*\bexercises\b")


def _definitions(source: str) -> str:
    """The cell's top-level imports and function definitions (decorators included), as written; "" if none or if
    it is not plain Python."""
    import ast

    try:
        with AST_LOCK:
            tree = ast.parse(MAGIC.sub(lambda m: f"{m.group(1)}pass", source))
    except SyntaxError:
        return ""
    lines = source.splitlines()
    kept = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            kept.append("\n".join(lines[first - 1: node.end_lineno]))
    return "\n\n".join(kept)


def apart(sources: list[str], checks: dict, exercises_: list) -> list[dict]:
    """The runner's cells, from :func:`~lessonlib.grading.notebook_run.plan`'s: the plan's first cell; the student's
    set-up cells (up to the first that imports lessonlib's checkers, when that is before the first check); each
    solution cell whole; of every other cell only its imports and function definitions (lesson cells compute and
    plot, which no check needs); and each check. Each entry keeps its ``index`` in ``sources``."""
    solution = re.compile("|".join(rf"^\s*def {re.escape(e.solution_id)}\(" for e in exercises_) or "$^", re.M)
    first_check = min(checks, default=len(sources))
    setup_end = next((i for i in range(1, first_check) if SETUP.search(sources[i])), 0)
    cells = []
    for index, source in enumerate(sources):
        if index in checks:
            cells.append({"index": index, "exercise": checks[index].name,
                          "checker_source": checks[index].checker_source})
        elif index <= setup_end or solution.search(source):
            cells.append({"index": index, "exercise": None, "source": source})
        elif kept := _definitions(source):
            cells.append({"index": index, "exercise": None, "source": kept})
    return cells
