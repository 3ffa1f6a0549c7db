"""Issue 25's regression check: the engine's tokens/s in a new bench_engine.py run against the committed one.

    python -m benchmarks.experiments.compare_engine_runs NEW.json [OLD.json]   # OLD: git HEAD's engine-h200.json

One line per (implementation, batch): old -> new tokens/s and their ratio.
"""

import json
import subprocess
import sys
from pathlib import Path


def generate_rows(data: dict) -> dict:
    return {(r["impl"], r["shape"].get("batch")): r["tokens_per_s"] for r in data["records"] if r["op"] == "generate"}


def main(argv: list[str]) -> None:
    new = json.loads(Path(argv[0]).read_text())
    if len(argv) > 1:
        old = json.loads(Path(argv[1]).read_text())
    else:
        old = json.loads(subprocess.run(["git", "show", "HEAD:lessonlib/results/engine-h200.json"], check=True,
                                        capture_output=True, text=True).stdout)
    print("old", old["environment"]["date"], "new", new["environment"]["date"])
    before, after = generate_rows(old), generate_rows(new)
    for key in sorted(set(before) | set(after), key=str):
        a, b = before.get(key), after.get(key)
        ratio = f"  {b / a:.3f}" if a and b else ""
        print(f"{key[0]:55s} batch {key[1]!s:>3}: {a and round(a)!s:>7} -> {b and round(b)!s:>7}{ratio}")


if __name__ == "__main__":
    main(sys.argv[1:])
