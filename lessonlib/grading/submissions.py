"""Grading a folder of submissions (one folder per student): ``grades.csv``, ``feedback/`` and ``graded/``; the
command line ``python -m lessonlib.grading``."""

from __future__ import annotations

import argparse
import csv
import hashlib
import os
import queue
import re
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat

from lessonlib.grading import sandbox
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


class CourseChanged(RuntimeError):
    """A notebook changed the course's files: grading stops, and no grades.csv is written."""


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
    """{file: sha256} of lessonlib and the instructor notebooks: what a notebook must not change."""
    hashes = {}
    for folder in (ROOT / "lessonlib", Path(course)):
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and ".ipynb_checkpoints" not in path.parts:
                hashes[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hashes


def _points(value: float) -> str:
    return f"{value:g}"


def _sandbox(mode: str, required: bool, log) -> str:
    """The sandbox mode to use (``LESSONLIB_GRADING_SANDBOX`` overrides ``mode``); without one, a warning, or a
    refusal when one is ``required``."""
    mode, why = sandbox.choose(os.environ.get("LESSONLIB_GRADING_SANDBOX", mode))
    if mode == "none":
        if required:
            raise sandbox.SandboxUnavailable(f"no sandbox: {why} (--require-sandbox)")
        log("WARNING: " + sandbox.RISK.format(why=why))
    return mode


def _collect(submissions: Path, course_ex: dict[str, list[Exercise]], log):
    """(students, {(student, course notebook): the file graded}, {student: notes on files not graded})."""
    students = sorted(p.name for p in submissions.iterdir() if p.is_dir() and not p.name.startswith("."))
    for stray in sorted(p for p in submissions.iterdir() if p.is_file()):
        log(f"ignored {stray.name}: put each student's notebooks in a folder named after the student")
    found: dict[tuple[str, str], Path] = {}
    picked: dict[str, list[str]] = {}
    for student in students:
        chosen, picked[student] = _pick(student, sorted((submissions / student).rglob("*.ipynb")), course_ex)
        found.update({(student, name): path for name, path in chosen.items()})
    return students, found, picked


def grade(submissions: Path, out: Path, course: Path = COURSE_NOTEBOOKS, limits: Limits | None = None,
          keep_scratch: bool = False, jobs: int = 1, log=print, sandbox_mode: str = "auto",
          require_sandbox: bool = False) -> Path:
    """Grade every student folder in ``submissions``; write ``out/grades.csv``, ``out/feedback/`` and
    ``out/graded/``. ``jobs`` notebooks run at once (each in its own kernel and sandbox, :mod:`.sandbox`). The course
    files are hashed before the first notebook and after each: a change stops the grading (:class:`CourseChanged`).
    Returns the CSV's path."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    limits = limits or Limits()
    submissions, out = Path(submissions).resolve(), Path(out).resolve()
    mode = _sandbox(sandbox_mode, require_sandbox, log)
    course_ex = course_exercises(Path(course))
    students, found, picked = _collect(submissions, course_ex, log)
    graded_names = [name for name in course_ex if any(n == name for _, n in found)]
    columns = [e for name in graded_names for e in course_ex[name]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "feedback").mkdir(exist_ok=True)
    log(f"grading {len(found)} notebook(s) of {len(students)} student(s) in sandbox {mode}: "
        f"{', '.join(graded_names) or 'none'}")
    # Outside --out (a sandbox sees none of it but its own folder), with short paths (a Unix socket's is <108 bytes).
    scratch_root = Path(tempfile.mkdtemp(prefix="lessonlib-grading-")).resolve()
    os.chmod(scratch_root, 0o755)
    hidden = tuple(dict.fromkeys((submissions, out, scratch_root)))
    slots: queue.Queue[int] = queue.Queue()
    for slot in range(max(1, jobs)):
        slots.put(slot)
    before = course_hash(course)

    def run(number: int, student: str, name: str) -> NotebookReport:
        scratch, slot = scratch_root / str(number), slots.get()
        try:
            report = grade_notebook(found[student, name], name, course_ex[name], scratch, limits,
                                    out / "graded" / student / name, mode, slot, hidden)
        finally:
            slots.put(slot)
            if not keep_scratch:
                shutil.rmtree(scratch, ignore_errors=True)
        report.notes += [note for note in picked[student] if note.startswith(name)]
        return report

    reports: dict[tuple[str, str], NotebookReport] = {}
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = {pool.submit(run, number, *key): key for number, key in enumerate(found)}
            for done, future in enumerate(as_completed(futures), 1):
                student, name = futures[future]
                report = reports[student, name] = future.result()
                after = course_hash(course)
                changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
                if changed:
                    for other in futures:
                        other.cancel()
                    running = [f"{s}/{n}" for f, (s, n) in futures.items() if f.running()]
                    raise CourseChanged(f"stopped: course files changed while grading {student}/{report.name}"
                                        + (f" (also running: {', '.join(running)})" if running else "")
                                        + f": {', '.join(changed[:5])}; no grades.csv written")
                got, most = sum(o.points for o in report.outcomes), sum(e.points for e in course_ex[name])
                log(f"[{done}/{len(found)}] {student}: {name}: {_points(got)}/{_points(most)} points in "
                    f"{report.seconds:.0f} s" + (f" ({report.notes[-1]})" if report.notes else ""))
    finally:
        if keep_scratch:
            log(f"kept the scratch folders in {scratch_root}")
        else:
            shutil.rmtree(scratch_root, ignore_errors=True)
    rows = []
    for student in students:
        listed = [reports.get((student, name)) or NotebookReport(name, [Outcome(e, 0.0, "not submitted")
                                                                        for e in course_ex[name]])
                  for name in graded_names]
        points = {o.exercise.name: o.points for r in listed for o in r.outcomes}
        rows.append([student] + [_points(points[e.name]) for e in columns] + [_points(sum(points.values()))])
        _write_feedback(out / "feedback" / f"{student}.txt", student, listed)
    csv_path = out / "grades.csv"
    with (out / "grades.csv.partial").open("w", newline="") as f:
        csv.writer(f).writerows([["student"] + [e.name for e in columns] + ["total"]] + rows)
    os.replace(out / "grades.csv.partial", csv_path)  # every sandbox is gone by now: only the grader writes it
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
                        help="how each notebook is isolated (auto: bwrap, else unshare, else none, with a warning); "
                             "LESSONLIB_GRADING_SANDBOX overrides it")
    parser.add_argument("--scratch-mb", type=int, default=Limits.work_bytes >> 20,
                        help="size of each sandbox's working folder, /tmp and /dev/shm (tmpfs, MiB)")
    parser.add_argument("--require-sandbox", action="store_true", help="refuse to grade without a sandbox")
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
              require_sandbox=args.require_sandbox)
    except (sandbox.SandboxUnavailable, CourseChanged) as e:
        print(f"lessonlib.grading: {e}", file=sys.stderr)
        return 3
    return 0
