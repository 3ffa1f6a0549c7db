"""Write the lab's two maps from what is true now: ``benchmarks/README.md`` (one row per recorded benchmark, read from
``lessonlib/results/*.json``) and ``benchmarks/experiments/README.md`` (one row per experiment, from
:data:`EXPERIMENTS` below, each checked against the files it names). ``--check`` writes nothing and fails where a
page on disk differs from what this would write (tests/test_lab_pages.py runs it).

    python tools/lab_pages.py            # rewrite both pages
    python tools/lab_pages.py --check    # exit 1 if either page is stale
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_PAGE = ROOT / "benchmarks" / "README.md"
EXPERIMENTS_PAGE = ROOT / "benchmarks" / "experiments" / "README.md"
DECISIONS = ROOT / "benchmarks" / "decisions"
# The time a record states, in the order a benchmark's records use them: microseconds, seconds, milliseconds.
TIMES = (("us", "µs"), ("seconds", "s"), ("ttft_ms", "ms TTFT"))
# Where a run has no lessonlib row to headline: the first of these each of its first shape's records has.
FALLBACK = ("now / recorded", "ttft_s", "batch", "output_tokens_per_s", "tokens_per_s")


@dataclass(frozen=True)
class Experiment:
    script: str  # benchmarks/experiments/<script>.py, or "" where it left main (then ``kept_at`` says where)
    question: str
    results: tuple[str, ...]  # files under benchmarks/experiments/results/
    verdict: str
    decision: str  # a page of benchmarks/decisions/, or "" where the finding decided nothing that stands
    kept_at: str = ""  # the commit that still holds a script no longer on main


# The commit whose tree still holds the experiments that were not adopted (``git show COMMIT:PATH``).
REJECTED_AT = "bf829bd"

EXPERIMENTS = (
    Experiment("rope_layout", "Why is torch.compile's RoPE faster than lessonlib's at T=8192?",
               ("rope-layout-h200.json",),
               "The access pattern: in the token-major layout lessonlib's kernel is the faster of the two.", ""),
    Experiment("gated_mlp_parts", "Where does the fused GatedMLP's elementwise saving go?", (),
               "Not run on a GPU yet: no results.", ""),
    Experiment("decode_linear", "Can a Triton kernel read a decode step's weights faster than cuBLAS?",
               ("decode-linear-h200.json",), "Yes at M = 1: ops.gemv.", "gemv-with-pdl.md"),
    Experiment("decode_layer_pdl", "Does programmatic dependent launch shorten a batch-1 decode step?",
               ("decode-layer-pdl-h200.json",), "Yes: gemv loads its first weight tile before it waits.",
               "gemv-with-pdl.md"),
    Experiment("decode_gemv_tiles", "Which tiles for ops.decode_gemv, projections alone?",
               ("decode-gemv-tiles-h200.json", "decode-gemv-tiles-together-h200.json"),
               "Candidates for the GPU tile table; the whole step decides.", "gpu-tile-table.md"),
    Experiment("decode_step_tiles", "decode_gemv's tiles in the engine's whole batch-1 step?",
               ("decode-step-tiles-h200.json",), "The gate_up row of the tile table.", "gpu-tile-table.md"),
    Experiment("decode_step_profile", "Where does the batch-1 decode step's time go, kernel by kernel?",
               ("decode-step-profile-h200.json",), "Per-kernel latency, not bytes, holds the rest of the step.",
               "fused-decode-layer.md"),
    Experiment("per_call_parts", "Where does one decode-size call's host time go?",
               ("per-call-parts-h200.json", "per-call-parts-before-h200.json", "per-call-parts-cached-h200.json"),
               "Triton's binder: the cached launch skips it.", "cached-launch.md"),
    Experiment("dispatch_overhead_cpu", "What does each layer of a call's Python path cost on the host?", (),
               "Measured on the CPU when run; no committed file.", "cached-launch.md"),
    Experiment("generate_oracle", "Why does transformers' generate part from its own no-cache forward?", (),
               "A pad id in the prompt is masked when eos_token_id is None; no length threshold.", ""),
    Experiment("compare_engine_runs", "Did a new engine run move tokens/s against the recorded one?", (),
               "A tool: old and new tokens/s per implementation and batch.", ""),
    Experiment("", "FlashAttention's backward: two kernels, or one with dQ by float32 atomics?",
               ("flash-attention-backward-h200.json",), "Two kernels win at every tile. The comparison is now a "
               "part of `benchmarks/bench_flash_attention_schedules.py`.", ""),
    Experiment("", "bench_fusion rerun with the cached launch on: do lesson 01's figures move?",
               ("fusion-h200-cached-launch.json",), "More than the launch rows moved (host noise): lesson 01 keeps "
               "the run it was written against. Not adopted.", "cached-launch.md"),
    Experiment("", "The batch-1 step with qkv's and gate_up's winning tiles together (a bench_engine run)?",
               ("engine-h200-together-tiles.json",), "No gain against another run's record: decode_step_tiles "
               "then timed both in one run.", "gpu-tile-table.md"),
    Experiment("", "The serving run before the knee rule counted an unreached peer knee as a lower bound",
               ("serving-h200-earlier-run.json",), "Superseded by `lessonlib/results/serving-h200.json`; lesson 07 "
               "cites its saturation ratio.", ""),
    Experiment("", "Attention's loads before its wait; the reduce done by the last split?",
               ("decode-attention-latency-h200.json",), "Loads first: 3% on the Llama shape, 1% on Qwen's; the "
               "last-split reduce is slower. Not adopted.", "below-six-kernels.md", REJECTED_AT),
    Experiment("", "The batch-1 layer in four kernels, attention inside the qkv kernel?",
               ("decode-qkv-attention-h200.json",), "Slower than six kernels at paged attention's splits. Not "
               "adopted.", "below-six-kernels.md", REJECTED_AT),
    Experiment("", "One persistent kernel with grid barriers for a chain of GEMVs?",
               ("persistent-gemv-chain-h200.json",), "Slower per product; the barrier alone costs about a "
               "microsecond. Not adopted.", "below-six-kernels.md", REJECTED_AT),
    Experiment("", "Do the batch-1 projections stream as fast as a GEMV can?", ("decode-gemv-streaming-h200.json",),
               "No schedule streams much faster than decode_gemv's own. Not adopted.", "below-six-kernels.md",
               REJECTED_AT),
)


def _time(record: dict) -> tuple[float, str] | None:
    for field, unit in TIMES:
        if isinstance(record.get(field), (int, float)):
            return record[field], unit
        if isinstance(record.get(field), dict) and "median" in record[field]:
            return record[field]["median"], unit
    return None


def headline(records: list[dict]) -> str:
    """lessonlib's time at the largest shape of the file's first op it runs, beside the fastest other
    implementation at that shape: the figure a reader looks for first."""
    plain = [r for r in records if not r.get("sweep") and _time(r)]
    for op in dict.fromkeys(r["op"] for r in plain):
        mine = [r for r in plain if r["op"] == op and r["impl"].startswith("lessonlib")]
        if not mine:
            continue

        def size(r):
            values = [v for v in r["shape"].values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
            product = 1
            for v in values:
                product *= v
            return product

        shape = max(mine, key=size)["shape"]
        here = [r for r in plain if r["op"] == op and r["shape"] == shape and r.get("regime") == mine[0].get("regime")]
        ours = min((r for r in here if r["impl"].startswith("lessonlib")), key=lambda r: _time(r)[0])
        peers = [r for r in here if not r["impl"].startswith("lessonlib")]
        value, unit = _time(ours)
        where = ", ".join(f"{k}={v}" for k, v in shape.items())
        text = f"{op} ({where}): {ours['impl']} {value:,.4g} {unit}"
        if peers:
            best = min(peers, key=lambda r: _time(r)[0])
            text += f"; fastest peer {best['impl']} {_time(best)[0]:,.4g} {unit}"
        return text
    first = [r for r in records if r["op"] == records[0]["op"] and r["shape"] == records[0]["shape"]]
    shown = []
    for r in first:
        field = next((k for k in FALLBACK if isinstance(r.get(k), (int, float))), None)
        if field:
            shown.append(f"{r['impl']} {r[field]:,.4g} ({field})")
    where = ", ".join(f"{k}={v}" for k, v in records[0]["shape"].items())
    return f"{records[0]['op']} ({where}): " + "; ".join(shown) if shown else f"{len(records)} records"


def command(recorded: str, file: str) -> str:
    """The recorded command as a reader reruns it from the repository's root: a module, writing the committed file
    (the file itself keeps the command exactly as it ran)."""
    words, out = recorded.split(), []
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        if word in ("--out", "--logs"):
            skip = True
            out += ["--out", f"lessonlib/results/{file}"] if word == "--out" else []
            continue
        if word.startswith("benchmarks/") and word.endswith(".py"):
            out += ["-m", word.removesuffix(".py").replace("/", ".")]
            continue
        out.append(word)
    return " ".join(out)


def benchmarks_page() -> str:
    from lessonlib import results

    rows = []
    for path in sorted((ROOT / "lessonlib" / "results").glob("*.json")):
        run = results.load(path)
        env = run.environment
        rows.append(f"| {run.benchmark} | `{command(run.command, path.name)}` | `lessonlib/results/{path.name}` | {env.get('gpu', '-')}, "
                    f"torch {env.get('torch', '-')}, Triton {env.get('triton', '-')}, {env.get('date', '-')[:10]} | "
                    f"{headline(run.records).replace('|', '/')} |")
    return "\n".join([
        "# Benchmarks",
        "",
        "One row per recorded run in `lessonlib/results/`: the command that wrote it (run from the repository's root;",
        "the benchmarks are modules now, `python -m benchmarks.bench_<name>`), the file, where and when it ran, and its",
        "headline: lessonlib's time at the largest shape of its first op beside the fastest other implementation there.",
        "Each benchmark's docstring says what it measures; the lessons plot the files. The experiments that decided the",
        "course's standing choices: [experiments/README.md](experiments/README.md) and [decisions/](decisions/).",
        "",
        "Written by `tools/lab_pages.py` from the results files; `tests/test_lab_pages.py` fails when it is stale.",
        "",
        "| benchmark | command | results file | recorded on | headline |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ])


def experiments_page() -> str:
    rows = []
    for e in EXPERIMENTS:
        script = (f"`benchmarks/experiments/{e.script}.py`" if e.script
                  else f"left main; kept at commit `{e.kept_at}`" if e.kept_at else "-")
        files = ", ".join(f"`results/{name}`" for name in e.results) or "-"
        decision = f"[{e.decision}](../decisions/{e.decision})" if e.decision else "-"
        rows.append(f"| {e.question} | {script} | {files} | {e.verdict} | {decision} |")
    return "\n".join([
        "# Experiments",
        "",
        "Measurements that decided a standing choice (a decision page) or answered a question a lesson asked. Run as",
        "modules from the repository's root: `python -m benchmarks.experiments.<script>`. An experiment whose answer",
        "was \"not adopted\" left main once its decision page was written; its results stay here, and its script",
        f"at the commit named (`git show {REJECTED_AT}:benchmarks/experiments/<script>.py`).",
        "",
        "Written by `tools/lab_pages.py`; `tests/test_lab_pages.py` fails when it is stale.",
        "",
        "| question | script | results | verdict | decision |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ])


def problems() -> list[str]:
    """What is wrong with :data:`EXPERIMENTS` against the files: a script or results file that does not exist, a
    decision page missing, an experiment script on main with no row, a results file no row names."""
    found = []
    folder = ROOT / "benchmarks" / "experiments"
    for e in EXPERIMENTS:
        if e.script and not (folder / f"{e.script}.py").exists():
            found.append(f"{e.script}.py is not in benchmarks/experiments/")
        found += [f"results/{name} does not exist" for name in e.results if not (folder / "results" / name).exists()]
        if e.decision and not (DECISIONS / e.decision).exists():
            found.append(f"decisions/{e.decision} does not exist")
    named = {e.script for e in EXPERIMENTS}
    shared = {"__init__", "gpu_experiment"}  # a package marker, and the start the GPU-only experiments share
    found += [f"{p.name} has no row" for p in folder.glob("*.py") if p.stem not in named | shared]
    listed = {name for e in EXPERIMENTS for name in e.results}
    found += [f"results/{p.name} is in no row" for p in (folder / "results").glob("*.json")
              if p.name not in listed and not cited_elsewhere(p.name)]
    return found


def cited_elsewhere(name: str) -> bool:
    """A results file kept for a lesson or a test rather than an experiment (an earlier run set beside a rerun)."""
    return any(name in p.read_text(errors="ignore") for p in (ROOT / "tests").glob("*.py")) or any(
        name in p.read_text(errors="ignore") for p in (ROOT / "lessonlib").rglob("*.py"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is stale")
    args = parser.parse_args(argv)
    wrong = problems()
    for page, text in ((BENCHMARKS_PAGE, benchmarks_page()), (EXPERIMENTS_PAGE, experiments_page())):
        if args.check:
            if not page.exists() or page.read_text() != text:
                wrong.append(f"{page.name} ({page.parent.name}/) is stale: run python tools/lab_pages.py")
        else:
            page.write_text(text)
    for line in wrong:
        print(f"lab_pages: {line}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
