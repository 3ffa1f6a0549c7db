"""Issue 23: the grader isolates each submission. Adversarial submissions of lesson 01 (the student copy, or the
instructor's, plus a malicious cell), graded through the real command line in one run: each gets nothing for what it
touched, the honest submissions graded in the same run keep their grades, the checkout and grades.csv are unchanged
and no process of theirs survives the grader.

Cost on 2 cores: one grading run of 14 trimmed lesson-01 notebooks (set-up and its exercises), two at a time, in the
bwrap sandbox; the whole file took 367 s here (2026-12-02, 2 cores shared, load average 40 to 70), the unshare
run (two trimmed lesson-03 notebooks) 59 s.
"""

import csv
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lessonlib import grading
from lessonlib.grading import sandbox

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
FUSION = "01_operator_fusion.ipynb"
PAGED = "03_paged_attention.ipynb"
BOMB = ("import os, time\n"  # at most 2**10 processes where no limit holds; the sandbox stops it at 512
        "for _ in range(10):\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        print('FORK FAILED', flush=True)\n"
        "        break\n"
        "time.sleep(30)\n")
SECRET = "grader-secret-" + os.urandom(8).hex()  # in the grader's environment only


def trimmed(notebook: nbformat.NotebookNode, solutions: set[str]) -> nbformat.NotebookNode:
    """The notebook's set-up (its cells up to the one that imports the checkers) and each exercise's markdown,
    solution and checker cells."""
    copy = nbformat.from_dict(notebook)
    setup = next(i for i, c in enumerate(copy.cells) if "lessonlib.exercises import" in c.source)
    keep = set(range(setup + 1))
    for i, c in enumerate(copy.cells):
        if c.metadata.get("nbgrader", {}).get("solution") and c.metadata["nbgrader"]["grade_id"] in solutions:
            keep |= {i - 1, i, i + 1}
    copy.cells = [c for i, c in enumerate(copy.cells) if i in keep]
    return copy


def with_cell(notebook, source: str, after_setup: bool = True) -> nbformat.NotebookNode:
    """A copy with one more code cell: right after the set-up, or at the end."""
    copy = nbformat.from_dict(notebook)
    setup = next(i for i, c in enumerate(copy.cells) if "lessonlib.exercises import" in c.source)
    copy.cells.insert(setup + 1 if after_setup else len(copy.cells), nbformat.v4.new_code_cell(source))
    return copy


def in_solution(notebook, solution_id: str, source: str) -> nbformat.NotebookNode:
    """A copy whose solution cell ``solution_id`` ends with ``source``: run in the kernel and in the runner."""
    copy = nbformat.from_dict(notebook)
    target = next(c for c in copy.cells if c.metadata.get("nbgrader", {}).get("grade_id") == solution_id)
    target.source += "\n\n" + source
    return copy


def checkout_hash() -> str:
    """Every file of lessonlib and the notebooks, as bytes: what no submission may change."""
    digest = hashlib.sha256()
    for folder in (ROOT / "lessonlib", NOTEBOOKS):
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path).encode() + path.read_bytes())
    return digest.hexdigest()


def survivors(*markers: str) -> list[str]:
    """Processes whose command line mentions any of ``markers``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(m in text for m in markers) and "pytest" not in text:
            found.append(text[:200])
    return found


def grade_cli(subs: Path, out: Path, tmp: Path, *args: str, sandbox_mode: str = "bwrap",
              timeout: float = 1500) -> subprocess.CompletedProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LESSONLIB_TEST_SECRET": SECRET, "TMPDIR": str(tmp), "LESSONLIB_GRADING_SANDBOX": sandbox_mode,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "lessonlib.grading", str(subs), "--out", str(out), *args],
                          capture_output=True, env=env, timeout=timeout)


def rows(csv_path: Path) -> dict[str, list[str]]:
    with csv_path.open() as f:
        return {row[0]: row[1:] for row in csv.reader(f)}


needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make setup)")


def test_where_bubblewrap_is_installed_the_sandbox_starts():
    """CI fails, not skips, when the machine has bubblewrap and the grader's sandbox cannot start there."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (make setup)")
    mode, why = sandbox.choose("auto")
    assert mode == "bwrap", why


