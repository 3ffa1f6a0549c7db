"""Grading a folder of submissions (one folder per student): ``grades.csv``, ``feedback/`` and ``graded/``; the
command line ``python -m lessonlib.grading``."""

from __future__ import annotations

import argparse
import csv
import os
import queue
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import nbformat

from lessonlib.grading import release, sandbox
from lessonlib.grading.exercise_format import Exercise, exercises
from lessonlib.grading.notebook_run import ROOT, Limits, NotebookReport, Outcome, grade_notebook

COURSE_NOTEBOOKS = ROOT / "notebooks"  # the instructor notebooks in a checkout of the course


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


CourseChanged = release.CourseChanged


def _match(path: Path, course: dict[str, list[Exercise]]) -> str | None:
    if path.name in course:
        return path.name
    prefix = re.match(r"(\d\d)_", path.name)
    return next((name for name in course if prefix and name.startswith(prefix.group(0))), None)


def _pick(student: str, paths: list[Path], course: dict[str, list[Exercise]]) -> tuple[dict[str, Path], list[str]]:
    """{course notebook: the file graded} for one student, and a note for each lesson with several files: the file
    named exactly as the course names it wins, else the first by name."""
    by_name: dict[str, list[Path]] = {}
    for path in paths:
        name = _match(path, course)
        if name and ".ipynb_checkpoints" not in path.parts:
            by_name.setdefault(name, []).append(path)
    chosen, notes = {}, []
    for name, candidates in by_name.items():
        candidates.sort(key=lambda p: (p.name != name, str(p)))
        chosen[name] = candidates[0]
        if len(candidates) > 1:
            others = ", ".join(repr(p.name) for p in candidates[1:])
            notes.append(f"{name}: graded {candidates[0].name!r}; not graded: {others}")
    return chosen, notes


def course_hash(course: Path) -> dict[str, str]:
    """{file: its bytes' sha256, or what it is} of lessonlib, the instructor notebooks and the files Python runs
    before any import (:class:`~lessonlib.grading.release.Course`, as it is now)."""
    import hashlib

    state = release.Course(ROOT, Path(course), allow_modified=True).state
    return {k: hashlib.sha256(v).hexdigest() if isinstance(v, bytes) else v for k, v in state.items()}


def _points(value: float) -> str:
    return f"{value:g}"


def _sandbox(mode: str, unsafe: bool, log) -> str:
    """The sandbox mode to use (``LESSONLIB_GRADING_SANDBOX`` overrides ``mode``). Without one the grader refuses,
    unless the instructor passed ``--unsafe-no-sandbox``: then a warning."""
    mode = os.environ.get("LESSONLIB_GRADING_SANDBOX", mode)
    if mode == "none" and not unsafe:
        raise sandbox.SandboxUnavailable("--sandbox none grades untrusted notebooks unsandboxed: add "
                                         "--unsafe-no-sandbox to do so")
    mode, why = sandbox.choose(mode)
    if mode == "none":
        if not unsafe:
            raise sandbox.SandboxUnavailable(f"no sandbox can start here ({why}); the grader refuses to run "
                                             "untrusted notebooks without one (--unsafe-no-sandbox grades anyway)")
        log("WARNING: " + sandbox.RISK.format(why=why))
    return mode


