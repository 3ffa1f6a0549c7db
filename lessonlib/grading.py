"""Grade the course's exercises: the exercise format, student copies, nbgrader, and a grader with no server.

    python -m lessonlib.grading SUBMISSIONS [--out DIR]      # or: make grade SUBMISSIONS=folder

``SUBMISSIONS`` holds one folder per student (its name is the student's id) with that student's notebooks anywhere
inside it, named as the course names them (``03_paged_attention.ipynb``; a download suffix such as
``03_paged_attention (1).ipynb`` is fine: the two-digit prefix picks the lesson). nbgrader's ``submitted/`` folder
has that layout. The grader writes ``grades.csv`` (one row per student, one column per exercise, then the total),
``feedback/<student>.txt`` (each checker's message) and ``graded/<student>/<notebook>`` (the notebook as it ran).

**The exercise format.** In an instructor notebook an exercise is a solution cell (its answer between
``### BEGIN SOLUTION`` and ``### END SOLUTION``) and, below it, a checker cell ``check_x(my_x)`` calling
:mod:`lessonlib.exercises`. Both carry nbgrader's cell metadata (``metadata.nbgrader``: ``solution``, ``grade``,
``points``, ``grade_id``, ``locked``), which is the one place points are written. :func:`student_copy` strips the
solutions as nbgrader's ``generate_assignment`` does (:func:`configure_nbgrader` makes nbgrader use the same stub).

**How a submission is graded.** Each notebook runs headless in a fresh kernel (nbclient) whose working directory,
``HOME`` and ``TMPDIR`` are a scratch folder of the grader's, with a time limit per cell and per notebook and a
cap on the output kept per cell. The student's cells run in their order, except checker cells: every cell that is one
(by its nbgrader metadata) or is nothing but a checker call is replaced by the instructor's pristine checker, which
also runs right after the student's solution cell when the checker cell was deleted. Lesson cells after the last
checker are not run: they cannot change a grade. The pristine checker runs with ``lessonlib``'s checking modules
imported fresh from disk (the student's imported copies are set aside, then put back), so a checker cell that was
edited or deleted, a ``check_x`` redefined in the notebook, or a patched ``lessonlib.exercises`` or
``lessonlib.testing`` changes nothing. Before each check the grader also looks for tampering: a function of
``lessonlib``, of ``torch`` (``torch``, ``torch.Tensor``, ``torch.nn.functional``, ``torch.testing``,
``torch.linalg``), of ``builtins``, ``math`` or ``random``, or an import hook, replaced since the kernel started by
code that is not an installed library's (a lambda or ``def`` from a notebook cell, an object of a class defined
there, a fake module in ``sys.modules``). Tampering gives no points for every exercise checked after it, and the
feedback names what was replaced. An exercise gets its points when its pristine checker cell finishes without an
error; its message is the checker's last line (or its error). A notebook that hangs (interrupted at the cell limit;
killed when it stays busy), kills its kernel, raises, prints megabytes (cut at the cap), is not valid JSON or has
lost cells is graded for what ran, with the reason in the feedback; the other notebooks and students are graded as
usual.

**Not defended** (the threat is a student who wants a check to pass without solving the exercise, by editing or
shadowing checks or by patching what they call; not an attack on the grader itself, which runs in the same Python
process as the student's code): code that finds the grader's own functions in the kernel and edits them or their
snapshot, rewrites frames or code objects, or patches with a C function or a function of an installed library
(``torch.allclose = torch.equal``: library code is trusted, so that libraries may wrap torch's functions);
patches of modules other than those listed; files written by absolute path outside the scratch folder (grade
untrusted work in a container or as a separate user); a solution that calls ``lessonlib.reference`` or
``lessonlib.ops`` (not tampering: the instructor reads the code in ``graded/``).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import csv
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

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
ROOT = Path(__file__).resolve().parents[1]
COURSE_NOTEBOOKS = ROOT / "notebooks"  # the instructor notebooks in a checkout of the course


# ---------------------------------------------------------------------------------------------------------------
# The exercise format and the student copies.


def _in_triton_kernel(lines: list[str], index: int, indent: int) -> bool:
    """Is line ``index`` inside a function decorated with @triton.jit? Looks up to the enclosing ``def``."""
    for j in range(index - 1, -1, -1):
        stripped = lines[j].lstrip()
        if stripped.startswith("def ") and len(lines[j]) - len(stripped) < indent:
            return j > 0 and lines[j - 1].strip() in ("@triton.jit", "@jit")
    return False


def strip_solutions(source: str) -> str:
    """Replace each solution block with a stub of the block's indentation: ``pass`` inside a ``@triton.jit``
    function (a ``raise`` there would not compile on a GPU; the checker reports the untouched, still-NaN output as
    "not implemented yet"), nbgrader's ``raise NotImplementedError()`` anywhere else."""
    lines = source.split("\n")
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.strip() != BEGIN:
            if line.strip() == END:
                raise ValueError(f"{END} without {BEGIN}:\n{source}")
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        pad = line[:indent]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == END), None)
        if end is None:
            raise ValueError(f"{BEGIN} without {END}:\n{source}")
        out.append(f"{pad}# YOUR CODE HERE")
        out.append(f"{pad}pass" if _in_triton_kernel(lines, i, indent) else f"{pad}raise NotImplementedError()")
        i = end + 1
    return "\n".join(out)


