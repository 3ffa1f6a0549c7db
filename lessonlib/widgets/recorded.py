"""Lessons 02-05's recorded H200 run beside the student's own GPU: pick a case (op and shape) and the
implementations, see the recorded numbers, and on a GPU tick "measure on this GPU" to time the same case here.

One view, four lessons: a :class:`RecordedRun` says which records of a committed file are cases, which
implementations and fields it shows, and how to time a case live (:mod:`lessonlib.cases`: the benchmark's own
inputs, peers and float64 check, run through :class:`lessonlib.bench.Run`, so a live record has the recorded one's
fields). Lesson 01's view (:func:`lessonlib.widgets.recorded_vs_live_explorer`) draws GB/s against its copy
ceiling instead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable

import torch

from lessonlib import plots, results, runtime
from lessonlib.plots._figure import shape_text
from lessonlib.plots.fusion import gpu_name
from lessonlib.plots.recorded import FIELD_LABELS, SPEEDUP
from lessonlib.results import Benchmark, Impl, Op, Unit, is_sweep

NO_GPU = ("measure on this GPU: skipped, there is no GPU here (Triton's interpreter times Python loops, which says "
          "nothing about a GPU kernel)")
# Why a peer has no CUDA-graph time: the benchmarks leave out of the graph what cannot be captured in one.
_HOST_SYNC = "wait for the GPU (a host sync), which a CUDA graph cannot hold"
NOT_CAPTURED = {Impl.TABLES_VALIDATED: f"its table checks {_HOST_SYNC}",
                Impl.SLOTS_VALIDATED: f"its slot checks {_HOST_SYNC}"}


@dataclass(frozen=True)
class RecordedRun:
    """Which records of a committed run a lesson's view shows, and how it times one of its cases live."""

    name: str  # the committed results file, e.g. "flash-attention-h200"
    ops: tuple[str, ...]
    impls: tuple[str, ...]  # in the order drawn; the first is lessonlib's
    fields: tuple[str, ...]  # record fields shown, one panel each (SPEEDUP: time of ``baseline`` / time)
    live: Callable[[str, dict], list[dict]]  # records measured on this GPU at (op, shape)
    small_gpu: Callable[[dict], dict] | None = None  # the shape measured on a card of 24 GB or less, where the
    # recorded one does not fit it (runtime.pick's small_gpu)
    baseline: str | None = None

    def shown(self, record: dict) -> bool:
        """A named implementation's plain timing: not a sweep point, not the per-call regime."""
        return record["impl"] in self.impls and not is_sweep(record["impl"]) and "regime" not in record

    def cases(self, recorded: results.Results) -> dict[str, tuple[str, dict]]:
        """Every (op, shape) at which the run timed the view's implementations, by a label such as
        "forward, B=2, H=32, N=4096, D=128, causal=False"."""
        found = {}
        for rec in recorded.records:
            if rec["op"] in self.ops and self.shown(rec):
                found[f"{rec['op']}, {shape_text(rec['shape'])}"] = (rec["op"], rec["shape"])
        return found

    def _by_impl(self, records: list[dict], op: str, shape: dict) -> dict[str, dict]:
        return {r["impl"]: r for r in records if r["op"] == op and r["shape"] == shape and self.shown(r)}

    def values(self, records: list[dict], op: str, shape: dict) -> dict[str, dict]:
        """{impl: {field: value}} of ``records`` at (op, shape); a failed record's value is None."""
        by_impl = self._by_impl(records, op, shape)
        base = by_impl.get(self.baseline, {}).get(Unit.US)
        out = {}
        for impl in self.impls:
            if impl in by_impl:
                rec = by_impl[impl]
                out[impl] = {f: (base / rec[Unit.US] if base and rec.get(Unit.US) else None) if f == SPEEDUP
                             else rec.get(f) for f in self.fields}
        return out

    def missing(self, records: list[dict], op: str, shape: dict) -> dict[str, dict[str, str]]:
        """{impl: {field: why}} for each value :meth:`values` gives as None: the error a failed peer recorded, or
        why the field was never timed."""
        by_impl = self._by_impl(records, op, shape)
        out = {}
        for impl, got in self.values(records, op, shape).items():
            rec = by_impl[impl]
            for field, value in got.items():
                if value is not None:
                    continue
                if rec.get("error"):
                    why = f"failed: {rec['error']}"
                elif field == SPEEDUP:
                    why = f"no {self.baseline} time at this shape to compare with"
                elif field == Unit.GRAPH_GBPS and rec.get(Unit.US) is not None:
                    why = "not timed: " + NOT_CAPTURED.get(impl, "the benchmark does not capture it in a CUDA graph")
                else:
                    why = "not recorded in this run"
                out.setdefault(impl, {})[field] = why
        return out

    def live_shape(self, shape: dict) -> dict:
        return runtime.pick(cpu=shape, gpu=shape, small_gpu=self.small_gpu(shape) if self.small_gpu else None)


