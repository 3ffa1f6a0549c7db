"""Generate the student copies of the course notebooks: solutions stripped, outputs cleared, exercise cells locked.

    python tools/make_student_notebooks.py          # writes notebooks/student/*.ipynb
    python tools/make_student_notebooks.py --check  # exit 1 if the committed copies are out of date
    python tools/make_student_notebooks.py --nbgrader-course DIR [NOTEBOOK ...]
                                                    # an nbgrader course folder: DIR/source/<lesson>/, config

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lessonlib.grading import BEGIN, END, exercises, strip_solutions, student_copy  # noqa: E402,F401

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


def render(path: Path) -> str:
    notebook = student_copy(nbformat.read(path, as_version=4))
    return nbformat.writes(notebook) + "\n"


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if notebooks/student is out of date")
    parser.add_argument("--nbgrader-course", type=Path, metavar="DIR", help="write an nbgrader course folder")
    parser.add_argument("notebooks", nargs="*", type=Path, help="with --nbgrader-course: these lessons only")
    args = parser.parse_args()
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
