"""Running one submitted notebook: which cells run (:func:`plan`), running them in a fresh sandboxed kernel with time
and output limits while the judge checks them apart (:mod:`~lessonlib.grading.judge`, with the runner and the
validated runner), and reading each check's outcome (:func:`grade_notebook`)."""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import json
import os
import re
import secrets
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from lessonlib.grading import judge, sandbox
from lessonlib.grading.exercise_format import Exercise, _nbgrader
from lessonlib.grading.kernel_side import PRELUDE, checker_cell

ROOT = Path(__file__).resolve().parents[2]  # the checkout: on the kernel's PYTHONPATH


@dataclass
class Limits:
    cell_timeout: float = 600.0  # seconds a cell may run before it is interrupted
    notebook_timeout: float = 1800.0  # seconds for the whole notebook
    output_cap: int = 1_000_000  # characters of output kept per cell; the rest is dropped, with a note
    busy_grace: float = 10.0  # seconds an interrupted kernel has to become idle before it is killed
    work_bytes: int = 1 << 30  # the sandbox's working folder, /tmp and /dev/shm: tmpfs of this size each
    processes: int = 512  # processes in one sandbox (threads count too where RLIMIT_NPROC holds)
    file_bytes: int = 1 << 30  # largest file a sandboxed process may write (RLIMIT_FSIZE)


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


MAX_NOTEBOOK_BYTES = 64 << 20  # a submitted notebook larger than this is not read


