"""The grader (lessonlib.grading) on real submissions built from the course's own notebooks, and nbgrader itself on
the course as it is.

Cost on 2 cores, in the interpreter: the full notebooks 03 and 05 (the cheapest with exercises: 15 s and 13 s through
nbclient here, 2026-12-01) run as instructor and untouched student copies, once through the grader and once through
nbgrader's autograde (which also releases and autogrades lesson 01, a kernel lesson); every other case (wrong answers, tampering, hangs, crashes, floods, broken files) runs a
trimmed notebook 03 (its set-up cells and its two quick exercises), two at a time.
"""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from lessonlib import grading
from tests.grading_helpers import sandbox_or_skip

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
PAGED = "03_paged_attention.ipynb"  # exercises physical_slot (1 point) and free_sequence (2 points)
GRAPHS = "05_cuda_graphs.ipynb"  # exercise refresh_static_inputs (1 point)
FUSION = "01_operator_fusion.ipynb"  # a kernel lesson: its exercises are @triton.jit kernels

WRONG = {  # one wrong answer per exercise (the checker explains each)
    "my_physical_slot": "def my_physical_slot(position, block_table, block_size):\n"
                        "    return block_table[position // block_size], position // block_size\n",
    "my_free_sequence": "def my_free_sequence(table, ref_counts, free_blocks):\n"  # no double-free check
                        "    for block in table:\n        ref_counts[block] -= 1\n"
                        "        if ref_counts[block] == 0:\n            free_blocks.append(block)\n",
    "my_refresh_static_inputs": "def my_refresh_static_inputs(static, new):\n    static.update(new)\n",
}


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOKS / name, as_version=4)


def cell(notebook, grade_id):
    return next(c for c in notebook.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def edited(notebook, **sources):
    """A copy with the cells of these grade_ids given new sources (None deletes the cell)."""
    copy = nbformat.from_dict(notebook)
    for grade_id, source in sources.items():
        target = cell(copy, grade_id)
        if source is None:
            copy.cells.remove(target)
        else:
            target.source = source
    return copy


TRIMMED = ("my_physical_slot", "my_free_sequence")  # notebook 03's two quick exercises (its kernel ones take minutes)


def trimmed(name: str) -> nbformat.NotebookNode:
    """The notebook's set-up (its cells up to the one that imports the checkers) and the exercises in TRIMMED: each
    exercise's markdown, solution and checker cells."""
    notebook = read(name)
    setup = next(i for i, c in enumerate(notebook.cells) if "lessonlib.exercises import" in c.source)
    keep = set(range(setup + 1))
    for i, c in enumerate(notebook.cells):
        meta = c.metadata.get("nbgrader", {})
        if meta.get("solution") and meta.get("grade_id") in TRIMMED:
            keep |= {i - 1, i, i + 1}
    notebook.cells = [c for i, c in enumerate(notebook.cells) if i in keep]
    return notebook


def write(folder: Path, notebook, name=PAGED) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, folder / name)
    return folder / name


def grades(csv_path: Path) -> list[list[str]]:
    with csv_path.open() as f:
        return list(csv.reader(f))


def test_every_exercise_has_nbgrader_metadata():
    """Every solution cell and every checker cell ``check_x(my_x)`` carries nbgrader's metadata (valid by
    nbgrader's own schema when it is installed), and exercise names are unique across the course. A new exercise
    without it fails here: `python tools/make_student_notebooks.py --mark-exercises` adds it."""
    found = grading.course_exercises(NOTEBOOKS)
    names = [e.name for listed in found.values() for e in listed]
    assert {"swiglu", "physical_slot", "free_sequence", "refresh_static_inputs", "blocks_needed"} <= set(names)
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        notebook = read(path.name)
        for c in notebook.cells:
            meta = c.metadata.get("nbgrader", {})
            if grading.BEGIN in c.source:
                assert meta.get("solution") and meta["grade_id"] in c.source, f"{path.name}: {c.source[:200]}"
            call = re.fullmatch(r"(check_\w+)\((my_\w+)\)", c.source.strip())
            if call:
                assert meta.get("grade") and meta["grade_id"] == call.group(1), f"{path.name}: {c.source}"
                assert meta["locked"] and meta["points"] > 0
        for exercise in found.get(path.name, []):
            assert f"def {exercise.solution_id}(" in cell(notebook, exercise.solution_id).source
    validator = pytest.importorskip("nbgrader.nbgraderformat").MetadataValidator()
    for name in found:
        validator.validate_nb(read(name))


