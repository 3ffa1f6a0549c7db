"""The course repository's URL lives in one place, pyproject.toml's ``[project.urls] Repository``; this tool writes
everything that names it:

* each notebook's set-up cell (its first code cell), which installs lessonlib from the repository at the release
  tag ``v<version>`` (``[project] version``) when lessonlib is missing;
* the Colab and Binder badges on the first line of each notebook's first markdown cell, in the instructor notebooks
  and in the student copies (a student copy's badges open the student copy; ``make_student_notebooks.py`` asks
  :func:`badges` for them);
* README.md's lesson table (each lesson's student copy first, with its Colab and Binder badges, then the instructor
  copy) and the appendix's line under it;
* the stacks the course is tested on (``[tool.course.tested]``): README.md's "Tested with" line. ``--tested KEY``
  prints one of them (``tools/setup.sh`` reads ``colab_triton`` so).

Badges open the same tag the set-up cell installs, so a notebook always runs with the lessonlib it was written for.

    python tools/course_links.py                 # rewrite all of the above from pyproject.toml
    python tools/course_links.py --check         # exit 1 if any of it disagrees with pyproject.toml
    python tools/course_links.py --repo URL      # re-point the course (e.g. a fork): update pyproject.toml, rewrite
    python tools/course_links.py --tested colab_triton   # print one tested version (3.6.0)

``make relink`` and ``make relink REPO=https://github.com/me/fork`` run it.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

import nbformat

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's own copy of the same parser
    import pip._vendor.tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
README = ROOT / "README.md"
NOTEBOOKS = ROOT / "notebooks"
GITHUB = re.compile(r"https://github\.com/(?P<owner>[\w.-]+)/(?P<name>[\w.-]+?)(?:\.git)?/?$")
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
BINDER_BADGE = "https://mybinder.org/badge_logo.svg"
BADGE_LINE = re.compile(r"^\[!\[Open In Colab\]\(.*$")


@dataclass(frozen=True)
class Course:
    repository: str  # https://github.com/OWNER/NAME
    version: str  # lessonlib's version; its release is tagged v<version>
    tested: dict = field(default_factory=dict)  # [tool.course.tested]: the stacks the course is tested on

    def tested_with(self) -> str:
        """One sentence naming the stacks the course is tested on."""
        t = self.tested
        return (f"CI (no GPU): Python {t['ci_python']}, torch {t['ci_torch']} (CPU build), Triton {t['ci_triton']} "
                f"(the newest; `make setup` takes it), every kernel also compiled for sm_75 to sm_120 under Colab's "
                f"Triton {t['colab_triton']}. GPU: torch {t['gpu_torch']} with Triton {t['gpu_triton']}, on "
                f"{t['gpu_where']}.")

    @property
    def slug(self) -> str:
        match = GITHUB.match(self.repository)
        return f"{match['owner']}/{match['name']}"

    @property
    def tag(self) -> str:
        return f"v{self.version}"

    def colab(self, path: str) -> str:
        return f"https://colab.research.google.com/github/{self.slug}/blob/{self.tag}/{path}"

    def binder(self, path: str) -> str:
        return f"https://mybinder.org/v2/gh/{self.slug}/{self.tag}?urlpath=lab/tree/{path}"


def check_repository(url: str) -> str:
    """Colab opens notebooks from GitHub only (``colab.research.google.com/github/...``), Binder's ``gh`` too."""
    if not GITHUB.match(url):
        raise ValueError(f"{url!r} is not a GitHub repository URL (https://github.com/OWNER/NAME): Colab and "
                         "Binder open notebooks from GitHub")
    return url.rstrip("/").removesuffix(".git")


def course(pyproject: Path = PYPROJECT) -> Course:
    toml = tomllib.loads(pyproject.read_text())
    project = toml["project"]
    return Course(check_repository(project["urls"]["Repository"]), project["version"], toml["tool"]["course"]["tested"])


