"""The tolerance hunt: a pytest plugin that logs, for every ``lessonlib.testing.check_close`` a test makes (directly,
or through check_gradients, check_attention or an exercise checker), the check's worst error as a fraction of its
tolerance. Off unless loaded and given a file; runs append, so repeated runs build one log:

    PYTHONPATH=$PWD python -m pytest -p tests.tolerance_hunt --tolerance-hunt=hunt.jsonl tests/ops/test_swiglu.py
    python -m tests.tolerance_hunt hunt.jsonl          # per check: the worst fraction over every run

A tolerance that can fail at random shows up as a check whose worst fraction creeps toward 1 over many runs of
fresh random inputs; the course asks every check's worst to stay at or below 0.5 of its tolerance, and this module's
report exits 1 when one is above.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

import pytest

LIMIT = 0.5  # the worst fraction of its tolerance a check may reach


def pytest_addoption(parser):
    parser.addoption("--tolerance-hunt", metavar="PATH", default=None,
                     help="append every check_close's error/tolerance to this JSONL file")


class _Log:
    def __init__(self, path: str):
        from lessonlib import runtime

        self.path, self.test = path, None
        self.run = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"  # one pytest session
        self.device = str(runtime.device())
        self.rows = []

    def observe(self, name, dtype, error, tolerance):
        fraction = error / tolerance if tolerance > 0 else (0.0 if error == 0 else float("inf"))
        self.rows.append({"run": self.run, "device": self.device, "test": self.test, "check": name,
                          "dtype": str(dtype).removeprefix("torch."), "error": error, "tolerance": tolerance,
                          "fraction": fraction})

    def flush(self, test_passed: bool):
        with open(self.path, "a") as f:
            for row in self.rows:
                f.write(json.dumps({**row, "test_passed": test_passed}) + "\n")
        self.rows.clear()


def pytest_configure(config):
    path = config.getoption("--tolerance-hunt")
    if not path:
        return
    from lessonlib import testing

    log = _Log(path)
    testing.OBSERVERS.append(log.observe)
    config._tolerance_hunt = log


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    log = getattr(item.config, "_tolerance_hunt", None)
    if log is not None:
        log.test = item.nodeid
    outcome = yield
    if log is not None:
        log.flush(outcome.excinfo is None)  # per test, so an interrupted run keeps what it measured


def planted(row) -> bool:
    """A check over its tolerance in a test that passed: the test expected it to fail (pytest.raises around a known
    mistake), so it is no measure of a tolerance."""
    return row["fraction"] > 1 and row.get("test_passed", True)


def summary(rows) -> list[dict]:
    """One entry per (test, check), worst first: how many times it ran, its worst and median fraction. Planted
    failures (:func:`planted`) are left out."""
    by_check = defaultdict(list)
    for row in rows:
        if not planted(row):
            by_check[(row["test"], row["check"])].append(row)
    out = []
    for (test, check), found in by_check.items():
        fractions = sorted(r["fraction"] for r in found)
        worst = max(found, key=lambda r: r["fraction"])
        out.append({"test": test, "check": check, "n": len(found), "runs": len({r["run"] for r in found}),
                    "worst": fractions[-1], "median": fractions[len(fractions) // 2], "dtype": worst["dtype"],
                    "worst_run": worst["run"]})
    return sorted(out, key=lambda e: -e["worst"])


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", nargs="+", help="JSONL files written with --tolerance-hunt")
    parser.add_argument("--top", type=int, default=30, help="checks to list, worst first")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for path in args.log for line in open(path) if line.strip()]
    entries = summary(rows)
    files = defaultdict(lambda: [0.0, 0])  # per test file: the worst fraction, how many checks ran
    for e in entries:
        f = files[e["test"].split("::")[0]]
        f[0], f[1] = max(f[0], e["worst"]), f[1] + e["n"]
    print(f"{len(rows)} checks logged ({sum(map(planted, rows))} planted failures left out), "
          f"{len({r['run'] for r in rows})} pytest runs, {len(entries)} distinct checks")
    print(f"\n{'test file':55} {'worst':>7} {'checks':>8}")
    for name, (worst, n) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        print(f"{name:55} {worst:7.3f} {n:8d}")
    print(f"\n{'worst':>7} {'median':>7} {'n':>5} {'runs':>4}  test :: check")
    for e in entries[:args.top]:
        print(f"{e['worst']:7.3f} {e['median']:7.3f} {e['n']:5d} {e['runs']:4d}  {e['test']} :: {e['check']}")
    over = [e for e in entries if e["worst"] > LIMIT]
    print(f"\n{len(over)} checks above {LIMIT} of their tolerance")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
