"""The student copies: up to date, no solution in them, and every stub fails its checker."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import make_student_notebooks as gen  # noqa: E402
from lessonlib.grading.exercise_format import CHECK_CALL, REPORTED_CHECK  # noqa: E402

SOURCES = gen.sources()


def solution_lines(path: Path) -> set[str]:
    lines, inside = set(), False
    for cell in nbformat.read(path, as_version=4).cells:
        for line in cell.source.split("\n"):
            if line.strip() == gen.BEGIN:
                inside = True
            elif line.strip() == gen.END:
                inside = False
            elif inside and len(line.strip()) > 12:
                lines.add(line.strip())
    return lines


def test_every_course_notebook_has_exercises():
    assert {p.name for p in SOURCES} >= {"00_setup_and_roofline.ipynb", "01_operator_fusion.ipynb"}
    assert len(solution_lines(ROOT / "notebooks" / "01_operator_fusion.ipynb")) >= 10


def test_student_copies_are_up_to_date():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "make_student_notebooks.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_solution_leaks(path):
    student = (gen.STUDENT_DIR / path.name).read_text()
    assert gen.BEGIN not in student and gen.END not in student
    code = "\n".join(c.source for c in nbformat.reads(student, as_version=4).cells if c.cell_type == "code")
    leaked = [line for line in solution_lines(path) if line in code]
    assert not leaked, f"solution lines in the student copy of {path.name}: {leaked}"
    assert all(not c.get("outputs") for c in json.loads(student)["cells"])


def test_strip_solutions_keeps_indentation_and_picks_the_stub():
    kernel = "@triton.jit\ndef k(x_ptr):\n    a = 1\n    ### BEGIN SOLUTION\n    tl.store(x_ptr, a)\n    ### END SOLUTION\n"
    assert gen.strip_solutions(kernel) == "@triton.jit\ndef k(x_ptr):\n    a = 1\n    # YOUR CODE HERE\n    pass\n"
    python = "def f(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n"
    assert gen.strip_solutions(python) == "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError()\n"
    with pytest.raises(ValueError, match="without"):
        gen.strip_solutions("### BEGIN SOLUTION\nx = 1\n")


# "Run all" as Colab runs it: a real kernel, stopping at the first cell that raises, whatever its tags say (Colab
# ignores raises-exception; nbclient would honour it, so the tags are stripped). Prints each checker cell's reported
# failure (the red line on stderr) and how many there were.
RUNNER = r"""
import json, sys, nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
path, folder = sys.argv[1], sys.argv[2]
notebook = nbformat.read(path, as_version=4)
for cell in notebook.cells:
    cell.metadata.pop("tags", None)
client = NotebookClient(notebook, timeout=600, allow_errors=False, kernel_name="python3",
                        resources={"metadata": {"path": folder}})
try:
    client.execute()
except CellExecutionError as e:
    sys.exit(f"Run all stopped at a cell that raised:\n{str(e)[-3000:]}")
reported = {}
for cell in notebook.cells:
    if cell.metadata.get("nbgrader", {}).get("grade"):
        err = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stderr")
        reported[cell.metadata.nbgrader.grade_id] = [l for l in err.splitlines() if l.startswith("\x1b[31m✗ ")]
print("REPORTED", json.dumps(reported))
print("checks failed:", sum(len(lines) for lines in reported.values()))
"""


def reported_failures(stdout: str) -> dict[str, list[str]]:
    """The runner's {checker grade_id: its red lines}."""
    line = next(line for line in stdout.splitlines() if line.startswith("REPORTED "))
    return json.loads(line.removeprefix("REPORTED "))


WITH_EXERCISES = [p for p in SOURCES if solution_lines(p)]


def why_not_here(path: Path) -> str | None:
    """Why this copy cannot run on this machine, or None. Lesson 06 installs vLLM in its first cell when none is
    there; where it cannot (the lab's GPU machine has no vLLM and no network), the copy cannot run."""
    from lessonlib.serving import vllm_build

    if path.name == "06_vllm.ipynb" and vllm_build() is None:
        return "vLLM is not installed here and lesson 06 needs it (`make setup` installs it)"
    return None