@pytest.fixture(scope="module")
def adversarial(tmp_path_factory):
    base = tmp_path_factory.mktemp("adversarial")
    found = grading.course_exercises(NOTEBOOKS)[FUSION]
    solutions = {e.solution_id for e in found}
    instructor = trimmed(nbformat.read(NOTEBOOKS / FUSION, as_version=4), solutions)
    stub = trimmed(nbformat.read(NOTEBOOKS / "student" / FUSION, as_version=4), solutions)
    (base / "course").mkdir()
    nbformat.write(instructor, base / "course" / FUSION)
    first = min(solutions, key=lambda i: [c.metadata.get("nbgrader", {}).get("grade_id") for c in stub.cells].index(i))
    out, subs, target = base / "graded", base / "submissions", base / "outside.txt"
    detached = (f"import time; time.sleep(4); open({str(out / 'grades.csv')!r}, 'w').write('student,total\\n'); "
                "time.sleep(600)  # detached-survivor-marker")
    cases = {
        "honest": instructor,
        "untouched": stub,
        "appends_checkers": in_solution(stub, first, (
            "import lessonlib.exercises.operator_fusion as f\n"
            "try:\n"
            "    with open(f.__file__, 'a') as file:\n"
            "        file.write('\\ndef check_swiglu(fn):\\n    print(\"correct\")\\n')\n"
            "    print('APPENDED')\n"
            "except OSError as e:\n"
            "    print('REFUSED', e)\n")),
        "detached": in_solution(stub, first, (
            "import subprocess, sys\n"
            f"code = {detached!r}\n"
            "subprocess.Popen([sys.executable, '-c', code], start_new_session=True)\n")),
        "transformer": with_cell(stub, (
            "def rewrite(lines):\n"
            "    text = ''.join(lines)\n"
            "    return [\"print('swiglu: correct')\\n\"] if 'lessonlib.grading' in text or 'check_' in text else lines\n"
            "get_ipython().input_transformers_post.append(rewrite)\n")),
        "writes": with_cell(stub, (
            "import lessonlib, os\n"
            f"for path in ({str(target)!r}, '../../../escaped.txt', os.path.join(os.path.dirname(lessonlib.__file__),"
            " 'pwned.py'), 'inside.txt'):\n"
            "    try:\n"
            "        open(path, 'w').write('x')\n"
            "        print('WROTE', os.path.abspath(path))\n"
            "    except OSError as e:\n"
            "        print('REFUSED', path, type(e).__name__)\n")),
        "reads_env": with_cell(stub, "import os\nprint('SECRET', os.environ.get('LESSONLIB_TEST_SECRET'))\n"
                                     "print('ENV', sorted(os.environ))\n"),
        "floods_fd": with_cell(stub, "import os\nfor _ in range(20):\n    os.write(1, b'y' * 1_000_000)\n"),
        "fork_bomb": with_cell(stub, (  # in a fresh Python: a forked kernel deadlocks before it multiplies
            "import subprocess, sys\n"
            f"subprocess.run([sys.executable, '-c', {BOMB!r}])\n")),
        "fills_disk": with_cell(instructor, (  # the working folder is a tmpfs of --scratch-mb: a full one, not a full disk
            "written = 0\n"
            "try:\n"
            "    with open('fill.bin', 'wb') as f:\n"
            "        while written < 2**31:\n"
            "            f.write(b'z' * 2**20)\n"
            "            written += 2**20\n"
            "except OSError as e:\n"
            "    print('FULL', type(e).__name__)\n"
            "print('FILLED', written)\n")),
        "replaces_helper": in_solution(instructor, first, (  # solved; the helper it replaces is not in its process
            "import sys\n"
            "grader = sys.modules.get('_lessonlib_grading')\n"
            "if grader is not None:\n"
            "    grader.changes = lambda: []\n")),
        "network": with_cell(stub, (
            "import socket\n"
            "try:\n"
            "    socket.create_connection(('1.1.1.1', 80), timeout=3)\n"
            "    print('CONNECTED')\n"
            "except OSError as e:\n"
            "    print('OFFLINE', type(e).__name__)\n")),
    }
    for student, notebook in cases.items():
        (subs / student).mkdir(parents=True)
        nbformat.write(notebook, subs / student / FUSION)
    (subs / "duplicate").mkdir()
    nbformat.write(instructor, subs / "duplicate" / FUSION)  # the exact name: graded
    nbformat.write(stub, subs / "duplicate" / FUSION.replace(".ipynb", " (1).ipynb"))  # a download copy: not graded
    before = checkout_hash()
    result = grade_cli(subs, out, base / "tmp", "--course", str(base / "course"), "--jobs", "2",
                       "--cell-timeout", "120", "--output-cap", "100000", "--scratch-mb", "64")
    return {"base": base, "out": out, "result": result, "before": before, "after": checkout_hash(),
            "target": target, "subs": subs}