def read_regular(path: Path, cap: int) -> bytes:
    """A submitted file's bytes, only if it is a regular file (not a symbolic link, FIFO or device: opened without
    following links and without blocking, checked with fstat) of at most ``cap`` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > cap:
            raise ValueError(f"larger than {cap:,} bytes")
        chunks, size = [], 0
        while size <= cap and (chunk := os.read(fd, 1 << 20)):
            chunks.append(chunk)
            size += len(chunk)
        if size > cap:
            raise ValueError(f"larger than {cap:,} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _checker_call(exercises_: list[Exercise]) -> re.Pattern:
    """A cell that is nothing but a checker call on the student's function: ``check_x(my_x)``, or the student copy's
    form of it (``REPORTED_CHECK``). (A lesson cell such as ``check_swiglu(ops.swiglu)``, the checker run on
    lessonlib's own kernel, is a lesson cell.)"""
    calls = [rf"({re.escape(e.checker_id)})\s*\(\s*{re.escape(e.solution_id)}\s*\)" for e in exercises_]
    reported = r"(?:from\s+lessonlib\.exercises\s+import\s+reported[^\n]*\n\s*with\s+reported\([^\n]*\):\s*)?"
    return re.compile(reported + "(?:" + "|".join(calls) + ")")


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


def _kernel_spec_manager(folder: Path, argv: list[str]):
    """A kernel spec whose command is ``argv`` (this Python's ipykernel, in its sandbox); interrupted by a message,
    not a signal (the signal would reach the sandbox, not the kernel)."""
    from jupyter_client.kernelspec import KernelSpecManager

    (folder / "lessonlib-grading").mkdir(parents=True, exist_ok=True)
    (folder / "lessonlib-grading" / "kernel.json").write_text(json.dumps({
        "argv": argv, "display_name": "lessonlib grading", "language": "python", "interrupt_mode": "message"}))
    return KernelSpecManager(kernel_dirs=[str(folder)], ensure_native_kernel=False)


def _kernel_manager(box: sandbox.Box, **kwargs):
    """jupyter_client's kernel manager, whose connection file (written 0600 by the grader) is handed to the sandbox's
    uid: a kernel running as a uid of its own could not read it and died before it started."""
    from jupyter_client.manager import AsyncKernelManager

    class KernelManager(AsyncKernelManager):
        def write_connection_file(self, **kw):
            super().write_connection_file(**kw)
            sandbox.hand_over(box, Path(self.connection_file))

    return KernelManager(**kwargs)


def _environment(box: sandbox.Box) -> dict[str, str]:
    """The environment of the kernel and of the grader's other processes: allowlisted, lessonlib's scratch in the
    working folder, the released lessonlib (the grader's pristine copy, ``box.readable[0]``) the only folder added
    to the path."""
    return sandbox.environment(box, {
        "LESSONLIB_SCRATCH": str(box.work / "lessonlib"), "LESSONLIB_GRADING_SCRATCH": str(box.work),
        "PYTHONPATH": str(box.readable[0]) if box.readable else str(ROOT)})


def _capped_client(notebook, km, workdir: Path, limits: Limits):
    """An nbclient NotebookClient that keeps at most ``limits.output_cap`` characters of output per cell (error
    outputs shortened, kept), interrupts a cell at ``limits.cell_timeout`` and records a timeout as an error."""
    from nbclient import NotebookClient

    class CappedClient(NotebookClient):
        def output(self, outs, msg, display_id, cell_index):
            content = msg["content"]
            if msg["msg_type"] == "error":  # kept, each part shortened: a name, a message, the last frames
                content.update(ename=str(content.get("ename", ""))[:100], evalue=str(content.get("evalue", ""))[:4000],
                               traceback=[str(line)[:4000] for line in list(content.get("traceback", []))[-20:]])
            # Everything the message carries counts: text, every MIME bundle, the display metadata, the names.
            size = len(json.dumps(content, default=str))
            kept = self._kept.get(cell_index, 0)
            if kept + size > limits.output_cap and msg["msg_type"] != "error" or size > limits.output_cap:
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


def _run_cells(sources: list[str], box: sandbox.Box, limits: Limits, output: Path):
    """Execute ``sources`` in one fresh kernel in ``box``, its raw stdout and stderr into ``output`` (capped).
    Returns (executed notebook, {index: status}, notes) where status is "ok", "error", "timeout" or "not run"."""
    from nbclient.exceptions import DeadKernelError

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    notebook.metadata["kernelspec"] = {"name": "lessonlib-grading", "display_name": "lessonlib grading",
                                       "language": "python"}
    env = _environment(box)
    argv = sandbox.wrap(box, [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"], env)
    status, notes, replies = {}, [], {}
    # Unix sockets in the one folder the sandbox shares with the grader: the sandbox has no network. Unsandboxed,
    # loopback TCP as Jupyter's default (some file systems refuse sockets: ZMQError "Operation not supported").
    transport, ip = ("tcp", "127.0.0.1") if box.mode == "none" else ("ipc", str(box.writable / "k"))
    km = _kernel_manager(box, kernel_name="lessonlib-grading", transport=transport, ip=ip,
                            connection_file=str(box.writable / "kernel.json"),
                            kernel_spec_manager=_kernel_spec_manager(box.writable.parent / "spec", argv))
    client = _capped_client(notebook, km, box.work, limits)
    sink = sandbox.CappedSink(output, limits.output_cap)
    launch = {"env": env if box.mode == "none" else {"PATH": os.environ.get("PATH", "")}, "cwd": str(box.work),
              "stdout": sink.fd, "stderr": sink.fd, "stdin": subprocess.DEVNULL}
    client.on_cell_executed = lambda cell, cell_index, execute_reply: replies.__setitem__(cell_index, execute_reply)
    deadline = time.monotonic() + limits.notebook_timeout

    def timed_out(index):
        return replies.get(index, {}).get("content", {}).get("ename") == "CellTimeout"

    async def run():
        async with client.async_setup_kernel(**launch):
            sink.close_writer()
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
            process = getattr(km.provisioner, "process", None)
            if km.has_kernel:
                await km.shutdown_kernel(now=True)
            if process is not None:
                sandbox.stop(process)  # its process group (and, sandboxed, every process it started) too

    try:
        asyncio.run(run_and_stop())
    except Exception as e:  # a kernel that could not start, a broken connection: grade what ran
        notes.append(f"stopped: {type(e).__name__}: {str(e)[:300]}")
    atexit.unregister(client._cleanup_kernel)  # nbclient's exit hook for this kernel: already shut down
    sink.join()
    return notebook, status, notes


def _describe_cell(source: str) -> str:
    first = next((line.strip() for line in source.splitlines() if line.strip() and not line.startswith("#")), "")
    return f"the cell starting {first[:60]!r}"


def _checker_message(result: tuple | None, limits: Limits) -> str:
    """What the feedback says of one check, from the judge's (status, stdout, ename, evalue)."""
    if result is None:
        return "not graded: the checks stopped before this one (see the notes)"
    status, stdout, ename, evalue = result
    if ename == "CellTimeout":
        return f"the check did not finish within the grader's limit of {limits.cell_timeout:g} s per cell"
    if status != "ok":  # a submission's text, shortened: it saw nothing of the host's to put there
        first = evalue.strip().splitlines()[0][:300] if evalue.strip() else ""
        return first if ename in ("ExerciseFailed", "GradingRefused") else f"{ename[:100]}: {first}"
    lines = [line for line in stdout.splitlines() if line.strip() and not line.startswith("(note:")]
    if not lines:
        return "passed"
    # The checker's verdict: its last message, whose lines past the first are indented (checkers wrap it)
    start = next((i for i in range(len(lines) - 1, -1, -1) if not lines[i].startswith(" ")), len(lines) - 1)
    return " ".join(line.strip() for line in lines[start:])[:300]


def _marker(exercise: Exercise, token: str) -> str:
    """The kernel's stand-in for a check (the check itself runs in the judge): it prints ``token``, so a
    cell that did not run as the grader wrote it (an IPython input transformer, a hook) is seen."""
    return (f"# lessonlib.grading: {exercise.name} is checked apart from this kernel\n"
            f"print('lessonlib.grading: {exercise.name} is checked apart from this kernel [{token}]')")


def _graded_check(cell, exercise: Exercise, result: tuple | None) -> None:
    """The graded copy's checker cell: the pristine checker's source and what it printed and raised apart."""
    cell.source = exercise.checker_source
    cell.outputs = []
    if result is not None:
        status, stdout, ename, evalue = result
        if stdout:
            cell.outputs.append(nbformat.v4.new_output("stream", name="stdout", text=stdout))
        if status != "ok":
            cell.outputs.append(nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[]))


def grade_notebook(path: Path, pristine_name: str, exercises_: list[Exercise], scratch: Path, limits: Limits,
                   graded_copy: Path | None = None, mode: str = "none", slot: int = 0,
                   pristine: Path | None = None) -> NotebookReport:
    """Grade one submitted notebook against the instructor's exercises (see the module docstring): its kernel (in a
    sandbox of ``mode``, seeing of the course only ``pristine``, the released lessonlib) runs the cells for the
    feedback and the graded copy, while the judge and the runner (:func:`judge.score`), each in a sandbox of its own,
    run the pristine checks; a check's points need both the judge's "ok" and the kernel to have reached it."""
    from concurrent.futures import ThreadPoolExecutor

    start = time.monotonic()
    outcomes = {e.checker_id: Outcome(e) for e in exercises_}
    report = NotebookReport(path.name, list(outcomes.values()))
    try:
        submission = nbformat.reads(read_regular(path, MAX_NOTEBOOK_BYTES).decode("utf-8", "replace"), as_version=4)
    except Exception as e:  # truncated, not JSON, not a notebook
        for outcome in outcomes.values():
            outcome.message = "not graded: the file is not a valid notebook"
        report.notes.append(f"{path.name} is not a valid notebook ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        return report
    sources, checks, notes = plan(submission, exercises_)
    report.notes += notes
    box = sandbox.Box(mode, scratch / "s", scratch / "w", (), limits.work_bytes, limits.processes,
                      limits.file_bytes, slot, readable=(pristine,) if pristine else (), passwd=scratch / "passwd")
    sandbox.prepare(box)
    logs = (graded_copy.parent if graded_copy else scratch) / Path(pristine_name).stem
    token = secrets.token_hex(8)
    kernel_sources = ["# lessonlib.grading: the student's cells (each check runs apart, in a plain Python)"] + [
        _marker(checks[i], token) if i in checks else source for i, source in enumerate(sources) if i]
    logs.parent.mkdir(parents=True, exist_ok=True)
    boxes = {"runner": (box, _environment(box))}
    judge_box = dataclasses.replace(box, writable=scratch / "js", work=scratch / "jw")  # a sandbox of its own
    sandbox.prepare(judge_box)
    boxes["judge"] = (judge_box, _environment(judge_box))
    with ThreadPoolExecutor(max_workers=1) as pool:  # the judge, apart from the submission's runner
        scored = pool.submit(judge.score, sources, checks, exercises_, boxes, limits.notebook_timeout,
                             limits.cell_timeout, {role: logs.with_name(f"{logs.name}.{role}.txt") for role in boxes})
        executed, status, notes = _run_cells(kernel_sources, box, limits, logs.with_name(logs.name + ".kernel.txt"))
        results, score_notes = scored.result()
    report.notes += notes + score_notes
    for index, exercise in checks.items():
        outcome, result = outcomes[exercise.checker_id], results.get(index)
        outcome.message = _checker_message(result, limits)
        state = status.get(index, "not run")
        printed = "".join(o.get("text", "") for o in executed.cells[index].outputs) if state != "not run" else ""
        if state == "not run":
            outcome.message = "not graded: the notebook stopped before this check (see the notes)"
        elif f"[{token}]" not in printed:
            report.notes.append(f"{exercise.name}: the grader's cell did not run as written in the kernel (an IPython "
                                "input transformer or hook changed it); the points come from the check run apart")
        outcome.points = exercise.points if result and result[0] == "ok" and state != "not run" else 0.0
        _graded_check(executed.cells[index], exercise, result)
    if graded_copy is not None:
        graded_copy.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(executed, graded_copy)
    report.seconds = time.monotonic() - start
    return report
