"""The lab's two generated maps (benchmarks/README.md, benchmarks/experiments/README.md) say what the results files
and the experiments folder hold now: tools/lab_pages.py writes them, and a stale row fails here."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import lab_pages  # noqa: E402


def test_both_pages_are_what_the_tool_writes_from_the_files_now():
    assert lab_pages.main(["--check"]) == 0


@pytest.mark.parametrize("page, writer", [("BENCHMARKS_PAGE", "benchmarks_page"),
                                          ("EXPERIMENTS_PAGE", "experiments_page")])
def test_a_planted_stale_row_fails(page, writer, tmp_path, monkeypatch):
    text = getattr(lab_pages, writer)()
    row = next(line for line in text.splitlines() if line.startswith("| ") and "---" not in line
               and not line.startswith("| benchmark |") and not line.startswith("| question |"))
    stale = row.replace("|", "| (stale)", 2) if "µs" not in row else row.replace("µs", "ms", 1)
    planted = tmp_path / "page.md"
    planted.write_text(text.replace(row, stale))
    monkeypatch.setattr(lab_pages, page, planted)
    assert lab_pages.main(["--check"]) == 1
    assert planted.read_text() == text.replace(row, stale)  # --check writes nothing


def test_an_experiment_row_naming_a_missing_file_or_an_unlisted_script_fails(monkeypatch):
    row = lab_pages.EXPERIMENTS[0]
    missing = lab_pages.Experiment(row.script, row.question, ("no-such-run-h200.json",), row.verdict, "no-such.md")
    monkeypatch.setattr(lab_pages, "EXPERIMENTS", (missing, *lab_pages.EXPERIMENTS[1:]))
    found = lab_pages.problems()
    assert "results/no-such-run-h200.json does not exist" in found and "decisions/no-such.md does not exist" in found
    monkeypatch.setattr(lab_pages, "EXPERIMENTS", lab_pages.EXPERIMENTS[1:])  # a script on main with no row
    assert f"{row.script}.py has no row" in lab_pages.problems()


def test_every_decision_page_cites_files_that_exist():
    for page in (ROOT / "benchmarks" / "decisions").glob("*.md"):
        import re

        for cited in re.findall(r"`((?:benchmarks|lessonlib)/[\w/.-]+\.(?:json|py))`", page.read_text()):
            assert (ROOT / cited).exists(), (page.name, cited)