def feedback(run, student: str) -> str:
    return (run["out"] / "feedback" / f"{student}.txt").read_text()


def kernel_output(run, student: str) -> str:
    return (run["out"] / "graded" / student / FUSION.replace(".ipynb", ".kernel.txt")).read_text(errors="replace")


def graded(run, student: str) -> str:
    """What the graded copy's cells printed (not their sources)."""
    notebook = nbformat.read(run["out"] / "graded" / student / FUSION, as_version=4)
    return "".join(o.get("text", "") + o.get("evalue", "") for c in notebook.cells for o in c.get("outputs", []))


@needs_bwrap
def test_each_misbehaving_submission_gets_nothing_and_the_honest_ones_keep_their_grades(adversarial):
    result = adversarial["result"]
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert b"in sandbox bwrap" in result.stdout
    got = rows(adversarial["out"] / "grades.csv")
    most = got.pop("student")
    full = [str(e.points).removesuffix(".0") for e in grading.course_exercises(NOTEBOOKS)[FUSION]]
    assert len(most) == len(full) + 1
    for student in ("honest", "fills_disk", "duplicate", "replaces_helper"):
        assert got.pop(student)[:-1] == full, student
    for student, grades in got.items():  # every other submission is the untouched stubs plus its trick
        assert set(grades) == {"0"}, (student, grades)


@needs_bwrap
def test_the_checkout_and_grades_csv_are_unchanged_and_nothing_survives(adversarial):
    assert adversarial["before"] == adversarial["after"], "a submission changed lessonlib/ or notebooks/"
    assert not (ROOT / "lessonlib" / "pwned.py").exists()
    assert "REFUSED" in graded(adversarial, "appends_checkers") and "APPENDED" not in graded(
        adversarial, "appends_checkers")
    assert not survivors("detached-survivor-marker") and not survivors(str(adversarial["base"] / "tmp"))
    assert set(rows(adversarial["out"] / "grades.csv")) == {"student"} | {p.name for p in adversarial["subs"].iterdir()}
    assert not list((adversarial["base"] / "tmp").iterdir()), "the grader left its scratch folders"


@needs_bwrap
def test_writes_land_only_in_the_sandbox(adversarial):
    """Writes by absolute path and by ../ go to the sandbox's own tmpfs (or fail); into lessonlib/ they fail."""
    text = graded(adversarial, "writes")
    assert not adversarial["target"].exists() and not list(adversarial["base"].rglob("escaped.txt"))
    assert "pwned.py OSError" in text
    assert sorted(p.name for p in (adversarial["subs"] / "writes").iterdir()) == [FUSION]
    assert not list(adversarial["out"].rglob("inside.txt")) and not list(adversarial["out"].rglob("escaped.txt"))


@needs_bwrap
def test_the_environment_network_and_raw_output_are_contained(adversarial):
    text = graded(adversarial, "reads_env")
    assert "SECRET None" in text and SECRET not in text and "LESSONLIB_TEST_SECRET" not in text
    assert "OFFLINE" in graded(adversarial, "network") and "CONNECTED" not in graded(adversarial, "network")
    assert len(adversarial["result"].stdout) < 50_000  # 20 MB written to fd 1 never reach the grader's stdout
    raw = kernel_output(adversarial, "floods_fd")
    assert raw.count("y") <= 100_000 and "bytes past 100,000 dropped" in raw