def _run(benchmark: str, cases_of, grad: bool = False) -> list[dict]:
    """Records of ``cases_of(run)`` timed through bench.Run by lessonlib.measure, every case's check passed before
    anything is timed (the benchmark checks each case just before its own timings)."""
    from lessonlib import bench, measure

    run = bench.Run(benchmark)
    with contextlib.nullcontext() if grad else torch.inference_mode():
        cases = list(cases_of(run))
        for case in cases:
            if case.check is not None:
                case.check()
        run.cases([replace(case, check=None) for case in cases], timer=measure.time_fn)
    return run.records


def _live_flash_attention(op: str, shape: dict) -> list[dict]:
    from lessonlib.cases import flash_attention as fa

    case = (shape["B"], shape["H"], shape["N"], shape["D"], shape["causal"])
    return _run(Benchmark.FLASH_ATTENTION, lambda run: fa.speed_cases(run, [case], fa.peers()), grad=True)


def _live_paged_attention(op: str, shape: dict) -> list[dict]:
    from lessonlib.cases.paged_attention import decode_case, rope_store_kv_case

    if op == Op.ROPE_STORE_KV:
        keys = ("T", "H", "Hkv", "D", "block_size")
        return _run(Benchmark.PAGED_ATTENTION, lambda run: [rope_store_kv_case(*(shape[k] for k in keys), run.dtype)])
    keys = ("B", "context", "H", "Hkv", "D", "block_size")
    return _run(Benchmark.PAGED_ATTENTION, lambda run: [decode_case(*(shape[k] for k in keys), run.dtype)[0]])


def _live_torch_compile(op: str, shape: dict) -> list[dict]:
    from lessonlib.cases.torch_compile import compile_case

    return _run(Benchmark.FUSION, lambda run: [compile_case(op, shape)])


def _live_decode_step(op: str, shape: dict) -> list[dict]:
    from lessonlib.cases.cuda_graphs import LAYER_INTERMEDIATE, decode_step_cases
    from lessonlib.decoder import DecoderLayer

    heads = (shape["heads"], shape["kv_heads"], shape["D"])

    def cases(run):
        layer = DecoderLayer(shape["H"], *heads, LAYER_INTERMEDIATE[shape["H"]], device=runtime.device(),
                             dtype=run.dtype)
        return decode_step_cases(run, layer, shape["H"], heads, [(shape["B"], shape["context"])])

    return _run(Benchmark.CUDA_GRAPHS, cases)


LESSONS = {
    # Naive attention's score matrix at N=16384 is 17 GB: a small card measures one sequence of at most 4096.
    "flash_attention": RecordedRun(
        "flash-attention-h200", (Op.FORWARD, Op.BACKWARD),
        (Impl.LESSONLIB, Impl.NAIVE, Impl.SDPA_FLASH, Impl.SDPA_CUDNN, Impl.SDPA_EFFICIENT), (Unit.TFLOPS,),
        _live_flash_attention, small_gpu=lambda s: {**s, "B": 1, "N": min(s["N"], 4096)}),
    # Decode attention, and RoPE fused with the cache write (the engine's rope_store_kv) against what it replaces.
    "paged_attention": RecordedRun(
        "paged-attention-h200", (Op.PAGED_ATTENTION, Op.ROPE_STORE_KV),
        (Impl.LESSONLIB, Impl.TABLES_VALIDATED, Impl.SDPA_CONTIGUOUS, Impl.GATHER_THEN_SDPA, Impl.FLEX_PAGED,
         Impl.APPLY_ROPE_THEN_STORE_KV, Impl.COPIES_APPLY_ROPE_STORE_KV, Impl.EAGER, Impl.COPY),
        (Unit.GBPS, Unit.GRAPH_GBPS), _live_paged_attention),
    "torch_compile": RecordedRun(
        "fusion-h200", (Op.SWIGLU, Op.ADD_RMS_NORM, Op.APPLY_ROPE, Op.GATED_MLP),
        (Impl.LESSONLIB, Impl.FUSED_GATED_MLP, Impl.EAGER, Impl.COMPILE), (Unit.US, SPEEDUP),
        _live_torch_compile, baseline=Impl.EAGER),
    "cuda_graphs": RecordedRun(
        "cuda-graphs-h200", (Op.DECODE_STEP,), (Impl.FUSED_STEP, Impl.FUSED_STEP_GRAPH, Impl.EAGER_STEP),
        (Unit.US, "launches"), _live_decode_step),
}