def _nbgrader(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) if isinstance(cell, dict) else {}


def lock(cell) -> None:
    """Lock a cell as nbgrader's LockCells does: solution cells cannot be deleted, checker cells cannot be deleted
    or edited (JupyterLab honours both)."""
    meta = _nbgrader(cell)
    if meta.get("solution"):
        cell.metadata["deletable"] = False
    elif meta.get("grade") or meta.get("locked"):
        cell.metadata["deletable"] = False
        cell.metadata["editable"] = False


def student_copy(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook a student gets: solutions stripped, outputs cleared, exercise cells locked; what
    ``nbgrader generate_assignment`` releases, less nbgrader's gradebook checksums."""
    copy = nbformat.from_dict(notebook)
    for cell in copy.cells:
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source)
            cell.outputs = []
            cell.execution_count = None
        lock(cell)
    return copy


@dataclass(frozen=True)
class Exercise:
    """One exercise of an instructor notebook: its solution cell, its checker cell and its points."""

    name: str  # the checker's name without check_: "physical_slot"; a column of grades.csv
    notebook: str  # file name of the instructor notebook
    solution_id: str  # nbgrader grade_id of the solution cell: the function it defines, "my_physical_slot"
    checker_id: str  # nbgrader grade_id of the checker cell: the checker's name, "check_physical_slot"
    points: float
    checker_source: str  # the pristine checker cell


def exercises(notebook: nbformat.NotebookNode, name: str) -> list[Exercise]:
    """The exercises of an instructor notebook, in order, from nbgrader's metadata. A checker cell pairs with the
    closest solution cell above it."""
    found, solution = [], None
    for cell in notebook.cells:
        meta = _nbgrader(cell)
        if meta.get("solution"):
            solution = meta["grade_id"]
        elif meta.get("grade"):
            if solution is None:
                raise ValueError(f"{name}: checker cell {meta['grade_id']!r} has no solution cell above it")
            checker = meta["grade_id"]
            found.append(Exercise(checker.removeprefix("check_"), name, solution, checker, meta["points"],
                                  cell.source))
    return found


def configure_nbgrader(c) -> None:
    """Configure nbgrader for this course; a course folder's ``nbgrader_config.py`` calls it (written by
    ``tools/make_student_notebooks.py --nbgrader-course DIR``). nbgrader's own ClearSolutions would put a ``raise``
    inside the ``@triton.jit`` kernels of lesson 01, which does not compile on a GPU: the course's stub rule
    (:func:`strip_solutions`) replaces it, so nbgrader releases exactly the committed student copies."""
    from nbgrader.converters import GenerateAssignment
    from nbgrader.preprocessors import ClearSolutions

    class CourseClearSolutions(ClearSolutions):
        def _replace_solution_region(self, cell, language):
            stripped = strip_solutions(cell.source)
            replaced = stripped != cell.source
            cell.source = stripped
            return replaced

    # The trait's default() (its default_value is a Sentinel under traitlets 5.x: iterating it raised, nbgrader logged
    # the broken config and released with its own stubs, which the triton exercises of 02 and 03 exposed).
    default = GenerateAssignment.class_traits()["preprocessors"].default()
    c.GenerateAssignment.preprocessors = [CourseClearSolutions if p is ClearSolutions else p for p in default]
    c.Execute.timeout = 600  # seconds per cell, as the course's nbval runs allow


# ---------------------------------------------------------------------------------------------------------------
# What runs inside the student's kernel. Written out as source: the kernel is another process, and the grader must
# not depend on anything the student's code can replace before it runs (the prelude runs before any student cell).