@needs_bwrap
def test_a_fork_bomb_and_a_full_scratch_folder_are_contained(adversarial):
    """As root the sandbox's init stops it past 512 processes (the kernel dies); as a user RLIMIT_NPROC fails
    the forks first."""
    if "more than 512 processes" in kernel_output(adversarial, "fork_bomb"):
        assert "the kernel died" in feedback(adversarial, "fork_bomb")
    else:
        assert os.geteuid() != 0 and "FORK FAILED" in graded(adversarial, "fork_bomb")
    text = graded(adversarial, "fills_disk")
    filled = int(text.split("FILLED ", 1)[1].split()[0])
    assert "FULL" in text and filled <= 64 * 2**20


@needs_bwrap
def test_tampering_with_ipython_or_the_grader_is_named(adversarial):
    transformer = feedback(adversarial, "transformer")
    assert "did not run as written in the kernel (an IPython input transformer" in transformer
    assert "not implemented yet" in transformer
    duplicate = feedback(adversarial, "duplicate")
    assert f"graded '{FUSION}'; not graded: '{FUSION.replace('.ipynb', ' (1).ipynb')}'" in duplicate


# ---------------------------------------------------------------------------------------------------------------
# The other ways to run: unshare, and none (with its warning, and --require-sandbox).


def paged_pair(base: Path, trick: str) -> tuple[Path, Path]:
    """Trimmed notebook 03 as a course, and submissions: its instructor copy and a student copy plus ``trick``."""
    instructor = trimmed(nbformat.read(NOTEBOOKS / PAGED, as_version=4), {"my_physical_slot", "my_free_sequence"})
    (base / "course").mkdir(parents=True)
    nbformat.write(instructor, base / "course" / PAGED)
    for student, notebook in (("honest", instructor), ("writer", with_cell(grading.student_copy(instructor), trick))):
        (base / "subs" / student).mkdir(parents=True)
        nbformat.write(notebook, base / "subs" / student / PAGED)
    return base / "course", base / "subs"


def write_to(path: str) -> str:
    return (f"try:\n    open({path}, 'w').write('x')\n    print('WROTE')\n"
            "except OSError as e:\n    print('REFUSED', type(e).__name__)\n")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux's unshare is not installed")
def test_the_unshare_sandbox(tmp_path):
    try:
        sandbox.choose("unshare")
    except sandbox.SandboxUnavailable as e:
        pytest.skip(str(e))
    trick = "import lessonlib, os\n" + write_to("os.path.join(os.path.dirname(lessonlib.__file__), 'pwned.py')")
    course, subs = paged_pair(tmp_path, trick + write_to(repr(str(tmp_path / "outside.txt"))))
    result = grade_cli(subs, tmp_path / "out", tmp_path / "tmp", "--course", str(course), "--jobs", "2",
                       sandbox_mode="unshare")
    assert result.returncode == 0 and b"in sandbox unshare" in result.stdout, result.stderr.decode()[-3000:]
    assert rows(tmp_path / "out" / "grades.csv") == {"student": ["physical_slot", "free_sequence", "total"],
                                                      "honest": ["1", "2", "3"], "writer": ["0", "0", "0"]}
    text = (tmp_path / "out" / "graded" / "writer" / PAGED).read_text()
    assert "REFUSED OSError" in text and not (ROOT / "lessonlib" / "pwned.py").exists()
    assert not (tmp_path / "outside.txt").exists()  # it went to the sandbox's own /tmp


