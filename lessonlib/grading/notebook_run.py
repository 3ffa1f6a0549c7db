"""Running one submitted notebook: which cells run (:func:`plan`), running them in a fresh kernel with time and output
limits, and reading each pristine checker's outcome (:func:`grade_notebook`)."""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import re
import shutil
import site
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from lessonlib.grading.exercise_format import Exercise, _nbgrader
from lessonlib.grading.kernel_side import PRELUDE, checker_cell

ROOT = Path(__file__).resolve().parents[2]  # the checkout: on the kernel's PYTHONPATH


@dataclass
class Limits:
    cell_timeout: float = 600.0  # seconds a cell may run before it is interrupted
    notebook_timeout: float = 1800.0  # seconds for the whole notebook
    output_cap: int = 1_000_000  # characters of output kept per cell; the rest is dropped, with a note
    busy_grace: float = 10.0  # seconds an interrupted kernel has to become idle before it is killed


@dataclass
class Outcome:
    exercise: Exercise
    points: float = 0.0
    message: str = "not graded"


@dataclass
class NotebookReport:
    name: str
    outcomes: list[Outcome]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _checker_call(exercises_: list[Exercise]) -> re.Pattern:
    """A cell that is nothing but a checker call on the student's function: ``check_x(my_x)``. (A lesson cell
    such as ``check_swiglu(ops.swiglu)``, the checker run on lessonlib's own kernel, is a lesson cell.)"""
    calls = [rf"({re.escape(e.checker_id)})\s*\(\s*{re.escape(e.solution_id)}\s*\)" for e in exercises_]
    return re.compile("|".join(calls))


def plan(submission: nbformat.NotebookNode,
         exercises_: list[Exercise]) -> tuple[list[str], dict[int, Exercise], list[str]]:
    """The cells to run: the prelude, the student's code cells in order, every checker cell replaced by the
    pristine one (a deleted checker goes after its solution cell, or at the end). Stops after the last checker:
    lesson cells after it cannot change a grade. Returns (sources, {index: exercise checked there}, notes)."""
    by_checker = {e.checker_id: e for e in exercises_}
    by_solution = {e.solution_id: e for e in exercises_}
    mentions = _checker_call(exercises_)
    cells: list[tuple[str, Exercise | None]] = [(PRELUDE, None)]  # (source, exercise checked by this cell)
    solution_cell: dict[str, int] = {}  # checker_id -> position in cells of the student's solution cell
    for cell in submission.cells:
        if cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else str(source)
        meta = _nbgrader(cell)
        claimed = by_checker.get(meta.get("grade_id")) if meta.get("grade") or meta.get("locked") else None
        code = "\n".join(line for line in source.splitlines() if line.strip() and not line.lstrip().startswith("#"))
        call = mentions.fullmatch(code.strip())
        named = [by_checker[next(g for g in call.groups() if g)]] if call else []
        if claimed or named:  # a checker cell, or a cell that only calls one: the pristine checker runs instead
            placed = {e.checker_id for _, e in cells if e}
            for exercise in dict.fromkeys(([claimed] if claimed else []) + named):
                if exercise.checker_id not in placed:
                    cells.append((checker_cell(exercise), exercise))
            continue
        cells.append((source, None))
        solution = by_solution.get(meta.get("grade_id")) or next(
            (e for e in exercises_ if re.search(rf"^\s*def {re.escape(e.solution_id)}\(", source, re.M)), None)
        if solution is not None:
            solution_cell[solution.checker_id] = len(cells) - 1
    notes = []
    placed = {e.checker_id for _, e in cells if e}
    for exercise in exercises_:
        if exercise.checker_id in placed:
            continue
        where = solution_cell.get(exercise.checker_id)
        notes.append(f"{exercise.name}: the checker cell was missing; the instructor's ran "
                     + ("after your solution cell" if where is not None else "at the end (no solution cell found)"))
        insert_at = len(cells) if where is None else where + 1
        cells.insert(insert_at, (checker_cell(exercise), exercise))
        solution_cell = {k: (v + 1 if v >= insert_at else v) for k, v in solution_cell.items()}
    checks = {i: e for i, (_, e) in enumerate(cells) if e}
    last = max(checks, default=0)
    return [source for source, _ in cells[: last + 1]], checks, notes