def set_repository(url: str, pyproject: Path = PYPROJECT) -> None:
    """Rewrite ``Repository = "..."`` in pyproject.toml's [project.urls] (the rest of the file is left as it is)."""
    url = check_repository(url)
    text = pyproject.read_text()
    table = re.search(r"^\[project\.urls\]\n(?:(?!\[).*\n)*", text, re.M)
    line = re.compile(r'^Repository = ".*"$', re.M)
    if table is None or not line.search(table.group()):
        raise ValueError(f"{pyproject}: no `Repository = \"...\"` line in [project.urls]")
    start, end = table.span()
    pyproject.write_text(text[:start] + line.sub(f'Repository = "{url}"', table.group()) + text[end:])


def badges(course: Course, path: str) -> str:
    """The badge line that opens notebook ``path`` (relative to the repository root) on Colab and on Binder."""
    return (f"[![Open In Colab]({COLAB_BADGE})]({course.colab(path)}) "
            f"[![Binder]({BINDER_BADGE})]({course.binder(path)})")


# The set-up cell a student sees first: short, and nothing in it or in what it prints names a machine. Where lessonlib
# is missing (a fresh Colab runtime) pip installs the course's release tag; that keeps Colab's torch (lessonlib
# leaves torch unpinned) and Colab's ipywidgets 7.7 (lessonlib accepts >=7.7). On Binder, in CI and after
# `make setup` lessonlib is already installed and the cell installs nothing and says nothing about it. The stacks
# the course is tested on are in README.md, not here. `$`-placeholders are filled by setup_cell().
SETUP = Template('''\
# Set-up: installs lessonlib, the course's helper package, where it is missing (as on Colab).
import importlib.util, subprocess, sys
if importlib.util.find_spec("lessonlib") is None:
    release = "git+$repository@$tag"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", release], check=True)
    importlib.invalidate_caches()
import lessonlib
$extra
print(lessonlib.describe())  # where kernels run: a GPU, or Triton's interpreter on the CPU''')

# Lesson 06 also needs vLLM, installed before anything imports torch (lessonlib.install imports none; it prints what
# it did, and stops with RestartRuntime if the install replaced a torch this process had already loaded).
VLLM_SETUP = "lessonlib.install.set_up_vllm()  # vLLM, installed before torch is imported\n"
NEEDS_VLLM = {"06_vllm.ipynb"}
SETUP_LINES = 10  # at most, blank lines included: what a student reads before the lesson starts
SETUP_WIDTH = 100  # characters a line at most: JupyterLab's editor at 1280 px shows 107 and cuts the rest


def setup_cell(course: Course, notebook_name: str) -> str:
    return SETUP.substitute(repository=course.repository, tag=course.tag,
                            extra=VLLM_SETUP if notebook_name in NEEDS_VLLM else "")


def with_badges(notebook: nbformat.NotebookNode, course: Course, path: str) -> None:
    """Put the badge line for ``path`` first in ``notebook``'s first markdown cell (replacing one already there)."""
    markdown = next(cell for cell in notebook.cells if cell.cell_type == "markdown")
    lines = markdown.source.split("\n")
    if BADGE_LINE.match(lines[0]):
        lines = lines[2:] if len(lines) > 1 and lines[1] == "" else lines[1:]
    markdown.source = "\n".join([badges(course, path), ""] + lines)


def relink_notebook(notebook: nbformat.NotebookNode, course: Course, path: str) -> nbformat.NotebookNode:
    """``notebook`` with its badge line (first markdown cell) and set-up cell (first code cell) from ``course``."""
    notebook = nbformat.from_dict(notebook)
    with_badges(notebook, course, path)
    code = next(cell for cell in notebook.cells if cell.cell_type == "code")
    source = setup_cell(course, Path(path).name)
    if code.source != source:  # what the old cell printed is not what this one prints: the next run stores it
        code.source, code.outputs = source, []
    return notebook


def instructor_notebooks() -> list[Path]:
    return sorted(p for p in NOTEBOOKS.glob("*.ipynb") if re.match(r"\d\d_", p.name))


def render_notebook(path: Path, course: Course) -> str:
    notebook = relink_notebook(nbformat.read(path, as_version=4), course, path.relative_to(ROOT).as_posix())
    return nbformat.writes(notebook) + "\n"


# A lesson row: its number and its title's link, to the student copy (or, in an older README, the instructor copy).
TABLE_ROW = re.compile(r"^\| (?P<number>\d\d) \| \[(?P<title>[^\n]*?)\]\((?P<path>notebooks/(?:student/)?[^)\s/]+\.ipynb)\) \|.*$",
                       re.M)
