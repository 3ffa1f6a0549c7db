"""The benchmark harness: each ``benchmarks/bench_*.py`` is a table of :class:`Case` run through a :class:`Run`.

Modelled on ``triton.testing.perf_report`` (a benchmark is data: the cases and the peers, and one runner times
them) and Liger-Kernel's benchmark runner (one record per (op, impl, shape), written to a file the plots read),
with two things the course keeps: every case is checked against a float64 reference *before* anything is timed,
and the file names the GPU, the versions, the date, the command and the ceilings it ran under.

    run = bench.Run(Benchmark.PAGED_ATTENTION, smoke=args.smoke)
    run.cases([bench.Case(Op.STORE_KV, shape, {Impl.LESSONLIB: lambda: ops.store_kv(...)}, check=..., nbytes=...)])
    run.save(args.out, ceilings)

Labels come from :mod:`lessonlib.results`; a record with an undeclared op or impl fails at once, not at plot time.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from lessonlib import runtime
from lessonlib.measure import time_fn, time_graph
from lessonlib.results import Ceilings, Results, check_labels, environment


@dataclass
class Case:
    """One op at one shape: ``check`` first (it raises when lessonlib's output is wrong), then every peer timed."""

    op: str
    shape: dict
    peers: dict[str, Callable[[], object]]  # impl -> the call, its inputs bound
    check: Callable[[], None] | None = None
    nbytes: int | None = None  # the fewest bytes the op must move: records gain "gbps"
    flops: float | None = None  # records gain "tflops"
    fields: dict = field(default_factory=dict)  # stored in every record of the case (e.g. regime)
    may_fail: tuple[str, ...] = ()  # peers whose failure (out of memory, a backend refusing a shape) is recorded
    graphed: tuple[str, ...] | None = None  # peers also timed replayed from a CUDA graph (others: graph_us None)


def parse_args(doc: str, script: str, checkable: bool = True, flags: dict[str, str] | None = None,
               values: dict[str, tuple[object, str]] | None = None) -> argparse.Namespace:
    """``--out FILE``; ``--smoke`` (tiny sizes, any mode: tests the script); ``--check`` (``--smoke``'s cases
    checked against float64, nothing timed or written). Without a GPU only ``--smoke`` and ``--check`` run.
    ``flags``: the script's own on/off switches, {"--name": "help"}; ``values``: its own settings,
    {"--name": (default, "help")}, typed as their default (None: a str)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="results file to write (JSON)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any mode: tests this script")
    for flag, text in (flags or {}).items():
        parser.add_argument(flag, action="store_true", help=text)
    for flag, (default, text) in (values or {}).items():
        parser.add_argument(flag, type=str if default is None else type(default), default=default, help=text)
    if checkable:
        parser.add_argument("--check", action="store_true",
                            help="only the correctness checks, at --smoke's sizes: nothing timed, no file written")
    args = parser.parse_args()
    args.check = checkable and args.check
    args.smoke = args.smoke or args.check
    if args.out is None and not args.check:
        parser.error("--out is required (except with --check)")
    if not args.smoke and not runtime.on_gpu():
        sys.exit(f"{script} needs a GPU (use --smoke or --check to test the script on CPU)")
    return args


def _error(error: BaseException) -> str:
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first}"[:300]


def command_line() -> str:
    """The command that started this process, as a reader retypes it from the repository's root:
    ``python -m benchmarks.bench_fusion --out FILE`` (run as a module), else ``python SCRIPT ARGS``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    start = ["-m", spec.name] if spec is not None else sys.argv[:1]
    return " ".join(["python", *start, *sys.argv[1:]])


class Run:
    """One benchmark run: its records and notes, a progress line per record, and the file with its provenance."""

    def __init__(self, benchmark: str, smoke: bool = False, dtype: torch.dtype | None = None,
                 check_only: bool = False):
        self.benchmark, self.smoke, self.check_only = benchmark, smoke, check_only
        self.dtype = dtype or runtime.dtype()  # bfloat16 where the GPU has it, float16 on a T4 and the interpreter
        self.records: list[dict] = []
        self.notes: dict = {}
        self.command = command_line()

    def add(self, op: str, impl: str, shape: dict, **fields) -> dict:
        """Store one record (its labels checked against lessonlib.results) and print its progress line."""
        rec = {"op": op, "impl": impl, "shape": shape, "dtype": str(self.dtype).removeprefix("torch."), **fields}
        check_labels([rec], f"{self.benchmark} benchmark")
        self.records.append(rec)
        us = fields.get("us")
        time = f"{us:10.2f} us" if us is not None else "-" if "us" in fields else ""
        rate = (f"{rec['gbps']:8.0f} GB/s" if "gbps" in rec else f"{rec['tflops']:8.1f} TFLOP/s" if "tflops" in rec
                else "")
        rest = {k: v for k, v in fields.items() if k not in ("us", "bytes", "gbps", "tflops")}
        print(f"[{len(self.records):4d}] {op:16s} {impl:40s} {str(shape):56s} {time} {rate} {rest or ''}", flush=True)
        return rec

    def record(self, op: str, impl: str, shape: dict, us: float | None, nbytes: int | None = None,
               flops: float | None = None, **fields) -> dict:
        """Store one timing (``us`` None: it failed, ``error`` says why), with GB/s from ``nbytes`` and TFLOP/s
        from ``flops``."""
        timed = {"us": None if us is None else round(us, 3)}
        if nbytes is not None and us is not None:
            timed["bytes"], timed["gbps"] = nbytes, round(nbytes / (us * 1e-6) / 1e9, 1)
        if flops is not None and us is not None:
            timed["tflops"] = float(f"{flops / (us * 1e-6) / 1e12:.4g}")
        return self.add(op, impl, shape, **timed, **fields)

    def measure(self, op: str, impl: str, shape: dict, fn, nbytes: int | None = None, flops: float | None = None,
                timer=time_fn, may_fail: bool = False, graph: bool | None = None, **fields) -> dict:
        """Time ``fn()`` with ``timer`` and record it; with ``may_fail``, a failure is recorded with its error.
        ``graph`` True: also the GPU time alone, replayed from a CUDA graph (``graph_us``, ``graph_gbps``); False:
        those fields are None (the call cannot be captured), None: no such fields."""
        try:
            us = timer(fn).median_us
            if graph is not None:
                graph_us = time_graph(fn).median_us if graph and runtime.on_gpu() else None
                fields = {"graph_us": None if graph_us is None else round(graph_us, 3),
                          "graph_gbps": None if graph_us is None else round(nbytes / (graph_us * 1e-6) / 1e9, 1),
                          **fields}
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not may_fail:
                raise
            if runtime.on_gpu():
                torch.cuda.empty_cache()
            return self.record(op, impl, shape, None, error=_error(error), **fields)
        return self.record(op, impl, shape, us, nbytes, flops, **fields)

    def cases(self, cases, timer=time_fn) -> None:
        """Each case: its check, then each peer timed (not with ``check_only``: the labels alone are checked)."""
        for case in cases:
            if case.check is not None:
                case.check()
            if self.check_only:
                check_labels([{"op": case.op, "impl": impl} for impl in case.peers], f"{self.benchmark} benchmark")
                print(f"checked {case.op} {case.shape}: {', '.join(case.peers)}", flush=True)
                continue
            for impl, fn in case.peers.items():
                graph = None if case.graphed is None else impl in case.graphed
                self.measure(case.op, impl, case.shape, fn, case.nbytes, case.flops, timer,
                             may_fail=impl in case.may_fail, graph=graph, **case.fields)

    def save(self, path, ceilings: Ceilings | dict, environment_extra: dict | None = None) -> Path | None:
        """Write the results file: the records, the notes, and the run's provenance (with ``check_only``: nothing)."""
        if self.check_only:
            print(f"{self.benchmark}: every case checked; nothing timed, no file written")
            return None
        if isinstance(ceilings, Ceilings):
            ceilings = {"bandwidth_gbs": round(ceilings.bandwidth_gbs, 1),
                        "matmul_tflops": round(ceilings.matmul_tflops, 1)}
        results = Results(self.benchmark, self.command, {**environment(), **(environment_extra or {})}, ceilings,
                          self.records, self.notes)
        written = results.save(path)
        print("wrote", written)
        return written