def _kernel_spec_manager(scratch: Path):
    """A kernel spec for this Python: the kernel runs the grader's own interpreter and packages."""
    from jupyter_client.kernelspec import KernelSpecManager

    folder = scratch / "kernels" / "lessonlib-grading"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lessonlib grading", "language": "python"}))
    return KernelSpecManager(kernel_dirs=[str(scratch / "kernels")], ensure_native_kernel=False)


def _kernel_env(scratch: Path) -> dict[str, str]:
    """The kernel's environment: its home, temporary folder and lessonlib's scratch inside the grader's scratch."""
    home, tmp = scratch / "home", scratch / "tmp"
    home.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "HOME": str(home), "TMPDIR": str(tmp), "MPLBACKEND": "Agg",
            "LESSONLIB_SCRATCH": str(scratch / "lessonlib"), "LESSONLIB_GRADING_SCRATCH": str(scratch),
            "XDG_CACHE_HOME": str(home / ".cache"), "PYTHONUSERBASE": site.getuserbase(),
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def _capped_client(notebook, km, workdir: Path, limits: Limits):
    """An nbclient NotebookClient that keeps at most ``limits.output_cap`` characters of output per cell (error
    outputs shortened, kept), interrupts a cell at ``limits.cell_timeout`` and records a timeout as an error."""
    from nbclient import NotebookClient

    class CappedClient(NotebookClient):
        def output(self, outs, msg, display_id, cell_index):
            content = msg["content"]
            size = len(content.get("text", "")) + sum(len(str(v)) for v in content.get("data", {}).values())
            kept = self._kept.get(cell_index, 0)
            if msg["msg_type"] == "error":
                content["evalue"] = content.get("evalue", "")[:4000]
                content["traceback"] = [line[:4000] for line in content.get("traceback", [])[-20:]]
            elif kept + size > limits.output_cap:
                if kept <= limits.output_cap:
                    self._kept[cell_index] = limits.output_cap + 1
                    outs.append(nbformat.v4.new_output("stream", name="stderr", text=(
                        f"[lessonlib.grading: output past {limits.output_cap:,} characters dropped]\n")))
                return None
            self._kept[cell_index] = kept + size
            return super().output(outs, msg, display_id, cell_index)

    client = CappedClient(notebook, km=km, timeout=int(limits.cell_timeout), allow_errors=True,
                          interrupt_on_timeout=True, record_timing=False,
                          error_on_timeout={"ename": "CellTimeout", "evalue": "", "traceback": []},
                          resources={"metadata": {"path": str(workdir)}})
    client._kept = {}
    return client


