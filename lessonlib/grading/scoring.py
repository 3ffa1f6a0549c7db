"""The scoring process: the pristine checkers run in a fresh plain ``python`` (no IPython, no kernel) on what the
student's set-up and solution cells define; the points come from here, not from the notebook's kernel.

    python -c "import sys; from lessonlib.grading.scoring import main; main(int(sys.argv[1]))" RESULT_FD < request

The request (on stdin, read whole and closed before any student code runs) is a random ``nonce``, a per-cell time
limit and the cells: the prelude (:data:`~lessonlib.grading.kernel_side.PRELUDE`), the student's cells as
:func:`~lessonlib.grading.notebook_run.apart` chose them, and one entry per check. Each check's outcome goes to
``RESULT_FD`` as one ``repr`` line carrying the nonce: a line without it (one the student's code wrote) is not read.
Before each check the grader's own helpers are compared with what they were after the prelude: a replaced one gives
no points for that check and says which. The student's ``print`` goes to this process's stdout (the grader caps it).
"""

from __future__ import annotations

import io
import json
import linecache
import os
import re
import signal
import sys
import threading
import traceback
import types

MAGIC = re.compile(r"^(\s*)[%!].*$", re.M)  # an IPython magic or shell line: no meaning outside IPython

# CPython 3.11 keeps the counter that guards building an AST's Python objects per interpreter, not per thread: two
# threads parsing at once can raise "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905).
# The grader grades submissions on threads, so every parse here takes this lock.
AST_LOCK = threading.Lock()


class CellTimeout(BaseException):
    pass


class GradingRefused(Exception):
    """The notebook replaced one of the grader's own helpers: no points for this check."""


def _source(index: int, source: str, folder: str) -> tuple[str, str]:
    """(a file name for the cell, its source less magic lines), registered with linecache as IPython does, so that
    ``inspect.getsource`` (and so ``@triton.jit``) reads the cell."""
    name = os.path.join(folder, f"cell{index}.py")  # no such file: not a library's (kernel_side._is_library_file)
    source = MAGIC.sub(lambda m: f"{m.group(1)}pass", source)
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    return name, source


def main(result_fd: int) -> None:
    # Everything the reporting uses is bound here, before any student code: a patched json, print or repr later
    # changes nothing that reaches the grader.
    write, encode, text_type, report_repr = os.write, str.encode, str, repr
    request = json.loads(sys.stdin.read())
    sys.stdin.close()
    nonce, cells, timeout = request["nonce"], request["cells"], float(request["cell_timeout"])
    folder = os.environ["LESSONLIB_GRADING_SCRATCH"]
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    namespace = main_module.__dict__
    namespace["display"] = lambda *args, **kwargs: None  # IPython's display: a no-op here

    def alarm(signum, frame):
        raise CellTimeout(f"ran past the grader's limit of {timeout:g} s per cell")

    def report(index, status, stdout="", ename="", evalue=""):
        line = report_repr((nonce, index, status, text_type(stdout)[-20_000:], ename, text_type(evalue)[:4000]))
        write(result_fd, encode(line + "\n"))

    grader, helpers = None, {}
    for index, cell in enumerate(cells):
        exercise = cell.get("exercise")
        captured = io.StringIO()
        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            if exercise is None:
                name, source = _source(index, cell["source"], folder)
                exec(compile(source, name, "exec"), namespace)
                if grader is None and "_lessonlib_grading" in sys.modules:  # the prelude has run
                    grader = sys.modules["_lessonlib_grading"]
                    helpers = dict(vars(grader))
                continue
            replaced = [key for key, value in helpers.items() if vars(grader).get(key) is not value]
            if grader is None or replaced:  # (the prelude always runs first: None means it was undone)
                raise GradingRefused(f"no points for {exercise}: the notebook replaced the grader's own "
                                            f"{', '.join(replaced[:8])}")
            saved = sys.stdout
            sys.stdout = captured
            try:
                helpers["check"](exercise, cell["checker_source"], namespace)
            finally:
                sys.stdout = saved
            report(index, "ok", captured.getvalue())
        except BaseException as e:  # noqa: BLE001 - a student's cell may raise anything, even SystemExit
            if exercise is not None:
                report(index, "error", captured.getvalue(), type(e).__name__, str(e))
            else:
                traceback.print_exc()
                report(index, "error", "", type(e).__name__, str(e))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    sys.stdout.flush()
    os._exit(0)  # no atexit hook of the student's runs after the report


if __name__ == "__main__":
    main(int(sys.argv[1]))


# ---------------------------------------------------------------------------------------------------------------
# The grader's side: which cells run apart, starting the process in its sandbox, reading its results.

RESULT_CAP = 4 << 20  # bytes of the result channel read; each line is at most ~25 kB (report() caps its parts)
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
    """The scoring process's cells, from :func:`~lessonlib.grading.notebook_run.plan`'s: the prelude; the student's
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


def score(cells: list[dict], box, env: dict[str, str], timeout: float, cell_timeout: float,
          output: "Path") -> tuple[dict[int, tuple], list[str]]:
    """Run ``cells`` in a fresh sandboxed ``python -m lessonlib.grading.scoring``. Returns ({index in the plan:
    (status, stdout, ename, evalue)} for each cell that reported, notes); its stdout and stderr go to ``output``."""
    import secrets
    import subprocess

    from lessonlib.grading import sandbox

    nonce = secrets.token_hex(16)
    read_end, write_end = os.pipe()
    sink = sandbox.CappedSink(output, 1_000_000)
    entry = "import sys; from lessonlib.grading.scoring import main; main(int(sys.argv[1]))"
    argv = sandbox.wrap(box, [sys.executable, "-c", entry, str(write_end)], env)
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=sink.fd, stderr=sink.fd, pass_fds=(write_end,),
                               env=env if box.mode == "none" else {"PATH": os.environ.get("PATH", "")},
                               cwd=box.work, start_new_session=True)
    os.close(write_end)
    sink.close_writer()
    chunks: list[bytes] = []

    def drain():  # the first RESULT_CAP bytes kept; the rest read and dropped (the process never blocks on it)
        kept = 0
        while chunk := os.read(read_end, 1 << 16):
            if kept < RESULT_CAP:
                chunks.append(chunk[: RESULT_CAP - kept])
                kept += len(chunks[-1])

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    notes = []
    try:
        process.stdin.write(json.dumps({"nonce": nonce, "cell_timeout": cell_timeout, "cells": [
            {k: v for k, v in c.items() if k != "index"} for c in cells]}).encode())
        process.stdin.close()
    except BrokenPipeError:
        pass
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        notes.append(f"stopped: the checks ran past the grader's limit of {timeout:g} s")
    sandbox.stop(process)
    reader.join(10)
    sink.join()
    os.close(read_end)
    found: dict[int, tuple] = {}
    for line in b"".join(chunks).decode("utf-8", "replace").splitlines():
        entry = _parse(line, nonce, len(cells))
        if entry is not None:
            found.setdefault(cells[entry[0]]["index"], entry[1:])
    return found, notes


def _parse(line: str, nonce: str, count: int) -> tuple | None:
    import ast

    try:
        with AST_LOCK:
            entry = ast.literal_eval(line)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if (not isinstance(entry, tuple) or len(entry) != 6 or entry[0] != nonce or not isinstance(entry[1], int)
            or not 0 <= entry[1] < count or not all(isinstance(v, str) for v in entry[2:])):
        return None
    index, status, stdout, ename, evalue = entry[1:]
    return index, status[:10], stdout[-20_000:], ename[:100], evalue[:4000]