def test_without_a_sandbox_the_grader_refuses_unless_told_and_then_warns(tmp_path):
    """No sandbox, no grades, unless the instructor says --unsafe-no-sandbox: then a warning, the grades as
    sandboxed, the environment still allowlisted; and the hole it warns of (a write outside goes through)."""
    course, subs = paged_pair(tmp_path, "import os\nprint('SECRET', os.environ.get('LESSONLIB_TEST_SECRET'))\n"
                              + write_to(repr(str(tmp_path / "outside.txt"))))
    refused = grade_cli(subs, tmp_path / "refused", tmp_path / "tmp", "--course", str(course), sandbox_mode="none")
    assert refused.returncode == 3 and b"--unsafe-no-sandbox" in refused.stderr
    assert not (tmp_path / "refused" / "grades.csv").exists()
    result = grade_cli(subs, tmp_path / "out", tmp_path / "tmp", "--course", str(course), "--jobs", "2",
                       "--unsafe-no-sandbox", sandbox_mode="none")
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert b"UNSANDBOXED" in result.stdout and b"in sandbox none" in result.stdout
    assert rows(tmp_path / "out" / "grades.csv")["honest"] == ["1", "2", "3"]
    assert rows(tmp_path / "out" / "grades.csv")["writer"] == ["0", "0", "0"]
    text = (tmp_path / "out" / "graded" / "writer" / PAGED).read_text()
    assert "SECRET None" in text and SECRET not in text
    assert (tmp_path / "outside.txt").exists()


def test_a_changed_course_file_is_put_back_and_its_notebook_flagged(tmp_path):
    """Unsandboxed, a notebook can write the instructor notebooks: the grader sees it after that notebook, puts the
    file back, gives that notebook 0 with a flag, and grades the rest of the class (one notebook at a time)."""
    course, subs = paged_pair(tmp_path, "pass\n")
    shutil.rmtree(subs / "writer")
    (subs / "vandal").mkdir()
    original = (course / PAGED).read_bytes()
    nbformat.write(with_cell(nbformat.read(course / PAGED, as_version=4),
                             f"open({str(course / PAGED)!r}, 'a').write(' ')\n"), subs / "vandal" / PAGED)
    result = grade_cli(subs, tmp_path / "out", tmp_path / "tmp", "--course", str(course), "--unsafe-no-sandbox",
                       sandbox_mode="none")
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert b"the course changed while grading vandal/" in result.stdout
    assert rows(tmp_path / "out" / "grades.csv") == {"student": ["physical_slot", "free_sequence", "total"],
                                                      "honest": ["1", "2", "3"], "vandal": ["0", "0", "0"]}
    assert "FLAGGED" in (tmp_path / "out" / "feedback" / "vandal.txt").read_text()
    assert (course / PAGED).read_bytes() == original


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox runs as a uid of its own only when the grader is root")
def test_the_kernels_connection_file_is_handed_to_the_sandboxs_uid(tmp_path, monkeypatch):
    # Seen on the lent GPU machine (root, a Python every user can run): the kernel ran as SANDBOX_UID + slot and
    # could not read the connection file jupyter_client writes with mode 0600, so it died before it started.
    from lessonlib.grading import notebook_run

    monkeypatch.setattr(sandbox, "_open_to_others", lambda: True)
    box = sandbox.Box("bwrap", tmp_path / "s", tmp_path / "w", (), 1 << 20, 64, 1 << 20, slot=3)
    sandbox.prepare(box)
    km = notebook_run._kernel_manager(box, transport="ipc", ip=str(box.writable / "k"),
                                      connection_file=str(box.writable / "kernel.json"))
    km.write_connection_file()
    info = (box.writable / "kernel.json").stat()
    assert (info.st_uid, info.st_gid) == (sandbox.SANDBOX_UID + 3,) * 2
    assert (box.writable.stat().st_uid, box.work.stat().st_uid) == (sandbox.SANDBOX_UID + 3,) * 2


def test_a_private_temporary_folder_keeps_the_sandbox_as_the_graders_uid(tmp_path, monkeypatch):
    # Seen on the lent GPU machine: with TMPDIR in pytest's private folder (mode 0700) the sandbox's uid could not
    # enter the probe's folders, so unshare was judged unable to make its namespaces. The uid switch needs the
    # temporary folder reachable by any uid; where it is not, the sandbox runs as the grader's uid, as without it.
    import tempfile

    private = tmp_path / "private"
    private.mkdir()
    os.chmod(private, 0o700)
    assert not sandbox._reachable(private) and sandbox._reachable(Path("/"))
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    sandbox._open_to_others.cache_clear()
    try:
        assert sandbox._open_to_others() is False
    finally:
        sandbox._open_to_others.cache_clear()
