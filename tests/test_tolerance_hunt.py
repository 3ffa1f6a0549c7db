"""The tolerance hunt's plugin (tests/tolerance_hunt.py): every check_close reports its error and tolerance before
it passes or fails, and the summary keeps each check's worst fraction."""

import json

import pytest
import torch

from lessonlib import testing
from tests import tolerance_hunt


def test_check_close_reports_every_check_before_it_passes_or_fails(tmp_path):
    log = tolerance_hunt._Log(str(tmp_path / "hunt.jsonl"))
    log.test = "tests/x.py::test_y"
    testing.OBSERVERS.append(log.observe)
    try:
        truth = torch.tensor([1.0, -2.0], dtype=torch.float64)
        low = truth.float()
        testing.check_close("exact", low, truth, low)
        with pytest.raises(AssertionError):
            testing.check_close("off", low + 1e-3, truth, low)
    finally:
        testing.OBSERVERS.remove(log.observe)
    log.flush(test_passed=True)
    rows = [json.loads(line) for line in open(tmp_path / "hunt.jsonl")]
    assert [r["check"] for r in rows] == ["exact", "off"]
    assert rows[0]["fraction"] == 0.0 and rows[1]["fraction"] > 1  # the failing check is logged too
    assert tolerance_hunt.planted(rows[1]) and not tolerance_hunt.planted(rows[0])  # expected to fail here
    tol = testing.tolerance(truth, low, torch.float32)
    assert rows[1]["tolerance"] == pytest.approx(tol) and rows[1]["dtype"] == "float32"


def test_summary_keeps_each_checks_worst_fraction_over_runs(tmp_path, capsys):
    rows = [{"run": run, "test": "t.py::a", "check": "c", "dtype": "float32", "fraction": f}
            for run, f in (("1", 0.1), ("2", 0.4), ("3", 0.2))]
    rows.append({"run": "1", "test": "t.py::b", "check": "c", "dtype": "float16", "fraction": 0.7})
    rows.append({"run": "1", "test": "t.py::d", "check": "c", "dtype": "float16", "fraction": 9.0, "test_passed": True})
    entries = tolerance_hunt.summary(rows)
    assert [(e["test"], e["worst"], e["runs"]) for e in entries] == [("t.py::b", 0.7, 1), ("t.py::a", 0.4, 3)]
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert tolerance_hunt.main([str(path)]) == 1  # one check above the limit of 0.5
    assert "1 checks above 0.5" in capsys.readouterr().out