RUNNABLE = [p for p in WITH_EXERCISES if why_not_here(p) is None]


# On a GPU the copies run beside the suite's other workers (pytest -n): each plans for this part of the card's memory
# (runtime.GPUProfile.memory_budget), not for the card alone as on Colab. A copy that plans for three quarters of an
# H200 holds ~100 GB at once (lesson 02's naive attention at N=16,384), and the workers beside it then run out.
GPU_SHARE = "0.4"


def run_student_copy(student: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", RUNNER, str(student), str(student.parent)], capture_output=True,
                              text=True, cwd=student.parent, timeout=600,
                              env={**os.environ, "MPLBACKEND": "Agg", "LESSONLIB_GPU_SHARE": GPU_SHARE})
    except subprocess.TimeoutExpired as e:  # this copy's test fails, not every test of the module
        return subprocess.CompletedProcess(e.cmd, -1, e.stdout or "", f"{student.name} ran past {e.timeout} s")


@pytest.fixture(scope="module")
def student_runs() -> dict[str, subprocess.CompletedProcess]:
    """Every student copy run top to bottom: two at a time on the CPU (CI has two cores; each run is one process),
    one at a time on a GPU. A notebook sizes its problems (and lesson 07 its KV pool) by the card's memory budget,
    three quarters of the card, as if it had the card to itself, which it does on Colab: two at once can run the card
    out of memory (on the H200, 01's copy met another process holding 97 GiB: "CUDA out of memory ... 794.81 MiB
    is free"). Each also plans for GPU_SHARE of the card only, for the workers running beside it."""
    from lessonlib import runtime

    with ThreadPoolExecutor(max_workers=1 if runtime.on_gpu() else 2) as pool:
        names = [p.name for p in RUNNABLE]
        return dict(zip(names, pool.map(run_student_copy, [gen.STUDENT_DIR / name for name in names])))


@pytest.mark.parametrize("path", [p if why_not_here(p) is None else
                                  pytest.param(p, marks=pytest.mark.skip(reason=why_not_here(p)))
                                  for p in WITH_EXERCISES], ids=lambda p: p.name)
def test_stubs_fail_their_checks(path, student_runs):
    """Run the untouched student copy top to bottom as Colab's "Run all" does (stopping at the first cell that
    raises, tags ignored): it reaches the end, and each checker cell shows exactly one failure, "not implemented
    yet", naming the stub to write."""
    student = nbformat.read(gen.STUDENT_DIR / path.name, as_version=4)
    stubs = {c.metadata.nbgrader.grade_id: CHECK_CALL.search(c.source).group(2) for c in student.cells
             if c.metadata.get("nbgrader", {}).get("grade")}
    result = student_runs[path.name]
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"checks failed: {len(stubs)}" in result.stdout
    reported = reported_failures(result.stdout)
    assert reported.keys() == stubs.keys()
    for checker, lines in reported.items():
        assert len(lines) == 1 and f"✗ {stubs[checker]}: " in lines[0] and "not implemented yet" in lines[0], lines


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.name)
def test_student_checker_cells_report_and_instructor_ones_raise(path):
    """The one difference between the copies at a checker cell: the instructor's is the plain call (it raises, so
    nbval fails on a wrong solution or library kernel), the student's runs it inside ``reported`` (so Run all goes
    on). No cell is tagged raises-exception: nothing relies on a tag that Colab ignores."""
    instructor = nbformat.read(path, as_version=4)
    copy = gen.student_copy(instructor)
    for mine, theirs in zip(instructor.cells, copy.cells):
        assert "raises-exception" not in theirs.metadata.get("tags", [])
        if mine.metadata.get("nbgrader", {}).get("grade"):
            call = CHECK_CALL.fullmatch(mine.source.strip())
            assert call, mine.source
            assert theirs.source == REPORTED_CHECK.format(stub=call.group(2), call=call.group(0))
        elif mine.cell_type == "code":
            assert "reported(" not in theirs.source


