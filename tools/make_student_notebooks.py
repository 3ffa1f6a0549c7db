"""Generate the student copies of the course notebooks: solutions stripped, outputs cleared, exercise cells locked.

    python tools/make_student_notebooks.py          # writes notebooks/student/*.ipynb
    python tools/make_student_notebooks.py --check  # exit 1 if the committed copies are out of date
    python tools/make_student_notebooks.py --nbgrader-course DIR [NOTEBOOK ...]
                                                    # an nbgrader course folder: DIR/source/<lesson>/, config
    python tools/make_student_notebooks.py --mark-exercises   # nbgrader metadata for new exercises

Each copy's first line holds its own Colab and Binder badges, which open the student copy (``course_links.py``
writes them from pyproject.toml).

Solutions sit in the instructor notebooks between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (nbgrader's
markers), and the exercise cells carry nbgrader's metadata; :mod:`lessonlib.grading` holds the rules
(:func:`~lessonlib.grading.strip_solutions`, :func:`~lessonlib.grading.student_copy`). The copies are what
``nbgrader generate_assignment`` releases with the course's configuration (tests/test_grading.py runs nbgrader to
check it), less nbgrader's gradebook checksums.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

import nbformat

import course_links

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lessonlib.grading import BEGIN, END, exercises, strip_solutions, student_copy  # noqa: E402,F401
from lessonlib.grading.exercise_format import CHECK_CALL  # noqa: E402

SOURCE_DIR = ROOT / "notebooks"
STUDENT_DIR = SOURCE_DIR / "student"

NBGRADER_CONFIG = '''\
# nbgrader's configuration for the course "Fast Attention Kernels & Operator Fusion", written by
# `python tools/make_student_notebooks.py --nbgrader-course`. Each lesson with exercises is an assignment named
# after its notebook. lessonlib must be importable (pip install -e the course).
from lessonlib.grading import configure_nbgrader

c = get_config()  # noqa: F821 (nbgrader provides it)
configure_nbgrader(c)
c.CourseDirectory.db_assignments = {assignments!r}
'''


def sources() -> list[Path]:
    return sorted(p for p in SOURCE_DIR.glob("*.ipynb") if re.match(r"\d\d_", p.name))


# A relative link to a file in an instructor notebook's markdown: ](target) with no scheme and no leading "#" or
# "/", naming a file by its extension (so ``kernel[grid](...)`` in a code span is no link).
RELATIVE_LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:|#|/)([\w./-]+\.(?:ipynb|md|py|json|png)(?:#[^)\s]*)?)\)")


def one_folder_down(markdown: str) -> str:
    """Relative links as they resolve from notebooks/student/: a lesson's link stays (it opens the student copy of
    that lesson beside it); anything else in the course (the appendix, lessonlib's files) is one folder up."""
    def moved(match: re.Match) -> str:
        target = match.group(1)
        return match.group(0) if re.match(r"\d\d_[\w-]+\.ipynb", target) else f"](../{target})"
    return RELATIVE_LINK.sub(moved, markdown)


def render_text(instructor: str, student_path: str, course: course_links.Course) -> str:
    """The student copy of an instructor notebook's text, with badges for ``student_path`` (repository-relative)."""
    notebook = student_copy(nbformat.reads(instructor, as_version=4))
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            cell.source = one_folder_down(cell.source)
    course_links.with_badges(notebook, course, student_path)
    return nbformat.writes(notebook) + "\n"


def render(path: Path) -> str:
    student_path = (STUDENT_DIR / path.name).relative_to(ROOT).as_posix()
    return render_text(path.read_text(), student_path, course_links.course())


def nbgrader_course(folder: Path, notebooks: list[Path]) -> list[str]:
    """Lay out an nbgrader course folder: source/<lesson>/<lesson>.ipynb for each notebook with exercises, and an
    nbgrader_config.py. Returns the assignment names."""
    assignments = []
    for path in notebooks:
        if not exercises(nbformat.read(path, as_version=4), path.name):
            continue
        target = folder / "source" / path.stem
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target / path.name)
        assignments.append(path.stem)
    (folder / "nbgrader_config.py").write_text(NBGRADER_CONFIG.format(
        assignments=[{"name": name} for name in assignments]))
    return assignments


def mark_exercises(path: Path, points: float = 1) -> list[str]:
    """Give nbgrader's metadata to the exercise cells of an instructor notebook that lack it: the solution cell
    (grade_id: the ``my_...`` function it defines) and the checker cell ``check_x(my_x)`` under it (grade_id:
    ``check_x``, ``points``). Cells that have metadata keep it. Returns the exercises marked."""
    notebook = nbformat.read(path, as_version=4)
    marked, solution = [], None
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        if BEGIN in cell.source:
            solution = cell
        call = CHECK_CALL.fullmatch(cell.source.strip())
        if not call or "nbgrader" in cell.metadata:
            continue
        checker, function = call.groups()
        if solution is None or f"def {function}(" not in solution.source:
            raise ValueError(f"{path.name}: {checker}({function}) has no solution cell defining {function} above it")
        solution.metadata.setdefault("nbgrader", {"grade": False, "grade_id": function, "locked": False,
                                                  "schema_version": 3, "solution": True, "task": False})
        cell.metadata["nbgrader"] = {"grade": True, "grade_id": checker, "locked": True, "points": points,
                                     "schema_version": 3, "solution": False, "task": False}
        marked.append(checker)
    if marked:
        nbformat.write(notebook, path)
    return marked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if notebooks/student is out of date")
    parser.add_argument("--nbgrader-course", type=Path, metavar="DIR", help="write an nbgrader course folder")
    parser.add_argument("--mark-exercises", action="store_true",
                        help="give nbgrader's metadata (1 point each) to exercise cells of the instructor notebooks "
                             "that lack it; change points in the checker cell's metadata")
    parser.add_argument("notebooks", nargs="*", type=Path, help="with --nbgrader-course: these lessons only")
    args = parser.parse_args()
    if args.mark_exercises:
        for path in sources():
            for checker in mark_exercises(path):
                print(f"{path.name}: marked {checker}")
        return 0
    if args.nbgrader_course:
        names = nbgrader_course(args.nbgrader_course, [p.resolve() for p in args.notebooks] or sources())
        print(f"wrote {args.nbgrader_course}/nbgrader_config.py and source/ for: {', '.join(names)}")
        print(f"next: cd {args.nbgrader_course} && nbgrader generate_assignment {names[0] if names else 'LESSON'}")
        return 0
    stale = []
    STUDENT_DIR.mkdir(exist_ok=True)
    for path in sources():
        target = STUDENT_DIR / path.name
        text = render(path)
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(target.relative_to(ROOT))
        else:
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")
    if stale:
        print("out of date (run `make student-notebooks`):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