KERNEL_SIDE = r'''
import builtins, functools, importlib, math, os, random, sys, types

import torch
import torch.nn.functional
import torch.testing
import torch.linalg

WATCHED = ("builtins", "math", "random", "torch", "torch.nn.functional", "torch.testing", "torch.linalg")
# lessonlib's checking modules: imported fresh for every check. The others (ops, serving...) own process-wide
# state (compiled kernels, registered custom ops, a vLLM engine) and are only watched for replaced functions.
FRESH = ("runtime", "reference", "testing", "exercises", "kv_cache", "compiler")
SCRATCH = os.path.realpath(os.environ["LESSONLIB_GRADING_SCRATCH"])
LIBRARIES = tuple(sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path)
                          if p and os.path.isdir(p) and not os.path.realpath(p).startswith(SCRATCH)}))


class GradingRefused(Exception):
    """The notebook replaced something the checks rely on: no points for this check."""


def _file_of(obj):
    code = getattr(obj, "__code__", None) or getattr(getattr(obj, "__func__", None), "__code__", None)
    if code is not None:
        return code.co_filename
    if isinstance(obj, type):
        return getattr(sys.modules.get(obj.__module__), "__file__", None)
    return None


C_CODE = (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType, types.MethodWrapperType,
          types.MethodDescriptorType, types.ClassMethodDescriptorType)


def _is_library(obj):
    """Defined in a file of an installed library (or lessonlib itself), not in a notebook cell or the scratch.
    C functions count as a library's (a notebook cannot write one); a partial by what it wraps; any other callable
    object by its class."""
    if isinstance(obj, C_CODE):
        return True
    if isinstance(obj, functools.partial):
        return _is_library(obj.func)
    if not isinstance(obj, (type, types.FunctionType, types.MethodType)):
        return _is_library(type(obj))
    if _is_library_file(_file_of(obj)):
        return True
    # Code that a library made with exec (dataclasses' __init__, namedtuple's __new__): file "<string>", globals
    # those of the library's module. exec in a notebook cell has the notebook's globals (__main__).
    function = getattr(obj, "__func__", obj)
    code, module = getattr(function, "__code__", None), sys.modules.get(getattr(function, "__module__", None) or "")
    return (code is not None and code.co_filename.startswith("<") and module is not None
            and module.__name__ != "__main__" and getattr(function, "__globals__", None) is vars(module)
            and _is_library_file(getattr(module, "__file__", None)))


def _is_library_file(path):
    if not path or not os.path.isfile(path):
        return False
    path = os.path.realpath(path)
    return not path.startswith(SCRATCH) and path.startswith(LIBRARIES)


def _state():
    modules = {name: sys.modules.get(name) for name in WATCHED}
    values = {name: dict(vars(module)) for name, module in modules.items() if module is not None}
    values["torch.Tensor"] = dict(vars(torch.Tensor))
    return modules, values, list(sys.meta_path), list(sys.path_hooks)


_SNAPSHOT = _state()


def _lessonlib_changes():
    changes = []
    for name, module in list(sys.modules.items()):
        if name != "lessonlib" and not name.startswith("lessonlib."):
            continue
        if not isinstance(module, types.ModuleType) or not _is_library_file(getattr(module, "__file__", None)):
            changes.append(f"sys.modules[{name!r}]")
            continue
        for key, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType) and not _is_library(value):
                changes.append(f"{name}.{key}")
            elif isinstance(value, type) and value.__module__ == name:
                for attr, member in list(vars(value).items()):
                    member = getattr(member, "__func__", None) or getattr(member, "fget", None) or member
                    if isinstance(member, types.FunctionType) and not _is_library(member):
                        changes.append(f"{name}.{key}.{attr}")
    return changes


def changes():
    """What was replaced since the prelude by code that is not a library's."""
    modules, values, meta_path, path_hooks = _SNAPSHOT
    found = _lessonlib_changes()
    for name, module in modules.items():
        if module is not None and sys.modules.get(name) is not module:
            found.append(f"sys.modules[{name!r}]")
    current = {name: vars(module) for name, module in modules.items() if module is not None}
    current["torch.Tensor"] = vars(torch.Tensor)
    for name, before in values.items():
        now = current[name]
        for key, old in before.items():
            new = now.get(key, GradingRefused)
            if new is not old and (callable(old) or callable(new)) and not _is_library(new):
                found.append(f"{name}.{key}")
    for hooks, before in ((sys.meta_path, meta_path), (sys.path_hooks, path_hooks)):
        found += [f"import hook {type(h).__name__}" for h in hooks if h not in before and not _is_library(type(h))]
    return found


def _fresh(name):
    return name == "lessonlib" or (name.startswith("lessonlib.") and name.split(".")[1] in FRESH)


def _of_exercises(obj):
    """Defined in lessonlib.exercises (one of its lesson modules)."""
    return (getattr(obj, "__module__", None) or "").startswith("lessonlib.exercises.")


def check(exercise, source, namespace):
    """Run the pristine checker cell ``source`` against the student's names, with lessonlib's checkers fresh."""
    replaced = changes()
    if replaced:
        raise GradingRefused(f"no points for {exercise}: the notebook replaced what the checks rely on: "
                             + ", ".join(replaced[:8]) + (" ..." if len(replaced) > 8 else ""))
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if _fresh(name)}
    try:
        exercises = importlib.import_module("lessonlib.exercises")
        scope = dict(namespace)
        for name in dir(exercises):
            checker = getattr(exercises, name)
            if name.startswith("check_") and _of_exercises(checker):
                if name in namespace and not _of_exercises(namespace[name]):
                    print(f"(note: {name} was redefined in the notebook; lessonlib's own {name} ran)")
                scope[name] = checker
        exec(compile(source, f"<checker of {exercise}>", "exec"), scope)
    finally:
        for name in [name for name in sys.modules if _fresh(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
'''