def run_in_kernel(notebook: nbformat.NotebookNode, folder: Path):
    """Run ``notebook`` in a fresh kernel, stopping at the first error as nbval and Colab do."""
    from nbclient import NotebookClient

    NotebookClient(notebook, timeout=300, allow_errors=False, kernel_name="python3",
                   resources={"metadata": {"path": str(folder)}}).execute()


def test_a_wrong_solution_fails_the_instructor_notebook_but_not_run_all_in_the_student_copy(tmp_path):
    """Plant a wrong answer in lesson 03's first exercise (its set-up, that exercise, then a last cell): the
    instructor notebook stops at the checker with ExerciseFailed, as nbval would; its student copy (the same wrong
    answer, outside the solution markers, survives in it) shows the failure and runs on to the last cell."""
    from nbclient.exceptions import CellExecutionError

    notebook = nbformat.read(ROOT / "notebooks" / "03_paged_attention.ipynb", as_version=4)
    setup = next(i for i, c in enumerate(notebook.cells) if "lessonlib.exercises import" in c.source)
    solution = next(i for i, c in enumerate(notebook.cells) if c.metadata.get("nbgrader", {}).get("solution"))
    cells = notebook.cells[: setup + 1] + notebook.cells[solution: solution + 2]
    cells[-2].source = ("def my_physical_slot(position, block_table, block_size):\n"  # block and offset swapped
                        "    return position % block_size, block_table[position // block_size]\n")
    notebook.cells = cells + [nbformat.v4.new_code_cell('print("reached the last cell")')]
    assert cells[-1].metadata.nbgrader.grade_id == "check_physical_slot"
    with pytest.raises(CellExecutionError) as failed:
        run_in_kernel(nbformat.from_dict(notebook), tmp_path)
    assert failed.value.ename == "ExerciseFailed" and "check_physical_slot(my_physical_slot)" in str(failed.value)
    student = gen.student_copy(notebook)
    run_in_kernel(student, tmp_path)
    shown = "".join(o.get("text", "") for o in student.cells[-2].outputs if o.get("name") == "stderr")
    assert shown.startswith("\x1b[31m✗ my_physical_slot: ") and "not implemented" not in shown, shown
    assert "reached the last cell" in student.cells[-1].outputs[0].text


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.name)
def test_student_copies_keep_nbgrader_metadata_and_lock_the_checkers(path):
    """A submission names its exercises by nbgrader's grade_id (the grader pairs cells by it), and JupyterLab
    refuses to delete a solution cell or to edit or delete a checker cell, as in nbgrader's release."""
    student = nbformat.read(gen.STUDENT_DIR / path.name, as_version=4)
    marked = [c for c in student.cells if "nbgrader" in c.metadata]
    assert marked and len(marked) == 2 * len(gen.exercises(nbformat.read(path, as_version=4), path.name))
    for c in marked:
        if c.metadata.nbgrader["solution"]:
            assert c.metadata["deletable"] is False and "editable" not in c.metadata
            assert "# YOUR CODE HERE" in c.source
        else:
            assert c.metadata["deletable"] is False and c.metadata["editable"] is False
            assert c.source.startswith(REPORTED_CHECK.split("{")[0])


def test_a_student_copys_links_to_the_appendix_resolve_from_its_folder():
    """A lesson's link to a lesson stays (the student copy beside it); one to the appendix or a file of the course
    goes one folder up, and every relative link in every student copy names a file that exists."""
    import re

    import make_student_notebooks as tool

    text = "[the appendix](appendix_measurements.ipynb), [lesson 01](01_operator_fusion.ipynb), `k[grid](...)`"
    assert tool.one_folder_down(text) == ("[the appendix](../appendix_measurements.ipynb), "
                                          "[lesson 01](01_operator_fusion.ipynb), `k[grid](...)`")
    for path in sorted((ROOT / "notebooks" / "student").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "markdown":
                for target in tool.RELATIVE_LINK.findall(cell.source):
                    assert (path.parent / target.split("#")[0]).exists(), (path.name, target)