def _run_cells(sources: list[str], workdir: Path, scratch: Path, limits: Limits):
    """Execute ``sources`` in one fresh kernel. Returns (executed notebook, {index: status}, notes) where status
    is "ok", "error", "timeout" or "not run"."""
    from jupyter_client.manager import AsyncKernelManager
    from nbclient.exceptions import DeadKernelError

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    notebook.metadata["kernelspec"] = {"name": "lessonlib-grading", "display_name": "lessonlib grading",
                                       "language": "python"}
    env = _kernel_env(scratch)
    status, notes, replies = {}, [], {}
    km = AsyncKernelManager(kernel_name="lessonlib-grading", kernel_spec_manager=_kernel_spec_manager(scratch))
    client = _capped_client(notebook, km, workdir, limits)
    client.on_cell_executed = lambda cell, cell_index, execute_reply: replies.__setitem__(cell_index, execute_reply)
    deadline = time.monotonic() + limits.notebook_timeout

    def timed_out(index):
        return replies.get(index, {}).get("content", {}).get("ename") == "CellTimeout"

    async def run():
        async with client.async_setup_kernel(env=env):
            for index, cell in enumerate(notebook.cells):
                remaining = deadline - time.monotonic()
                if remaining <= 1:
                    notes.append(f"stopped: the notebook ran past the grader's limit of {limits.notebook_timeout:g} s")
                    return
                client.timeout = max(1, int(min(limits.cell_timeout, remaining)))
                try:
                    await client.async_execute_cell(cell, index)
                except DeadKernelError:
                    status[index] = "error"
                    notes.append(f"stopped: the kernel died while running {_describe_cell(cell.source)}")
                    return
                status[index] = replies.get(index, {}).get("content", {}).get("status", "error")
                if timed_out(index):
                    status[index] = "timeout"
                    notes.append(f"{_describe_cell(cell.source)} ran past {client.timeout} s and was interrupted")
                    # An interrupted kernel that stays busy (a loop that catches KeyboardInterrupt, C code) would
                    # time out every later cell: probe it, and stop if it does not answer.
                    client.timeout = max(1, int(limits.busy_grace))
                    notebook.cells.append(nbformat.v4.new_code_cell("pass"))  # nbclient stores a cell by index
                    probe = len(notebook.cells) - 1
                    try:
                        await client.async_execute_cell(notebook.cells[probe], probe)
                    except DeadKernelError:
                        replies[probe] = {"content": {"ename": "CellTimeout"}}
                    finally:
                        notebook.cells.pop()
                    if timed_out(probe):
                        notes.append("stopped: the kernel stayed busy after the interrupt and was killed")
                        return

    async def run_and_stop():
        try:
            await run()
        finally:
            if km.has_kernel:
                await km.shutdown_kernel(now=True)

    try:
        asyncio.run(run_and_stop())
    except Exception as e:  # a kernel that could not start, a broken connection: grade what ran
        notes.append(f"stopped: {type(e).__name__}: {str(e)[:300]}")
    atexit.unregister(client._cleanup_kernel)  # nbclient's exit hook for this kernel: already shut down
    return notebook, status, notes


def _describe_cell(source: str) -> str:
    first = next((line.strip() for line in source.splitlines() if line.strip() and not line.startswith("#")), "")
    return f"the cell starting {first[:60]!r}"


def _checker_message(cell, status: str, limits: Limits) -> str:
    if status == "timeout":
        return f"the check did not finish within the grader's limit of {limits.cell_timeout:g} s per cell"
    errors = [o for o in cell.outputs if o.output_type == "error"]
    if status == "error" and not errors:
        return "the kernel died during the check"
    if errors:
        error = errors[0]
        first = error.evalue.strip().splitlines()[0] if error.evalue.strip() else ""
        return first if error.ename in ("ExerciseFailed", "GradingRefused") else f"{error.ename}: {first}"
    text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("(note:")]
    return lines[-1].strip() if lines else "passed"


def grade_notebook(path: Path, pristine_name: str, exercises_: list[Exercise], scratch: Path, limits: Limits,
                   graded_copy: Path | None = None) -> NotebookReport:
    """Grade one submitted notebook against the instructor's exercises (see the module docstring)."""
    start = time.monotonic()
    outcomes = {e.checker_id: Outcome(e) for e in exercises_}
    report = NotebookReport(path.name, list(outcomes.values()))
    try:
        submission = nbformat.reads(path.read_text(encoding="utf-8", errors="replace"), as_version=4)
    except Exception as e:  # truncated, not JSON, not a notebook
        for outcome in outcomes.values():
            outcome.message = "not graded: the file is not a valid notebook"
        report.notes.append(f"{path.name} is not a valid notebook ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        return report
    sources, checks, notes = plan(submission, exercises_)
    report.notes += notes
    workdir = scratch / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, workdir / pristine_name)
    executed, status, notes = _run_cells(sources, workdir, scratch, limits)
    report.notes += notes
    for index, exercise in checks.items():
        outcome = outcomes[exercise.checker_id]
        state = status.get(index, "not run")
        if state == "not run":
            outcome.message = "not graded: the notebook stopped before this check (see the notes)"
            continue
        outcome.message = _checker_message(executed.cells[index], state, limits)
        outcome.points = exercise.points if state == "ok" else 0.0
    if graded_copy is not None:
        graded_copy.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(executed, graded_copy)
    report.seconds = time.monotonic() - start
    return report