PRELUDE = f"""\
# lessonlib.grading: set up before the student's first cell (snapshot of what the checks rely on)
import sys as _s, types as _t
_s.modules["_lessonlib_grading"] = _m = _t.ModuleType("_lessonlib_grading")
exec({KERNEL_SIDE!r}, _m.__dict__)
del _s, _t, _m
"""


def checker_cell(exercise: Exercise) -> str:
    return (f"# lessonlib.grading: the instructor's checker for {exercise.name}, with lessonlib's checkers fresh\n"
            f"__import__('sys').modules['_lessonlib_grading'].check({exercise.name!r}, "
            f"{exercise.checker_source!r}, globals())")


# ---------------------------------------------------------------------------------------------------------------
# Running one notebook.


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


def _run_cells(sources: list[str], workdir: Path, scratch: Path, limits: Limits):
    """Execute ``sources`` in one fresh kernel. Returns (executed notebook, {index: status}, notes) where status
    is "ok", "error", "timeout" or "not run"."""
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    class CappedClient(NotebookClient):
        """Keeps at most ``limits.output_cap`` characters of output per cell (error outputs shortened, kept)."""

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

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    notebook.metadata["kernelspec"] = {"name": "lessonlib-grading", "display_name": "lessonlib grading",
                                       "language": "python"}
    home, tmp = scratch / "home", scratch / "tmp"
    home.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp), "MPLBACKEND": "Agg",
           "LESSONLIB_SCRATCH": str(scratch / "lessonlib"), "LESSONLIB_GRADING_SCRATCH": str(scratch),
           "XDG_CACHE_HOME": str(home / ".cache"), "PYTHONUSERBASE": site.getuserbase(),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    status, notes, replies = {}, [], {}
    km = AsyncKernelManager(kernel_name="lessonlib-grading", kernel_spec_manager=_kernel_spec_manager(scratch))
    client = CappedClient(notebook, km=km, timeout=int(limits.cell_timeout), allow_errors=True,
                          interrupt_on_timeout=True, record_timing=False,
                          error_on_timeout={"ename": "CellTimeout", "evalue": "", "traceback": []},
                          resources={"metadata": {"path": str(workdir)}})
    client._kept = {}
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


# ---------------------------------------------------------------------------------------------------------------
# Grading a folder of submissions.


def course_exercises(course: Path) -> dict[str, list[Exercise]]:
    """{notebook file name: its exercises} for the instructor notebooks in ``course`` that have exercises."""
    found = {}
    for path in sorted(course.glob("[0-9][0-9]_*.ipynb")):
        listed = exercises(nbformat.read(path, as_version=4), path.name)
        if listed:
            found[path.name] = listed
    names = [e.name for listed in found.values() for e in listed]
    if len(names) != len(set(names)):
        raise ValueError(f"exercise names repeat across {course}: {names}")
    return found


def _match(path: Path, course: dict[str, list[Exercise]]) -> str | None:
    if path.name in course:
        return path.name
    prefix = re.match(r"(\d\d)_", path.name)
    return next((name for name in course if prefix and name.startswith(prefix.group(0))), None)


def _points(value: float) -> str:
    return f"{value:g}"