def show_recorded_run(lesson: RecordedRun, recorded: results.Results, case: str, impls=(), measure_here=False,
                      live_cache: dict | None = None) -> dict:
    """One case of a lesson's recorded run: the chosen implementations' recorded numbers, and with
    ``measure_here`` on a GPU the same case measured here (kept in ``live_cache``, so coming back to a case does not
    measure it again) beside them. Returns what is shown."""
    op, shape = lesson.cases(recorded)[case]
    impls = [i for i in lesson.impls if i in impls]
    shown = {"op": op, "shape": shape, "impls": impls, "live": None, "live_shape": None, "skipped": None}
    shown["recorded"] = {i: v for i, v in lesson.values(recorded.records, op, shape).items() if i in impls}
    missing = {"recorded": lesson.missing(recorded.records, op, shape)}
    if measure_here and not runtime.on_gpu():
        shown["skipped"] = NO_GPU
    elif measure_here:
        live_shape = shown["live_shape"] = lesson.live_shape(shape)
        cache = live_cache if live_cache is not None else {}
        if case not in cache:
            cache[case] = lesson.live(op, live_shape)
        shown["live"] = {i: v for i, v in lesson.values(cache[case], op, live_shape).items() if i in impls}
        missing["live"] = lesson.missing(cache[case], op, live_shape)
    shown["missing"] = {source: {i: why for i, why in reasons.items() if i in impls}
                        for source, reasons in missing.items()}
    _print_shown(lesson, recorded, shown)
    plots.recorded_vs_live(shown["recorded"], shown["live"], lesson.fields, f"{op}, {shape_text(shape)}",
                           recorded.environment["gpu"], recorded.provenance(), shown["missing"])
    return shown


def _print_shown(lesson: RecordedRun, recorded: results.Results, shown: dict) -> None:
    here = gpu_name()
    width = max(map(len, shown["impls"]), default=0)
    for impl in shown["impls"]:
        if impl not in shown["recorded"] and impl not in (shown["live"] or {}):
            continue  # not an implementation of this op (the GatedMLP's lessonlib is its own)
        parts = []
        for source, key in ((recorded.environment["gpu"], "recorded"), (here, "live")):
            values, why = shown[key], shown["missing"].get(key, {}).get(impl, {})
            if values is None:
                continue
            got = values.get(impl)
            if not got:
                parts.append(f"{source}: not timed")
            elif all(v is None for v in got.values()) and len(set(why.values())) == 1:  # one reason for them all
                parts.append(f"{source}: {next(iter(why.values()))}")
            else:
                parts.append(f"{source}: " + ", ".join(_number(f, got[f], why.get(f)) for f in lesson.fields))
        print(f"{impl:{width}s} " + " | ".join(parts))
    if shown["skipped"]:
        print(shown["skipped"])
    if shown["live_shape"] is not None and shown["live_shape"] != shown["shape"]:
        print(f"measured here at {shape_text(shown['live_shape'])}: the recorded shape does not fit this "
              f"GPU's memory (runtime.pick's smaller size), so compare rates, not times")


def _number(field: str, value, why: str | None = None) -> str:
    if value is None:
        return f"{FIELD_LABELS[field]}: {why or 'not recorded'}"
    if field == SPEEDUP:
        return f"{value:,.2f}x"
    return f"{value:,} {FIELD_LABELS[field]}" if isinstance(value, int) else f"{value:,.1f} {FIELD_LABELS[field]}"


def recorded_run_explorer(lesson: str, recorded: results.Results | None = None, case: str | None = None):
    """The view of ``lesson``'s recorded run ("flash_attention", "paged_attention", "torch_compile",
    "cuda_graphs"): a case, the implementations shown, and "measure on this GPU"."""
    import ipywidgets as w

    from lessonlib.widgets.view import FigureView

    spec = LESSONS[lesson]
    recorded = recorded if recorded is not None else results.load(spec.name)
    options = list(spec.cases(recorded))
    present = [i for i in spec.impls if any(r["impl"] == i for r in recorded.records)]
    # Labels 130 px wide (ipywidgets' default, 80 px, cut "implementations" to "implemen..."), the list wide
    # enough for the longest implementation's name.
    style = {"description_width": "130px"}
    controls = {"case": w.Dropdown(options=options, value=case or options[0], description="case", style=style,
                                   layout=w.Layout(width="700px")),
                "impls": w.SelectMultiple(options=present, value=tuple(present), description="implementations",
                                          rows=len(present), style=style, layout=w.Layout(width="520px")),
                "measure_here": w.Checkbox(value=False, description="measure on this GPU", style=style)}
    return FigureView(show_recorded_run, controls, {"lesson": spec, "recorded": recorded, "live_cache": {}})
