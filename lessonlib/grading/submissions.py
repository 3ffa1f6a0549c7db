"""Grading a folder of submissions (one folder per student): ``grades.csv``, ``feedback/`` and ``graded/``; the
command line ``python -m lessonlib.grading``."""

from __future__ import annotations

import argparse
import csv
import re
import shutil
from pathlib import Path

import nbformat

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
    args = parser.parse_args(argv)
    if not args.submissions.is_dir():
        parser.error(f"{args.submissions} is not a folder")
    if not args.course.is_dir():
        parser.error(f"{args.course} is not a folder of instructor notebooks: pass --course")
    out = args.out or args.submissions.resolve().parent / f"{args.submissions.resolve().name}-graded"
    grade(args.submissions, out, args.course, Limits(args.cell_timeout, args.notebook_timeout, args.output_cap),
          args.keep_scratch, args.jobs, log=lambda line: print(line, flush=True))
    return 0
