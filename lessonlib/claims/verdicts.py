"""What decides a claim: a verdict's two strings, and the wording every verdict uses."""

from __future__ import annotations

from dataclasses import dataclass

from lessonlib.results import Results, find, recorded_name


@dataclass(frozen=True)
class Verdict:
    measured: str  # the measured values, computed
    verdict: str


def committed_run(benchmark: str) -> Results | None:
    """The committed GPU run of ``benchmark``, or None."""
    return find(recorded_name(benchmark))


def not_recorded(benchmark: str, what: str) -> Verdict:
    """The verdict of a claim whose records the committed file lacks (or the file itself)."""
    module, name = f"benchmarks.bench_{benchmark}", recorded_name(benchmark)
    return Verdict(f"{name}.json holds no {what}",
                   f"not yet measured on a GPU (python -m {module} --out lessonlib/results/{name}.json records it)")


def pct(x: float) -> str:
    return f"{x:.0%}"


def in_range(points: dict[str, float], low: float, high: float) -> str:
    """'holds' / 'holds at A; not at B' / 'does not hold at any measured point', for values claimed in [low, high]."""
    inside = [p for p, x in points.items() if low <= x <= high]
    outside = [p for p, x in points.items() if p not in inside]
    if not outside:
        return "holds at every measured point"
    if not inside:
        return "does not hold at any measured point"
    return f"holds at {', '.join(inside)}; not at {', '.join(outside)}"