def _regular_notebooks(folder: Path, log) -> tuple[list[Path], list[str]]:
    """The ``.ipynb`` files under ``folder`` that are regular files (symbolic links, FIFOs and devices are refused
    with a note; folders behind symbolic links are not entered)."""
    found, refused = [], []
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            path = Path(dirpath) / name
            if not name.endswith(".ipynb"):
                continue
            kind = stat.S_IFMT(os.lstat(path).st_mode)
            if kind == stat.S_IFREG:
                found.append(path)
            else:
                what = {stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device",
                        stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket"}.get(kind, "not a regular file")
                refused.append(f"{path.relative_to(folder)}: not read, it is {what} (only regular files are graded)")
    return sorted(found), refused


def _collect(submissions: Path, course_ex: dict[str, list[Exercise]], log):
    """(students, {(student, course notebook): the file graded}, {student: notes on files not graded},
    {student: notes on files refused})."""
    students = sorted(p.name for p in submissions.iterdir()
                      if stat.S_ISDIR(os.lstat(p).st_mode) and not p.name.startswith("."))
    for stray in sorted(p for p in submissions.iterdir() if not stat.S_ISDIR(os.lstat(p).st_mode)):
        log(f"ignored {stray.name}: put each student's notebooks in a folder named after the student")
    found: dict[tuple[str, str], Path] = {}
    picked: dict[str, list[str]] = {}
    refused: dict[str, list[str]] = {}
    for student in students:
        paths, refused[student] = _regular_notebooks(submissions / student, log)
        chosen, picked[student] = _pick(student, paths, course_ex)
        found.update({(student, name): path for name, path in chosen.items()})
    return students, found, picked, refused


def grade(submissions: Path, out: Path, course: Path = COURSE_NOTEBOOKS, limits: Limits | None = None,
          keep_scratch: bool = False, jobs: int = 1, log=print, sandbox_mode: str = "auto",
          unsafe_no_sandbox: bool = False, allow_modified_course: bool = False) -> Path:
    """Grade every student folder in ``submissions``; write ``out/grades.csv``, ``out/feedback/`` and
    ``out/graded/``. ``jobs`` notebooks run at once (each in its own kernel and sandbox, :mod:`.sandbox`; one at a
    time without a sandbox). The course is checked against its release when the grader starts (a difference stops
    it: :class:`CourseChanged`) and after each notebook (a change is put back, and the notebooks graded meanwhile get
    0 and a note). Returns the CSV's path."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    limits = limits or Limits()
    submissions, out = Path(submissions).resolve(), Path(out).resolve()
    mode = _sandbox(sandbox_mode, unsafe_no_sandbox, log)
    jobs = 1 if mode == "none" else max(1, jobs)  # unsandboxed, a change to the course is one notebook's
    released = release.Course(ROOT, Path(course), allow_modified_course)
    course_ex = course_exercises(Path(course))
    students, found, picked, refused = _collect(submissions, course_ex, log)
    graded_names = [name for name in course_ex if any(n == name for _, n in found)]
    columns = [e for name in graded_names for e in course_ex[name]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "feedback").mkdir(exist_ok=True)
    log(f"grading {len(found)} notebook(s) of {len(students)} student(s) in sandbox {mode} against "
        f"{released.origin}: {', '.join(graded_names) or 'none'}")
    # Outside --out, with short paths (a Unix socket's is <108 bytes). The sandboxes see the pristine lessonlib.
    scratch_root = Path(tempfile.mkdtemp(prefix="lessonlib-grading-")).resolve()
    os.chmod(scratch_root, 0o755)
    pristine = released.pristine(scratch_root / "course")
    slots: queue.Queue[int] = queue.Queue()
    for slot in range(jobs):
        slots.put(slot)

    def run(number: int, student: str, name: str) -> NotebookReport:
        scratch, slot = scratch_root / str(number), slots.get()
        try:
            report = grade_notebook(found[student, name], name, course_ex[name], scratch, limits,
                                    out / "graded" / student / name, mode, slot, pristine=pristine)
        finally:
            slots.put(slot)
            if not keep_scratch:
                shutil.rmtree(scratch, ignore_errors=True)
        report.notes += [note for note in picked[student] if note.startswith(name)]
        return report

    reports: dict[tuple[str, str], NotebookReport] = {}
    suspects: dict[tuple[str, str], list[str]] = {}  # running while a change was found: graded 0 when they end
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(run, number, *key): key for number, key in enumerate(found)}
            for done, future in enumerate(as_completed(futures), 1):
                key = futures[future]
                report = reports[key] = _report_of(future, key, course_ex, log)
                changed = released.repair()
                if changed:
                    log(f"the course changed while grading {key[0]}/{key[1]}: {', '.join(changed[:5])}; put back")
                    for other, other_key in futures.items():
                        if other.running() or other is future:
                            suspects.setdefault(other_key, []).extend(changed)
                if key in suspects:
                    _flag(report, suspects[key])
                got, most = sum(o.points for o in report.outcomes), sum(e.points for e in course_ex[key[1]])
                log(f"[{done}/{len(found)}] {key[0]}: {key[1]}: {_points(got)}/{_points(most)} points in "
                    f"{report.seconds:.0f} s" + (f" ({report.notes[-1]})" if report.notes else ""))
    finally:
        if keep_scratch:
            log(f"kept the scratch folders in {scratch_root}")
        else:
            shutil.rmtree(scratch_root, ignore_errors=True)
    return _write_results(out, students, graded_names, columns, course_ex, reports, refused, log)


def _write_results(out: Path, students, graded_names, columns, course_ex, reports, refused, log) -> Path:
    """grades.csv (written whole, then renamed into place) and each student's feedback."""
    rows = []
    for student in students:
        listed = [reports.get((student, name)) or NotebookReport(name, [Outcome(e, 0.0, "not submitted")
                                                                        for e in course_ex[name]])
                  for name in graded_names]
        points = {o.exercise.name: o.points for r in listed for o in r.outcomes}
        rows.append([student] + [_points(points[e.name]) for e in columns] + [_points(sum(points.values()))])
        _write_feedback(out / "feedback" / f"{student}.txt", student, listed, refused[student])
    csv_path = out / "grades.csv"
    with (out / "grades.csv.partial").open("w", newline="") as f:
        csv.writer(f).writerows([["student"] + [e.name for e in columns] + ["total"]] + rows)
    os.replace(out / "grades.csv.partial", csv_path)  # every sandbox is gone by now: only the grader writes it
    log(f"wrote {csv_path} (maximum {_points(sum(e.points for e in columns))} points) and {out / 'feedback'}/")
    return csv_path


def _report_of(future, key: tuple[str, str], course_ex, log) -> NotebookReport:
    """The notebook's report; a grader error on one notebook (not the submission's doing) is its 0 and a note, and
    the class goes on."""
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001 - one notebook never stops the class's grades
        log(f"{key[0]}/{key[1]}: the grader failed on this notebook: {type(e).__name__}")
        return NotebookReport(key[1], [Outcome(x, 0.0, "not graded: the grader failed on this notebook")
                                       for x in course_ex[key[1]]], [f"grader error: {type(e).__name__}"])


def _flag(report: NotebookReport, changed: list[str]) -> None:
    for outcome in report.outcomes:
        outcome.points, outcome.message = 0.0, "0: the course's files changed while this notebook was graded"
    report.notes.append(f"FLAGGED: the course's files changed while this notebook was graded "
                        f"({', '.join(sorted(set(changed))[:5])}); they were put back")


def _write_feedback(path: Path, student: str, reports: list[NotebookReport], refused: list[str]) -> None:
    got = sum(o.points for r in reports for o in r.outcomes)
    most = sum(o.exercise.points for r in reports for o in r.outcomes)
    lines = [f"{student}: {_points(got)} of {_points(most)} points", ""]
    for report in reports:
        lines.append(report.name)
        for o in report.outcomes:
            lines.append(f"  {o.exercise.name}: {_points(o.points)}/{_points(o.exercise.points)}  {o.message}")
        lines += [f"  note: {note}" for note in report.notes]
        lines.append("")
    lines += [f"note: {note}" for note in refused]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    from lessonlib import grading

    parser = argparse.ArgumentParser(prog="python -m lessonlib.grading", description=grading.__doc__.split("\n\n")[0],
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
    parser.add_argument("--sandbox", choices=sandbox.MODES, default="auto",
                        help="how each notebook is isolated (auto: bwrap, else unshare; none only with "
                             "--unsafe-no-sandbox); "
                             "LESSONLIB_GRADING_SANDBOX overrides it")
    parser.add_argument("--scratch-mb", type=int, default=Limits.work_bytes >> 20,
                        help="size of each sandbox's working folder, /tmp and /dev/shm (tmpfs, MiB)")
    parser.add_argument("--require-sandbox", action="store_true", help="(the default now: kept for old scripts)")
    parser.add_argument("--unsafe-no-sandbox", action="store_true",
                        help="grade even where no sandbox can start (a notebook can then write the grader's files)")
    parser.add_argument("--allow-modified-course", action="store_true",
                        help="grade with lessonlib as it is, not as released (for the course's own developers)")
    args = parser.parse_args(argv)
    if not args.submissions.is_dir():
        parser.error(f"{args.submissions} is not a folder")
    if not args.course.is_dir():
        parser.error(f"{args.course} is not a folder of instructor notebooks: pass --course")
    out = args.out or args.submissions.resolve().parent / f"{args.submissions.resolve().name}-graded"
    try:
        limits = Limits(args.cell_timeout, args.notebook_timeout, args.output_cap, work_bytes=args.scratch_mb << 20)
        grade(args.submissions, out, args.course, limits,
              args.keep_scratch, args.jobs, log=lambda line: print(line, flush=True), sandbox_mode=args.sandbox,
              unsafe_no_sandbox=args.unsafe_no_sandbox, allow_modified_course=args.allow_modified_course)
    except (sandbox.SandboxUnavailable, CourseChanged) as e:
        print(f"lessonlib.grading: {e}", file=sys.stderr)
        return 3
    return 0
