"""The course repository's URL is named once (pyproject.toml); every link and set-up cell agrees with it, and
`make relink REPO=...` re-points them all."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import lessonlib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import course_links  # noqa: E402

COURSE = course_links.course()
# Every kind of link that names the course repository: Colab and Binder openers, pip's git URLs.
LINK = re.compile(r"colab\.research\.google\.com/github/(?P<colab>[\w.-]+/[\w.-]+)/blob/(?P<colab_ref>[\w.-]+)/"
                  r"(?P<colab_path>[\w./-]+\.ipynb)"
                  r"|mybinder\.org/v2/gh/(?P<binder>[\w.-]+/[\w.-]+)/(?P<binder_ref>[\w.-]+)\?urlpath=lab/tree/"
                  r"(?P<binder_path>[\w./-]+\.ipynb)"
                  r"|git\+https://github\.com/(?P<pip>[\w.-]+/[\w.-]+)@(?P<pip_ref>[\w.-]+)")


def notebooks():
    return course_links.instructor_notebooks() + sorted((ROOT / "notebooks" / "student").glob("*.ipynb"))


def links(text):
    return [{k: v for k, v in m.groupdict().items() if v} for m in LINK.finditer(text)]


def test_everything_agrees_with_pyproject():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "course_links.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_version_and_tag():
    assert lessonlib.__version__ == COURSE.version
    assert COURSE.tag == f"v{COURSE.version}"


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_each_notebook_opens_with_its_own_badges_and_installs_the_release(path):
    notebook = nbformat.read(path, as_version=4)
    relative = path.relative_to(ROOT).as_posix()
    first_markdown = next(c for c in notebook.cells if c.cell_type == "markdown")
    badge_links = links(first_markdown.source.split("\n")[0])
    assert [(link.get("colab_path") or link.get("binder_path")) for link in badge_links] == [relative, relative]
    setup = next(c for c in notebook.cells if c.cell_type == "code").source
    assert setup == course_links.setup_cell(COURSE, path.name)
    assert f'"git+{COURSE.repository}@{COURSE.tag}"' in setup
    assert ("install.set_up_vllm()" in setup) == (path.name == "06_vllm.ipynb")
    assert len(setup.split("\n")) <= course_links.SETUP_LINES, setup
    assert max(len(line) for line in setup.split("\n")) <= course_links.SETUP_WIDTH, setup
    every = links(path.read_text())
    assert every, "no links at all"
    for link in every:
        assert set(v for k, v in link.items() if k in ("colab", "binder", "pip")) == {COURSE.slug}, link
        assert set(v for k, v in link.items() if k.endswith("_ref")) == {COURSE.tag}, link


def test_readme_table_has_both_copies_of_every_lesson():
    """Both copies of every lesson, the student copy first: the title and the badges open it."""
    text = (ROOT / "README.md").read_text()
    for row in course_links.TABLE_ROW.finditer(text):
        assert row["path"].startswith("notebooks/student/"), row.group()
        cells = row.group().split(" | ")
        assert "notebooks/student/" in cells[2] and "notebooks/student/" in cells[3], row.group()
    opened = {link.get("colab_path") or link.get("binder_path") for link in links(text)}
    for path in course_links.instructor_notebooks():
        name = path.name
        assert {f"notebooks/{name}", f"notebooks/student/{name}"} <= opened, name
    for link in links(text):
        assert COURSE.slug in link.values() and COURSE.tag in link.values(), link


def test_make_relink_repoints_a_fork(tmp_path):
    """The README's one command, on a copy of the repository: pyproject.toml, every notebook, every student copy and
    the README name the fork afterwards, and nothing names the original."""
    for name in ("pyproject.toml", "README.md", "Makefile", "requirements-vllm-cpu.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    for name in ("tools", "notebooks"):
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    appendix = tmp_path / "notebooks" / "appendix_measurements.ipynb"
    if not appendix.exists():  # the line under the table is written for it: a stand-in where it does not exist yet
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Appendix")]), appendix)
    fork = "https://github.com/me/my-fork"
    # The Makefile runs $(VENV)/bin/python: a stand-in for this interpreter, wherever it is (a GPU machine's system
    # Python has no bin/python beside its python3)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    run = subprocess.run(["make", "-s", "relink", f"REPO={fork}", f"VENV={venv}"], cwd=tmp_path, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f'Repository = "{fork}"' in (tmp_path / "pyproject.toml").read_text()
    check = subprocess.run([sys.executable, "tools/course_links.py", "--check"], cwd=tmp_path, capture_output=True,
                           text=True)
    assert check.returncode == 0 and "me/my-fork" in check.stdout, check.stdout + check.stderr
    readme = (tmp_path / "README.md").read_text()
    assert "**Appendix.** [Measured results](notebooks/appendix_measurements.ipynb)" in readme
    assert "/me/my-fork/blob/v" in readme.split("**Appendix.**")[1].split("\n")[0]
    lessons = [tmp_path / "notebooks" / path.name for path in course_links.instructor_notebooks()]
    files = [tmp_path / "README.md", *lessons, *tmp_path.glob("notebooks/student/*.ipynb")]
    assert len(files) == 1 + 2 * len(course_links.instructor_notebooks())
    # the appendix of measured results is not a lesson: no badges, no set-up cell, nothing for relink to rewrite
    appendix = "notebooks/appendix_measurements.ipynb"
    assert (tmp_path / appendix).read_text() == (ROOT / appendix).read_text()
    assert COURSE.slug not in (ROOT / appendix).read_text() and not links((ROOT / appendix).read_text())
    for path in files:
        text = path.read_text()
        assert COURSE.slug not in text, path
        assert links(text) and all("me/my-fork" in link.values() for link in links(text)), path
    # the real repository was not touched
    assert course_links.course() == COURSE


def test_relink_refuses_a_url_colab_cannot_open(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    shutil.copy(ROOT / "pyproject.toml", pyproject)
    with pytest.raises(ValueError, match="not a GitHub repository URL"):
        course_links.set_repository("https://gitlab.com/me/fork", pyproject)
    assert pyproject.read_text() == (ROOT / "pyproject.toml").read_text()
    course_links.set_repository("https://github.com/me/fork.git", pyproject)
    assert course_links.course(pyproject).repository == "https://github.com/me/fork"


def test_the_tested_stack_is_what_make_setup_installs():
    """README's and the set-up cells' "tested with" come from pyproject.toml (--check above); `make setup` installs
    the same CPU torch and puts the same Colab Triton where the compile-target test looks for it."""
    assert f"TORCH  ?= torch=={COURSE.tested['ci_torch']}\n" in (ROOT / "Makefile").read_text()
    setup = (ROOT / "tools" / "setup.sh").read_text()
    assert "course_links.py --tested colab_triton)" in setup and '--target .triton-colab "triton==$colab_triton"' in setup
    run = subprocess.run([sys.executable, "tools/course_links.py", "--tested", "colab_triton"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.stdout.strip() == COURSE.tested["colab_triton"], run.stderr


def _run_setup_cell(name, monkeypatch, lessonlib_missing):
    """Run a set-up cell as a kernel would, on a machine with or without lessonlib; pip is replaced by a recorder
    (nothing is installed). Returns (what it printed, the pip commands it ran)."""
    import contextlib
    import importlib.util
    import io
    import subprocess as real_subprocess

    find_spec, pip = importlib.util.find_spec, []
    if lessonlib_missing:
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "lessonlib" else find_spec(name, *a))
    monkeypatch.setattr(real_subprocess, "run", lambda command, **kw: pip.append(command))
    monkeypatch.setattr(lessonlib.install, "set_up_vllm", lambda: print("(vLLM set up)"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(course_links.setup_cell(COURSE, name), {})
    return printed.getvalue(), pip


@pytest.mark.parametrize("name", ["00_setup_and_roofline.ipynb", "06_vllm.ipynb"])
def test_the_setup_cell_installs_the_release_only_where_lessonlib_is_missing(name, monkeypatch):
    """Colab (no lessonlib): pip installs the release tag, torch left unpinned. `make setup`, Binder, CI: nothing is
    installed, and what the cell prints names no folder of the machine it ran on. Lesson 06 also sets up vLLM."""
    printed, pip = _run_setup_cell(name, monkeypatch, lessonlib_missing=False)
    assert pip == [], pip
    assert "Mode: " in printed and ("(vLLM set up)" in printed) == (name == "06_vllm.ipynb"), printed
    assert str(ROOT) not in printed and "/" not in printed, printed
    printed, pip = _run_setup_cell(name, monkeypatch, lessonlib_missing=True)
    assert len(pip) == 1 and pip[0][1:5] == ["-m", "pip", "install", "-q"], pip
    requirement = pip[0][5]
    assert requirement == f"git+{COURSE.repository}@{COURSE.tag}"
    assert "torch" not in requirement.split("@")[0]