TABLE_HEADER = "| # | Lesson: your copy, with the exercises to do | Colab | Binder | Instructor copy (solutions, outputs) |"
TESTED_LINE = re.compile(r"^\*\*Tested with\.\*\* .*$", re.M)
APPENDIX = NOTEBOOKS / "appendix_measurements.ipynb"
APPENDIX_LINE = re.compile(r"^\*\*Appendix\.\*\* .*$", re.M)


def appendix_line(course: Course) -> str:
    """The line under the table for the appendix: no exercises, so no student copy; it opens the notebook itself."""
    path = APPENDIX.relative_to(ROOT).as_posix()
    return (f"**Appendix.** [Measured results]({path}): how the lessons' GPU numbers were measured and the variants "
            f"tried, with the recorded runs; no exercises. [Colab]({course.colab(path)}) · "
            f"[Binder]({course.binder(path)}); in `make lab` it is one folder up (`make lab NOTEBOOKS=notebooks`).")


def render_readme(text: str, course: Course) -> str:
    """README.md with every lesson row written from ``course``: the title opens the student copy (the one a student
    works in), then its Colab and Binder badges, then the instructor copy; and the appendix's line under the table."""
    def row(match: re.Match) -> str:
        name = Path(match["path"]).name
        student, instructor = f"notebooks/student/{name}", f"notebooks/{name}"
        return (f"| {match['number']} | [{match['title']}]({student}) | "
                f"[![Open In Colab]({COLAB_BADGE})]({course.colab(student)}) | "
                f"[![Binder]({BINDER_BADGE})]({course.binder(student)}) | "
                f"[notebook]({instructor}) · [Colab]({course.colab(instructor)}) |")

    rows = {Path(m["path"]).name for m in TABLE_ROW.finditer(text)}
    missing = [p.relative_to(ROOT).as_posix() for p in instructor_notebooks() if p.name not in rows]
    if missing:
        raise ValueError(f"README.md's lesson table has no row for {missing}: add `| NN | [title](path) |` rows")
    text = re.sub(r"^\| # \| (?:Notebook|Lesson)\b.*$", TABLE_HEADER, text, count=1, flags=re.M)
    if not TESTED_LINE.search(text):
        raise ValueError("README.md has no `**Tested with.** ...` line for the tested stacks")
    text = TESTED_LINE.sub(lambda _: f"**Tested with.** {course.tested_with()}", text, count=1)
    text = TABLE_ROW.sub(row, text)
    text = APPENDIX_LINE.sub("", text).replace("\n\n\n\n", "\n\n")  # written again below, after the last row
    if APPENDIX.exists():
        last = list(TABLE_ROW.finditer(text))[-1]
        text = text[:last.end()] + "\n\n" + appendix_line(course) + text[last.end():]
    return text


def expected_files(course: Course) -> dict[Path, str]:
    """Every file this tool writes, with the text it should have: notebooks, student copies, README."""
    sys.path.insert(0, str(Path(__file__).parent))
    import make_student_notebooks  # imports this module for badges(); imported here to keep the cycle lazy

    files = {}
    for path in instructor_notebooks():
        files[path] = render_notebook(path, course)
        student = make_student_notebooks.STUDENT_DIR / path.name
        files[student] = make_student_notebooks.render_text(files[path], student.relative_to(ROOT).as_posix(), course)
    files[README] = render_readme(README.read_text(), course)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if anything disagrees with pyproject.toml")
    parser.add_argument("--repo", help="point the course at this GitHub repository (updates pyproject.toml)")
    parser.add_argument("--tested", metavar="KEY", help="print one entry of [tool.course.tested] and exit")
    args = parser.parse_args(argv)
    if args.tested:
        print(course().tested[args.tested])
        return 0
    if args.check and args.repo:
        parser.error("--check and --repo do not go together")
    if args.repo:
        set_repository(args.repo)
    current = course()
    stale = []
    for path, text in expected_files(current).items():
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(path.relative_to(ROOT).as_posix())
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"out of date with pyproject.toml ({current.repository}, {current.tag}); run `make relink`:",
              *stale, sep="\n  ")
        return 1
    print(f"links point at {current.repository} @ {current.tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
