"""Recorded GPU runs: the file format benchmarks write and notebooks plot.

A results file is JSON::

    {
      "format": "lessonlib-results/1",
      "benchmark": "fusion",
      "command": "python benchmarks/bench_fusion.py --out ...",
      "environment": {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0",
                      "date": "2026-11-30T10:00:00+00:00"},
      "ceilings": {"bandwidth_gbs": ..., "matmul_tflops": ...},
      "records": [{"op": "swiglu", "impl": "lessonlib", "shape": {"T": 8192, "I": 14336}, "dtype": "bfloat16",
                   "us": 250.1, "bytes": ..., "gbps": ...}, ...],
      "notes": {...}
    }

Every peer measured in the run is a record of its own (``impl``: ``eager``, ``torch.compile``, ``copy``...).
Committed files live in ``lessonlib/results/`` so that a pip-installed lessonlib (Colab) carries them.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lessonlib.measure import Ceilings

FORMAT = "lessonlib-results/1"
RESULTS_DIR = Path(__file__).parent / "results"


def environment() -> dict:
    """What a recorded run must name: the GPU, the versions, the date."""
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


@dataclass
class Results:
    benchmark: str
    command: str
    environment: dict
    ceilings: dict
    records: list
    notes: dict

    def select(self, **where) -> list[dict]:
        """Records whose fields equal every ``where`` item; a shape key may be given directly (``T=8192``)."""
        out = []
        for rec in self.records:
            fields = {**rec.get("shape", {}), **rec}
            if all(fields.get(k) == v for k, v in where.items()):
                out.append(rec)
        return out

    def one(self, **where) -> dict:
        found = self.select(**where)
        if len(found) != 1:
            raise KeyError(f"{len(found)} records match {where} in the '{self.benchmark}' results")
        return found[0]

    def provenance(self) -> str:
        env = self.environment
        return (f"recorded on {env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date'][:10]}; "
                f"command: {self.command}")

    def recorded_ceilings(self) -> Ceilings:
        return Ceilings(self.ceilings["bandwidth_gbs"], self.ceilings["matmul_tflops"], self.provenance())

    def to_json(self) -> dict:
        return {"format": FORMAT, "benchmark": self.benchmark, "command": self.command,
                "environment": self.environment, "ceilings": self.ceilings, "records": self.records,
                "notes": self.notes}

    def save(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def load(name_or_path) -> Results:
    """A committed results file by name (``load("fusion-h200")``) or any path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = RESULTS_DIR / f"{name_or_path}.json"
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file (format={data.get('format')!r})")
    return Results(data["benchmark"], data["command"], data["environment"], data["ceilings"], data["records"],
                   data.get("notes", {}))


def find(name: str) -> Results | None:
    """A committed results file by name, or None when that benchmark has not been recorded yet."""
    return load(name) if (RESULTS_DIR / f"{name}.json").exists() else None


def recorded_ceilings(name: str = "fusion-h200") -> Ceilings:
    """The ceilings measured in a recorded run: what a CPU-only notebook plots against."""
    return load(name).recorded_ceilings()
