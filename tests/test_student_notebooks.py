"""The student copies: up to date, no solution in them, and every stub fails its checker."""

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import make_student_notebooks as gen  # noqa: E402

SOURCES = gen.sources()
CHECK_CALL = re.compile(r"^check_\w+\(my_\w+\)\s*$", re.M)


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


RUNNER = r'''
import linecache, re, sys, nbformat, matplotlib
matplotlib.use("Agg")
from lessonlib.exercises import ExerciseFailed
path, pattern = sys.argv[1], sys.argv[2]
check_call = re.compile(pattern, re.M)
namespace = {"__name__": "__main__"}
checked = 0


def run(source, index):
    # Registered with linecache, as IPython does, so that inspect (and so Triton's compiler) finds the source.
    filename = f"<cell-{index}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)


for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
    if cell.cell_type != "code":
        continue
    if check_call.search(cell.source):
        if "raises-exception" not in cell.metadata.get("tags", []):  # "Run all" in JupyterLab would stop here
            sys.exit(f"a checker cell without the raises-exception tag: {cell.source.strip()}")
        try:
            run(cell.source, index)
        except ExerciseFailed as e:
            print("FAILED AS EXPECTED:", str(e).splitlines()[0])
            checked += 1
            continue
        sys.exit(f"a stub passed its check: {cell.source.strip()}")
    else:
        run(cell.source, index)
print("checks failed:", checked)
'''


WITH_EXERCISES = [p for p in SOURCES if solution_lines(p)]


def why_not_here(path: Path) -> str | None:
    """Why this copy cannot run on this machine, or None. Lesson 06 installs vLLM in its first cell when none is
    there; where it cannot (the lab's GPU machine has no vLLM and no network), the copy cannot run."""
    from lessonlib.serving import vllm_build

    if path.name == "06_vllm.ipynb" and vllm_build() is None:
        return "vLLM is not installed here and lesson 06 needs it (`make setup` installs it)"
    return None


RUNNABLE = [p for p in WITH_EXERCISES if why_not_here(p) is None]


def run_student_copy(student: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", RUNNER, str(student), CHECK_CALL.pattern], capture_output=True,
                              text=True, cwd=student.parent, timeout=600, env={**os.environ, "MPLBACKEND": "Agg"})
    except subprocess.TimeoutExpired as e:  # this copy's test fails, not every test of the module
        return subprocess.CompletedProcess(e.cmd, -1, e.stdout or "", f"{student.name} ran past {e.timeout} s")


@pytest.fixture(scope="module")
def student_runs() -> dict[str, subprocess.CompletedProcess]:
    """Every student copy run top to bottom, two at a time (CI has two cores; each run is one process)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        names = [p.name for p in RUNNABLE]
        return dict(zip(names, pool.map(run_student_copy, [gen.STUDENT_DIR / name for name in names])))


@pytest.mark.parametrize("path", [p if why_not_here(p) is None else
                                  pytest.param(p, marks=pytest.mark.skip(reason=why_not_here(p)))
                                  for p in WITH_EXERCISES], ids=lambda p: p.name)
def test_stubs_fail_their_checks(path, student_runs):
    """Run the student copy top to bottom (as a student who filled in nothing would, with "Run all"): each exercise
    check fails, in a cell tagged raises-exception so that the run goes on, and the lesson runs to its end."""
    student = gen.STUDENT_DIR / path.name
    expected = len(CHECK_CALL.findall("\n".join(c.source for c in nbformat.read(student, as_version=4).cells)))
    result = student_runs[path.name]
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"checks failed: {expected}" in result.stdout
    assert result.stdout.count("not implemented yet") == expected, result.stdout


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.name)
def test_student_copy_tags_every_checker_cell_raises_exception(path):
    """"Run all" must reach the end of an untouched student copy: JupyterLab goes on past a failing cell only when
    it is tagged raises-exception. Only the checker cells are: a lesson cell that fails still stops the run."""
    copy = gen.student_copy(nbformat.read(path, as_version=4))
    for cell in copy.cells:
        tagged = "raises-exception" in cell.metadata.get("tags", [])
        assert tagged == bool(cell.metadata.get("nbgrader", {}).get("grade")), cell.source[:80]


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
            assert CHECK_CALL.fullmatch(c.source.strip())
