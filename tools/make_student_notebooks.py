"""Generate the student copies of the course notebooks: solutions stripped, outputs cleared.

    python tools/make_student_notebooks.py          # writes notebooks/student/*.ipynb
    python tools/make_student_notebooks.py --check  # exit 1 if the committed copies are out of date

Each copy's first line holds its own Colab and Binder badges, which open the student copy (``course_links.py``
writes them from pyproject.toml).

Solutions sit in the instructor notebooks between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (nbgrader's
markers). In a student copy each such block becomes a stub with the block's indentation: ``pass`` inside a
``@triton.jit`` function (a ``raise`` there would not compile on a GPU; the checker reports the untouched, still-NaN
output as "not implemented yet"), ``raise NotImplementedError`` anywhere else.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

import course_links

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIR = ROOT / "notebooks"
STUDENT_DIR = SOURCE_DIR / "student"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def _in_triton_kernel(lines: list[str], index: int, indent: int) -> bool:
    """Is line ``index`` inside a function decorated with @triton.jit? Looks up to the enclosing ``def``."""
    for j in range(index - 1, -1, -1):
        stripped = lines[j].lstrip()
        if stripped.startswith("def ") and len(lines[j]) - len(stripped) < indent:
            return j > 0 and lines[j - 1].strip() in ("@triton.jit", "@jit")
    return False


def strip_solutions(source: str) -> str:
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


def student_copy(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    copy = nbformat.from_dict(notebook)
    for cell in copy.cells:
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source)
            cell.outputs = []
            cell.execution_count = None
    return copy


def sources() -> list[Path]:
    return sorted(p for p in SOURCE_DIR.glob("*.ipynb") if re.match(r"\d\d_", p.name))


def render_text(instructor: str, student_path: str, course: course_links.Course) -> str:
    """The student copy of an instructor notebook's text, with badges for ``student_path`` (repository-relative)."""
    notebook = student_copy(nbformat.reads(instructor, as_version=4))
    course_links.with_badges(notebook, course, student_path)
    return nbformat.writes(notebook) + "\n"


def render(path: Path) -> str:
    student_path = (STUDENT_DIR / path.name).relative_to(ROOT).as_posix()
    return render_text(path.read_text(), student_path, course_links.course())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if notebooks/student is out of date")
    args = parser.parse_args()
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
