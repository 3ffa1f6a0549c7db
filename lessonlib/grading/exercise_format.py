"""The exercise format and the student copies: solution blocks between ``### BEGIN SOLUTION`` and ``### END SOLUTION``,
checker cells ``check_x(my_x)``, both marked by nbgrader's cell metadata (see :mod:`lessonlib.grading`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


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


CHECK_CALL = re.compile(r"(check_\w+)\((my_\w+)\)")  # an instructor notebook's checker cell: check_x(my_x)
# A student copy's checker cell: the same call, its failure shown rather than raised (lessonlib.exercises.reported).
REPORTED_CHECK = """from lessonlib.exercises import reported  # an unsolved check is shown in red; "Run all" goes on
with reported("{stub}"):
    {call}"""


def report_checker(cell) -> None:
    """Make a checker cell ``check_x(my_x)`` the student copy's :data:`REPORTED_CHECK`: a failed check is shown
    (one red line naming ``my_x``) and the cell ends without an error, so "Run all" goes on to the later cells, which
    use lessonlib's own versions, on Colab as in JupyterLab (Colab ignores the ``raises-exception`` tag). The
    instructor notebook keeps the plain call, which raises: nbval fails on a wrong solution or library kernel.
    Grading is unchanged: lessonlib's grader runs the instructor's checker cell, and nbgrader (which sets
    ``NBGRADER_EXECUTION``) sees :func:`~lessonlib.exercises.reported` raise."""
    meta = _nbgrader(cell)
    if not meta.get("grade") or meta.get("solution"):
        return
    call = CHECK_CALL.fullmatch(cell.source.strip())
    if call is None:
        raise ValueError(f"checker cell {meta.get('grade_id')!r} is not one call check_x(my_x): {cell.source!r}")
    cell.source = REPORTED_CHECK.format(stub=call.group(2), call=call.group(0))


def student_copy(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook a student gets: solutions stripped, outputs cleared, exercise cells locked, checker cells
    reporting their failure (:func:`report_checker`); what ``nbgrader generate_assignment`` releases, less
    nbgrader's gradebook checksums."""
    copy = nbformat.from_dict(notebook)
    for cell in copy.cells:
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source)
            cell.outputs = []
            cell.execution_count = None
        lock(cell)
        report_checker(cell)
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
    (:func:`strip_solutions`) replaces it, and checker cells become :func:`report_checker`'s, so nbgrader releases
    exactly the committed student copies (its gradebook keeps that cell; its autograde sets ``NBGRADER_EXECUTION``,
    under which the cell raises a failed check)."""
    from nbgrader.converters import GenerateAssignment
    from nbgrader.preprocessors import ClearSolutions, LockCells

    class CourseClearSolutions(ClearSolutions):
        def _replace_solution_region(self, cell, language):
            stripped = strip_solutions(cell.source)
            replaced = stripped != cell.source
            cell.source = stripped
            return replaced

    # The trait's default() (its default_value is a Sentinel under traitlets 5.x: iterating it raised, nbgrader logged
    # the broken config and released with its own stubs, which the triton exercises of 02 and 03 exposed).
    class CourseLockCells(LockCells):  # and writes the checker cells as student_copy does
        def preprocess_cell(self, cell, resources, index):
            cell, resources = super().preprocess_cell(cell, resources, index)
            report_checker(cell)
            return cell, resources

    default = GenerateAssignment.class_traits()["preprocessors"].default()
    course = {ClearSolutions: CourseClearSolutions, LockCells: CourseLockCells}
    c.GenerateAssignment.preprocessors = [course.get(p, p) for p in default]
    c.Execute.timeout = 600  # seconds per cell, as the course's nbval runs allow