def test_every_name_resolves_and_the_grading_processes_import_no_notebook_library():
    """lessonlib.grading's names are imported on first use: each one resolves, and the judge and the runners (plain
    pythons importing lessonlib.grading's modules) load neither nbformat nor nbclient (nbformat's import costs
    seconds of CPU in every process of every graded notebook)."""
    assert all(getattr(grading, name) is not None for name in grading.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        grading.nothing  # noqa: B018
    probe = ("import sys, lessonlib.grading.judge, lessonlib.grading.validated, lessonlib.grading.torch_source, "
             "lessonlib.grading.kernel_source; "
             "print(sorted(m for m in ('nbformat', 'nbclient', 'jsonschema') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]


def _system_errors_on_two_threads(parse, source: str) -> int:
    """How many of 16 calls of ``parse(source)``, 8 on each of two threads, raise SystemError while the garbage
    collector runs every 20 allocations and a gc callback hands the GIL to the other thread (``time.sleep(0)``): a
    switch in the middle of building an AST, where CPython 3.11's per-interpreter counter breaks."""
    import gc
    import threading
    import time

    def hand_over(phase, info):
        time.sleep(0)

    errors = []

    def work():
        for _ in range(8):
            try:
                parse(source)
            except SystemError as error:
                errors.append(error)

    threshold = gc.get_threshold()
    gc.callbacks.append(hand_over)
    gc.set_threshold(20)
    try:
        threads = [threading.Thread(target=work) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        gc.callbacks.remove(hand_over)
        gc.set_threshold(*threshold)
    return len(errors)


def test_a_cells_definitions_are_read_safely_on_two_threads():
    """The grader grades submissions on threads and reads each cell's definitions with ``ast.parse``: on CPython
    3.11 two parses at once could raise "AST constructor recursion depth mismatch" (CI failed so on 2026-12-03).
    The same two threads with a bare ``ast.parse`` first show that this Python races."""
    import ast

    from lessonlib.grading import scoring

    cell = "\n".join(f"def f{i}(a):\n    return [a[j] + ({i} * (a + (j - 1))) for j in range({i})]"
                     for i in range(40))
    if _system_errors_on_two_threads(ast.parse, cell) == 0:
        pytest.skip(f"ast.parse does not race on two threads in Python {sys.version.split()[0]}")
    assert _system_errors_on_two_threads(scoring._definitions, cell) == 0


def test_readme_lists_every_exercise():
    section = (ROOT / "README.md").read_text().split("## For instructors", 1)[1].split("\n## ", 1)[0]
    missing = [e.name for listed in grading.course_exercises(NOTEBOOKS).values() for e in listed
               if f"`{e.name}`" not in section]
    assert not missing, f"README.md's For instructors table lacks {missing}"


@pytest.mark.parametrize("name", sorted(grading.course_exercises(NOTEBOOKS)))
def test_plan_runs_each_pristine_checker_right_after_its_solution(name):
    """In the instructor notebook, its student copy, and a copy whose checker cells lost their metadata, each
    exercise is checked once, by the pristine checker, right after the cell defining the student's function; lesson
    cells that run a checker on lessonlib's own kernel (``check_swiglu(ops.swiglu)``) stay lesson cells."""
    listed = grading.course_exercises(NOTEBOOKS)[name]
    stripped = grading.student_copy(read(name))
    for c in stripped.cells:
        if c.metadata.get("nbgrader", {}).get("grade"):
            del c.metadata["nbgrader"]
    for notebook in (read(name), grading.student_copy(read(name)), stripped):
        sources, checks, notes = grading.plan(notebook, listed)
        assert sorted(e.name for e in checks.values()) == sorted(e.name for e in listed) and not notes
        for index, exercise in checks.items():
            assert sources[index] == grading.checker_cell(exercise)
            assert f"def {exercise.solution_id}(" in sources[index - 1]
        assert len(sources) == max(checks) + 1  # nothing after the last check runs


@pytest.fixture(scope="module")
def trimmed_run(tmp_path_factory):
    """One grading run of trimmed notebook 03 over every kind of submission the issue lists."""
    sandbox_or_skip()
    base = tmp_path_factory.mktemp("trimmed")
    instructor = trimmed(PAGED)
    course = write(base / "course", instructor).parent
    stub = grading.student_copy(instructor)
    right = {i: cell(instructor, i).source for i in ("my_physical_slot", "my_free_sequence")}
    subs = base / "submissions"
    cases = {
        "instructor": instructor,
        "untouched": stub,
        "wrong_physical_slot": edited(instructor, my_physical_slot=WRONG["my_physical_slot"]),
        "wrong_free_sequence": edited(instructor, my_free_sequence=WRONG["my_free_sequence"]),
        # Tampering, each in the second exercise's cells, with the first exercise solved.
        "edited_checker": edited(stub, my_physical_slot=right["my_physical_slot"],
                                 check_free_sequence='print("free_sequence: correct")'),
        "redefined_check": edited(stub, my_physical_slot=right["my_physical_slot"], my_free_sequence=(
            cell(stub, "my_free_sequence").source + "\n\ndef check_free_sequence(fn):\n    print('correct')\n")),
        "patched_lessonlib": edited(stub, my_physical_slot=right["my_physical_slot"], my_free_sequence=(
            "import lessonlib.exercises, lessonlib.testing\n"
            "lessonlib.exercises.check_free_sequence = lambda fn: print('correct')\n"
            "lessonlib.testing.check_close = lambda *args, **kwargs: None\n" + cell(stub, "my_free_sequence").source)),
        "patched_torch": edited(instructor, my_free_sequence=(  # a right answer, but torch.allclose replaced
            right["my_free_sequence"] + "\n\ntorch.allclose = lambda *args, **kwargs: True\n")),
        "fake_module": edited(stub, my_physical_slot=right["my_physical_slot"], my_free_sequence=(
            "import sys, types\nsys.modules['lessonlib.exercises'] = types.SimpleNamespace(\n"
            "    check_free_sequence=lambda fn: print('correct'))\n" + cell(stub, "my_free_sequence").source)),
        # A notebook that misbehaves: graded for what ran.
        # Interrupted at the cell limit; the notebook goes on. The loop sleeps: an interrupt stops it as it stops a
        # busy one, without burning a core for the limit's 40 s twice (the notebook's run and the runner's).
        "hangs": edited(instructor, my_free_sequence=(
            "import time\n\ndef my_free_sequence(table, ref_counts, free_blocks):\n    while True:\n"
            "        time.sleep(0.05)\n")),
        "hangs_hard": edited(instructor, my_free_sequence=(  # ignores the interrupt: the kernel is killed
            "import time\nwhile True:\n    try:\n        time.sleep(0.1)\n    except KeyboardInterrupt:\n"
            "        pass\n")),
        "exits": edited(instructor, my_free_sequence="import os\nos._exit(1)\n"),
        "floods": edited(instructor, my_physical_slot=right["my_physical_slot"] + (
            "\n\nfor _ in range(5_000):\n    print('x' * 1000)\n")),  # 5 MB: 50x the output cap, 5x the log's
        "raises_and_writes": edited(instructor, my_physical_slot=right["my_physical_slot"] + (
            "\n\nimport tempfile\nfrom pathlib import Path\n"
            "paths = [Path('written.txt'), Path.home() / 'home.txt', Path(tempfile.mkstemp()[1])]\n"
            "for path in paths:\n    path.write_text('x')\n    print('WROTE', path.resolve())\n"
            "raise RuntimeError('a cell that raises')\n")),
        "missing_cells": edited(instructor, my_physical_slot=None, check_free_sequence=None),
    }
    for student, notebook in cases.items():
        write(subs / student, notebook)
    truncated = subs / "truncated" / PAGED
    truncated.parent.mkdir()
    text = nbformat.writes(instructor)
    truncated.write_text(text[: len(text) // 2])
    out = base / "graded"
    limits = grading.Limits(cell_timeout=40, notebook_timeout=240, output_cap=100_000, busy_grace=5)
    lines = []
    csv_path = grading.grade(subs, out, course, limits, keep_scratch=True, jobs=2, log=lines.append)
    return out, csv_path, lines, subs


def feedback(out: Path, student: str) -> str:
    return (out / "feedback" / f"{student}.txt").read_text()


def test_grades_csv_says_exactly_what_was_expected(trimmed_run):
    out, csv_path, lines, _ = trimmed_run
    assert grades(csv_path) == [
        ["student", "physical_slot", "free_sequence", "total"],
        ["edited_checker", "1", "0", "1"],
        ["exits", "1", "0", "1"],
        ["fake_module", "1", "0", "1"],
        ["floods", "1", "2", "3"],
        ["hangs", "1", "0", "1"],
        ["hangs_hard", "1", "0", "1"],
        ["instructor", "1", "2", "3"],
        ["missing_cells", "0", "2", "2"],
        ["patched_lessonlib", "1", "0", "1"],
        ["patched_torch", "1", "2", "3"],
        ["raises_and_writes", "1", "2", "3"],
        ["redefined_check", "1", "0", "1"],
        ["truncated", "0", "0", "0"],
        ["untouched", "0", "0", "0"],
        ["wrong_free_sequence", "1", "0", "1"],
        ["wrong_physical_slot", "0", "2", "2"],
    ]
    assert any(line.startswith("[16/16]") for line in lines), lines  # progress, one line per notebook


def test_feedback_quotes_each_checker(trimmed_run):
    out = trimmed_run[0]
    assert "3 of 3 points" in feedback(out, "instructor")
    assert "physical_slot: 1/1  physical_slot: correct on" in feedback(out, "instructor")
    assert "free_sequence: 2/2  free_sequence: correct on 20 pools" in feedback(out, "instructor")
    assert "not implemented yet" in feedback(out, "untouched")
    assert "expected" in feedback(out, "wrong_physical_slot")
    assert "did not raise ValueError" in feedback(out, "wrong_free_sequence")


def test_tampering_reaches_only_the_submissions_own_runner(trimmed_run):
    """The checks run in the judge, apart from the student's code: an edited or redefined checker, a patched
    lessonlib, a fake module change nothing there (the stub is graded as a stub), and a right answer stays right
    however the runner's torch was patched."""
    out = trimmed_run[0]
    for student in ("edited_checker", "redefined_check", "patched_lessonlib", "fake_module"):
        assert "free_sequence: 0/2  free_sequence: not implemented yet" in feedback(out, student), student
    assert "free_sequence: 2/2  free_sequence: correct on 20 pools" in feedback(out, "patched_torch")


def test_misbehaving_notebooks_are_graded_for_what_ran(trimmed_run):
    out, _, _, subs = trimmed_run
    assert "free_sequence: 0/2  the check did not finish within the grader's limit of 40 s" in feedback(out, "hangs")
    hard = feedback(out, "hangs_hard")
    assert "ran past 40 s and was interrupted" in hard and "stayed busy after the interrupt and was killed" in hard
    assert "free_sequence: 0/2  not graded: the notebook stopped before this check" in hard
    assert "the kernel died" in feedback(out, "exits")
    assert "not a valid notebook" in feedback(out, "truncated")
    graded = out / "graded" / "floods" / PAGED
    assert graded.stat().st_size < 1_000_000 and "output past 100,000 characters dropped" in graded.read_text()
    missing = feedback(out, "missing_cells")
    assert "name 'my_physical_slot' is not defined" in missing
    assert "free_sequence: the checker cell was missing; the instructor's ran after your solution cell" in missing


def test_a_submission_writes_only_inside_its_scratch_folder(trimmed_run):
    """Its working folder, HOME and TMPDIR are its own scratch folder (outside --out; in a sandbox, a tmpfs that
    goes with it): nothing lands in the submissions or in --out."""
    out, _, lines, subs = trimmed_run
    text = (out / "graded" / "raises_and_writes" / PAGED).read_text()
    written = [Path(line.split("WROTE ", 1)[1].split("\\n")[0]) for line in text.split('"') if "WROTE " in line]
    assert len(written) == 3
    scratch = Path(next(line for line in lines if line.startswith("kept the scratch folders in ")).split(" in ", 1)[1])
    assert not scratch.is_relative_to(out)
    assert all(path.is_relative_to(scratch) for path in written), written
    assert sorted(p.name for p in (subs / "raises_and_writes").iterdir()) == [PAGED]
    assert not list(out.rglob("written.txt")) and not list(out.rglob("home.txt"))


@pytest.fixture(scope="module")
def real_submissions(tmp_path_factory):
    """The full notebooks 03 and 05: the instructor's (full points), the committed student copy (zero), and one
    wrong answer per exercise."""
    sandbox_or_skip()
    base = tmp_path_factory.mktemp("real")
    subs = base / "submissions"
    for name in (PAGED, GRAPHS):
        instructor = read(name)
        write(subs / "instructor", instructor, name)
        (subs / "student_copy").mkdir(parents=True, exist_ok=True)
        shutil.copy(NOTEBOOKS / "student" / name, subs / "student_copy" / name)  # as committed
    write(subs / "wrong_answers", edited(read(GRAPHS), my_refresh_static_inputs=WRONG["my_refresh_static_inputs"]),
          GRAPHS)
    return base, subs


def test_real_notebooks_full_points_and_zero(real_submissions):
    base, subs = real_submissions
    limits = grading.Limits(cell_timeout=300, notebook_timeout=600)
    csv_path = grading.grade(subs, base / "graded", NOTEBOOKS, limits, jobs=2, log=lambda line: None)
    assert grades(csv_path) == [
        ["student", "physical_slot", "free_sequence", "paged_decode_kernel", "rope_kernel", "rope_store_kv_kernel",
         "gather_ratio", "refresh_static_inputs", "graph_safe_decode_step", "graph_saving", "total"],
        ["instructor", "1", "2", "2", "1", "2", "1", "1", "2", "1", "13"],
        ["student_copy", "0", "0", "0", "0", "0", "0", "0", "0", "0", "0"],
        ["wrong_answers", "0", "0", "0", "0", "0", "0", "0", "2", "1", "3"],
    ]
    text = (base / "graded" / "feedback" / "wrong_answers.txt").read_text()
    assert "refresh_static_inputs: 0/1  refresh_static_inputs: static['hidden'] is a different tensor" in text
    assert "physical_slot: 0/1  not submitted" in text
    assert not (base / "graded" / "scratch").exists()


def test_command_line(tmp_path):
    """`python -m lessonlib.grading` on a folder: the CSV next to it; a bad folder is refused with a message."""
    sandbox_or_skip()
    write(tmp_path / "subs" / "ann", nbformat.v4.new_notebook(), PAGED)  # a notebook with no cells at all
    result = subprocess.run([sys.executable, "-m", "lessonlib.grading", str(tmp_path / "subs"), "--cell-timeout", "60"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    graded = [c.metadata["nbgrader"]["points"] for c in nbformat.read(ROOT / "notebooks" / PAGED, as_version=4).cells
              if c.metadata.get("nbgrader", {}).get("grade")]  # the lesson's exercises, as the instructor set them
    assert f"[1/1] ann: 03_paged_attention.ipynb: 0/{sum(graded)} points" in result.stdout
    assert grades(tmp_path / "subs-graded" / "grades.csv")[1] == ["ann"] + ["0"] * (len(graded) + 1)
    assert "NameError" in (tmp_path / "subs-graded" / "feedback" / "ann.txt").read_text()
    bad = subprocess.run([sys.executable, "-m", "lessonlib.grading", str(tmp_path / "nowhere")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "is not a folder" in bad.stderr


# ---------------------------------------------------------------------------------------------------------------
# nbgrader itself, on the course as it is.


def nbgrader(course: Path, *args: str) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "LESSONLIB_SCRATCH": str(course / "scratch"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def without_gradebook_fields(notebook: nbformat.NotebookNode) -> dict:
    """nbgrader's release less its gradebook fields (checksum, cell_type), as JSON."""
    for c in notebook.cells:
        for key in ("checksum", "cell_type"):
            c.metadata.get("nbgrader", {}).pop(key, None)
    return json.loads(nbformat.writes(notebook))


def test_nbgrader_generate_assignment_and_autograde(tmp_path):
    """nbgrader's own release and autograde, on three lessons (one of them a kernel lesson, 01): a course folder
    each, graded two at a time (CI has two cores; nbgrader grades one notebook at a time)."""
    pytest.importorskip("nbgrader")
    sys.path.insert(0, str(ROOT / "tools"))
    import course_links
    import make_student_notebooks

    def release_and_grade(lesson: str) -> Path:
        course = tmp_path / lesson
        assert make_student_notebooks.nbgrader_course(course, [NOTEBOOKS / lesson]) == [Path(lesson).stem]
        assignment = Path(lesson).stem
        nbgrader(course, "generate_assignment", assignment)
        released = nbformat.read(course / "release" / assignment / f"{assignment}.ipynb", as_version=4)
        committed = json.loads((NOTEBOOKS / "student" / f"{assignment}.ipynb").read_text())
        # The committed student copy is nbgrader's release with the student copy's own Colab/Binder badges and its
        # links as they resolve from notebooks/student/.
        for cell in released.cells:
            if cell.cell_type == "markdown":
                cell.source = make_student_notebooks.one_folder_down(cell.source)
        course_links.with_badges(released, course_links.course(), f"notebooks/student/{assignment}.ipynb")
        assert without_gradebook_fields(released) == committed
        for student, source in (("alice", NOTEBOOKS / f"{assignment}.ipynb"),
                                ("bob", course / "release" / assignment / f"{assignment}.ipynb")):
            target = course / "submitted" / student / assignment
            target.mkdir(parents=True)
            shutil.copy(source, target)
        nbgrader(course, "autograde", assignment, "--Execute.timeout=300")
        return course

    both = tmp_path / "both"  # one course folder for several lessons (what an instructor sets up)
    assert make_student_notebooks.nbgrader_course(both, [NOTEBOOKS / PAGED, NOTEBOOKS / GRAPHS]) == [
        "03_paged_attention", "05_cuda_graphs"]
    assert {p.name for p in (both / "source").iterdir()} == {"03_paged_attention", "05_cuda_graphs"}
    assert "'name': '03_paged_attention'}, {'name': '05_cuda_graphs'" in (both / "nbgrader_config.py").read_text()
    with ThreadPoolExecutor(max_workers=2) as pool:
        courses = dict(zip((PAGED, GRAPHS, FUSION), pool.map(release_and_grade, (PAGED, GRAPHS, FUSION))))
    from nbgrader.api import Gradebook

    found = grading.course_exercises(NOTEBOOKS)
    for lesson in (PAGED, GRAPHS, FUSION):
        most = sum(e.points for e in found[lesson])
        assignment = Path(lesson).stem
        with Gradebook(f"sqlite:///{courses[lesson] / 'gradebook.db'}") as gradebook:
            assert gradebook.find_submission(assignment, "alice").score == most
            assert gradebook.find_submission(assignment, "bob").score == 0


def test_a_notebook_past_its_time_limit_is_stopped(tmp_path):
    """The per-notebook limit holds even when no single cell reaches the per-cell one."""
    sandbox_or_skip()
    instructor = trimmed(PAGED)
    course = write(tmp_path / "course", instructor).parent
    slow = edited(instructor, my_physical_slot=cell(instructor, "my_physical_slot").source + (
        "\n\nimport time\ntime.sleep(3600)\n"))
    write(tmp_path / "subs" / "slow", slow)
    limits = grading.Limits(cell_timeout=3600, notebook_timeout=25)
    csv_path = grading.grade(tmp_path / "subs", tmp_path / "out", course, limits, log=lambda line: None)
    assert grades(csv_path)[1] == ["slow", "0", "0", "0"]
    text = feedback(tmp_path / "out", "slow")
    assert "the check did not finish" in text or "not graded: the notebook stopped before this check" in text
    assert "ran past" in text