def grade(submissions: Path, out: Path, course: Path = COURSE_NOTEBOOKS, limits: Limits | None = None,
          keep_scratch: bool = False, jobs: int = 1, log=print) -> Path:
    """Grade every student folder in ``submissions``; write ``out/grades.csv``, ``out/feedback/`` and
    ``out/graded/``. ``jobs`` notebooks run at once (each in its own kernel). Returns the CSV's path."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    limits = limits or Limits()
    submissions, out = Path(submissions).resolve(), Path(out).resolve()
    course_ex = course_exercises(Path(course))
    students = sorted(p.name for p in submissions.iterdir() if p.is_dir() and not p.name.startswith("."))
    for stray in sorted(p for p in submissions.iterdir() if p.is_file()):
        log(f"ignored {stray.name}: put each student's notebooks in a folder named after the student")
    found: dict[tuple[str, str], Path] = {}  # (student, course notebook) -> submitted file
    for student in students:
        for path in sorted((submissions / student).rglob("*.ipynb")):
            name = _match(path, course_ex)
            if name and ".ipynb_checkpoints" not in path.parts:
                found.setdefault((student, name), path)
    graded_names = [name for name in course_ex if any(n == name for _, n in found)]
    columns = [e for name in graded_names for e in course_ex[name]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "feedback").mkdir(exist_ok=True)
    log(f"grading {len(found)} notebook(s) of {len(students)} student(s): {', '.join(graded_names) or 'none'}")

    def run(student: str, name: str) -> NotebookReport:
        scratch = out / "scratch" / student / Path(name).stem
        shutil.rmtree(scratch, ignore_errors=True)
        report = grade_notebook(found[student, name], name, course_ex[name], scratch, limits,
                                out / "graded" / student / name)
        if not keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        return report

    reports: dict[tuple[str, str], NotebookReport] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(run, *key): key for key in found}
        for done, future in enumerate(as_completed(futures), 1):
            student, name = futures[future]
            report = reports[student, name] = future.result()
            got, most = sum(o.points for o in report.outcomes), sum(e.points for e in course_ex[name])
            log(f"[{done}/{len(found)}] {student}: {name}: {_points(got)}/{_points(most)} points in "
                f"{report.seconds:.0f} s" + (f" ({report.notes[-1]})" if report.notes else ""))
    rows = []
    for student in students:
        listed = [reports.get((student, name)) or NotebookReport(name, [Outcome(e, 0.0, "not submitted")
                                                                        for e in course_ex[name]])
                  for name in graded_names]
        points = {o.exercise.name: o.points for r in listed for o in r.outcomes}
        rows.append([student] + [_points(points[e.name]) for e in columns] + [_points(sum(points.values()))])
        _write_feedback(out / "feedback" / f"{student}.txt", student, listed)
    if not keep_scratch:
        shutil.rmtree(out / "scratch", ignore_errors=True)
    csv_path = out / "grades.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student"] + [e.name for e in columns] + ["total"])
        writer.writerows(rows)
    log(f"wrote {csv_path} (maximum {_points(sum(e.points for e in columns))} points) and {out / 'feedback'}/")
    return csv_path


def _write_feedback(path: Path, student: str, reports: list[NotebookReport]) -> None:
    got = sum(o.points for r in reports for o in r.outcomes)
    most = sum(o.exercise.points for r in reports for o in r.outcomes)
    lines = [f"{student}: {_points(got)} of {_points(most)} points", ""]
    for report in reports:
        lines.append(report.name)
        for o in report.outcomes:
            lines.append(f"  {o.exercise.name}: {_points(o.points)}/{_points(o.exercise.points)}  {o.message}")
        lines += [f"  note: {note}" for note in report.notes]
        lines.append("")
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lessonlib.grading", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("submissions", type=Path, help="a folder with one folder of notebooks per student")
    parser.add_argument("--out", type=Path, help="where to write grades.csv, feedback/, graded/ "
                                                  "(default: SUBMISSIONS-graded next to SUBMISSIONS)")
    parser.add_argument("--course", type=Path, default=COURSE_NOTEBOOKS, help="the instructor notebooks")
    parser.add_argument("--cell-timeout", type=float, default=Limits.cell_timeout, help="seconds per cell")
    parser.add_argument("--notebook-timeout", type=float, default=Limits.notebook_timeout, help="seconds per notebook")
    parser.add_argument("--output-cap", type=int, default=Limits.output_cap, help="characters of output kept per cell")
    parser.add_argument("--keep-scratch", action="store_true", help="keep each run's working folder (out/scratch)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (one kernel each)")
    args = parser.parse_args(argv)
    if not args.submissions.is_dir():
        parser.error(f"{args.submissions} is not a folder")
    if not args.course.is_dir():
        parser.error(f"{args.course} is not a folder of instructor notebooks: pass --course")
    out = args.out or args.submissions.resolve().parent / f"{args.submissions.resolve().name}-graded"
    grade(args.submissions, out, args.course, Limits(args.cell_timeout, args.notebook_timeout, args.output_cap),
          args.keep_scratch, args.jobs, log=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
