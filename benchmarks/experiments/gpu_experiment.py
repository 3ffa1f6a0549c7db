"""What the batch-1 experiments share: the start of a GPU-only one's command line, and every one's results file
(its command, the machine, the copy bandwidth its limits use, then its own fields and rows)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def start(description: str, needs_gpu: str) -> tuple[argparse.Namespace, float]:
    """An experiment that times on a GPU: its ``--out`` parsed; on a machine without one, exit saying
    ``needs_gpu``; then the clocks warmed up and the copy bandwidth measured (bytes/s)."""
    from lessonlib import runtime
    from lessonlib.measure import measure_ceilings, warm_up_gpu

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out")
    args = parser.parse_args()
    if not runtime.on_gpu():
        sys.exit(needs_gpu)
    warm_up_gpu()
    return args, measure_ceilings().bandwidth_gbs * 1e9


def write_results(out: str | None, command: str, bandwidth: float | None, rows: list[dict], **fields) -> None:
    """The results file at ``out`` (nothing where None): the command, the environment, the bandwidth in GB/s (None
    where nothing was timed), ``fields``, then the rows."""
    if out is None:
        return
    from lessonlib.results import environment

    Path(out).write_text(json.dumps({
        "command": command, "environment": environment(),
        "bandwidth_gbs": round(bandwidth / 1e9, 1) if bandwidth else None, **fields, "results": rows}, indent=1))
