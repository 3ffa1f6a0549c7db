"""The "predict, then measure" items of lessons 01, 02, 03 and 05 (one module for the four: they share one checker).

In each, the student writes ``my_x(...) -> (predicted, measured)``: ``predicted`` from the bytes-and-launches model
(lessonlib/traffic.py's counting, lesson 05's launch counts), ``measured`` from timings. The checker calls it on
the recorded H200 run's numbers and on three made-up sets (so a typed number does not pass), compares both answers
with its own to 0.1% (rounding), names the usual mistakes, and then sets the prediction beside the recorded
measurement: they must agree within the item's band, whose reason is stated with it. A recorded run outside its band
fails loudly: the lesson's model would no longer explain its own measurement.
"""

from __future__ import annotations

import math
import random
import textwrap
from dataclasses import dataclass
from dataclasses import replace as dataclasses_replace
from typing import Callable

from lessonlib import results, runtime, traffic
from lessonlib.exercises._checking import ExerciseFailed, passed
from lessonlib.results import Impl, Op, Regime


@dataclass(frozen=True)
class Item:
    name: str
    recorded: Callable[[], dict]  # the recorded run's inputs, as the student's function takes them
    made_up: Callable[[random.Random], dict]  # another plausible set of inputs
    predict: Callable[..., float]
    measure: Callable[..., float]
    mistakes: Callable[..., list]  # (explanation, predicted value) of the usual wrong predictions
    band: float  # |measured / predicted - 1| allowed on the recorded run
    why: str  # the band's reason
    unit: str = "x"
    live: Callable[[], dict] | None = None  # on a GPU: the same inputs measured here, now


def _record(benchmark: str, regime: str | None = None, **where) -> dict:
    found = [r for r in results.load(benchmark).select(**where) if r.get("regime") == regime]
    if len(found) != 1:
        raise KeyError(f"{len(found)} records match {where} in {benchmark}")
    return found[0]


def _close(got, want: float) -> bool:
    return isinstance(got, (int, float)) and math.isfinite(got) and abs(got - want) <= 1e-3 * abs(want)


def _unambiguous(item: Item, rng: random.Random, tries: int = 1000) -> dict:
    """A made-up case where the model's answer and every known mistake's lie apart (none within ``_close`` of
    another), so that a wrong answer is named by the one mistake it matches: at some draws two mistakes meet (at
    2,496 tokens in 32 x 64 tiles, "one key tile early" and "half the work" both give about 2)."""
    for _ in range(tries):
        kwargs = item.made_up(rng)
        values = [item.predict(**kwargs)] + [wrong for _, wrong in item.mistakes(**kwargs)]
        if not any(_close(a, b) for i, a in enumerate(values) for b in values[i + 1:]):
            return kwargs
    raise RuntimeError(f"{item.name}: no made-up case in {tries} draws tells its known mistakes apart")


def _check(item: Item, fn) -> None:
    cases = [item.recorded()]
    rng = random.Random()
    cases += [_unambiguous(item, rng) for _ in range(3)]
    live = item.live() if item.live is not None and runtime.on_gpu() else None
    for kwargs in cases + ([live] if live else []):
        try:
            result = fn(**kwargs)
        except NotImplementedError as e:
            raise ExerciseFailed(f"{item.name}: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in "
                                 "the stub.") from None
        except Exception as e:
            raise ExerciseFailed(f"{item.name} raised {type(e).__name__}: {e}") from None
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ExerciseFailed(f"{item.name} returned {result!r}; expected a pair (predicted, measured)")
        predicted, measured = (float(v) if isinstance(v, (int, float)) else v for v in result)
        shown = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in kwargs.items())
        want = item.predict(**kwargs)
        if not _close(predicted, want):
            # The closest matching mistake, not the first: two can lie within 0.1% of each other (at 2,029 tokens
            # in 32 x 64 tiles, "one key tile early" gives 2.002, "half the work" 2.0).
            matches = [(abs(predicted - wrong), explanation) for explanation, wrong in item.mistakes(**kwargs)
                       if _close(predicted, wrong)]
            if matches:
                raise ExerciseFailed(f"{item.name}: predicted {predicted:.4g} for {shown}: that is what "
                                     f"{min(matches)[1]}")
            raise ExerciseFailed(f"{item.name}: predicted {predicted!r} for {shown}; the model gives {want:.4g}")
        want = item.measure(**kwargs)
        if not _close(measured, want):
            hint = " (upside down?)" if isinstance(measured, float) and _close(1 / measured, want) else ""
            raise ExerciseFailed(f"{item.name}: measured {measured!r} for {shown}{hint}; the timings give {want:.4g}")
    predicted, measured = item.predict(**cases[0]), item.measure(**cases[0])
    off = measured / predicted - 1
    # Lines of at most 100 characters: a browser that wraps a longer output line may break it inside a number.
    verdict = (f"{item.name}: predicted {predicted:.3g}{item.unit}, the recorded H200 run measured {measured:.3g}"
               f"{item.unit} ({off:+.0%});\n" + textwrap.fill(f"the band is ±{item.band:.0%}: {item.why}", 98,
                                                              initial_indent="  ", subsequent_indent="  "))
    if abs(off) > item.band:
        raise ExerciseFailed(f"{verdict}.\nYour answers are right, but the recorded run lies outside the band: the "
                             "lesson's model no longer explains it. Tell the instructor.")
    passed("✓ " + verdict)
    if live:  # informative: the band was reasoned for the recorded H200, though the same argument holds here
        predicted, measured = item.predict(**live), item.measure(**live)
        inside = "inside" if abs(measured / predicted - 1) <= item.band else "outside"
        print(f"  on this GPU, measured now: {measured:.3g}{item.unit} against your {predicted:.3g}{item.unit} "
              f"({measured / predicted - 1:+.0%}, {inside} the band)")


# --- 01: swiglu, eager's two kernels against one fused kernel -------------------------------------------------
# The byte ratio alone (5/3) is the same at every shape, and two cells print it: the prediction is instead eager's time
# from this run's fused time plus the bytes fusion removes (the intermediate's round trip) at this run's copy rate.


def _swiglu_recorded() -> dict:
    eager, fused = (_record("fusion-h200", op=Op.SWIGLU, impl=impl, T=8192, I=14336)
                    for impl in (Impl.EAGER, Impl.LESSONLIB))
    copy = _record("fusion-h200", op=Op.COPY, impl=Impl.COPY, T=8192, I=14336)
    return dict(tokens=8192, intermediate=14336, itemsize=2, copy_gbps=copy["gbps"], eager_us=eager["us"],
                fused_us=fused["us"])


def _swiglu_round_trip_us(tokens, intermediate, itemsize, copy_gbps, trips=2):
    """The time ``trips`` passes over one (T, I) tensor take at ``copy_gbps`` (1 GB/s moves 1e3 bytes per µs)."""
    return trips * tokens * intermediate * itemsize / (copy_gbps * 1e3)


def _swiglu_predict(tokens, intermediate, itemsize, copy_gbps, fused_us, **_):
    return 1 + _swiglu_round_trip_us(tokens, intermediate, itemsize, copy_gbps) / fused_us


def _swiglu_mistakes(tokens, intermediate, itemsize, copy_gbps, fused_us, **_):
    trip = _swiglu_round_trip_us(tokens, intermediate, itemsize, copy_gbps, trips=1)
    return [("the byte ratio alone gives, the same at every shape: add the time of the bytes eager moves in addition "
             "(s written and read back) at this run's copy rate to this run's fused time", 5 / 3),
            ("counting the intermediate once gives: s is written by silu and read again by mul, two trips",
             1 + trip / fused_us),
            ("adding all of eager's bytes gives: the fused time already moves gate, up and out; add only the two "
             "trips of s", 1 + 5 * trip / fused_us),
            ("dividing bytes by GB/s gives nanoseconds, not µs: 1 GB/s moves 1e3 bytes per µs",
             1 + 2 * trip * 1e3 / fused_us),
            ("a time in seconds added to one in µs gives: 1 GB/s moves 1e3 bytes per µs",
             1 + 2 * trip * 1e-6 / fused_us),
            ("fused time over eager time gives: the ratio is eager's time divided by the fused time",
             1 / (1 + 2 * trip / fused_us))]


def _swiglu_made_up(rng: random.Random) -> dict:
    tokens, intermediate, itemsize = rng.randint(1, 9000), rng.randint(1, 20000), rng.choice((2, 4))
    copy_gbps = rng.uniform(300, 5000)  # a T4's 320 GB/s to an H200's 4.8 TB/s
    fused_us = 3 * tokens * intermediate * itemsize / (copy_gbps * 1e3) * rng.uniform(0.9, 1.5) + rng.uniform(2, 10)
    return dict(tokens=tokens, intermediate=intermediate, itemsize=itemsize, copy_gbps=copy_gbps,
                eager_us=fused_us * rng.uniform(1.2, 2.5), fused_us=fused_us)


SWIGLU = Item(
    "swiglu_ratio", _swiglu_recorded, _swiglu_made_up, _swiglu_predict,
    lambda eager_us, fused_us, **_: eager_us / fused_us,
    _swiglu_mistakes, 0.10,
    "at T=8192 each chain moves over 200 MB, within 5% of the copy rate; 5% either way moves eager's time over "
    "the fused time by at most 9% from the model")


def _swiglu_live() -> dict:
    """Eager and lessonlib's swiglu, and a copy of the fused kernel's bytes, timed on this GPU at the recorded shape
    (fewer tokens on a small GPU)."""
    import torch

    from lessonlib import ops, reference
    from lessonlib.measure import gbps, time_copy, time_fn

    tokens = runtime.pick(cpu=16, gpu=8192, small_gpu=2048)
    dtype = runtime.dtype()
    gate, up = (torch.randn(tokens, 14336, device=runtime.device(), dtype=dtype) for _ in range(2))
    itemsize = gate.element_size()
    return dict(tokens=tokens, intermediate=14336, itemsize=itemsize,
                copy_gbps=gbps(traffic.swiglu(tokens, 14336, itemsize).fused.bytes, time_copy(
                    traffic.swiglu(tokens, 14336, itemsize).fused.bytes)),
                eager_us=time_fn(reference.swiglu, gate, up).median_us,
                fused_us=time_fn(ops.swiglu, gate, up).median_us)


SWIGLU = dataclasses_replace(SWIGLU, live=_swiglu_live)


def check_swiglu_ratio(fn) -> None:
    """``fn(tokens, intermediate, itemsize, copy_gbps, eager_us, fused_us) -> (predicted, measured)``: eager's time
    over the fused time, predicted as the fused time plus the intermediate's two trips at the copy rate, and measured;
    on a GPU also on a live timing."""
    _check(SWIGLU, fn)


# --- 02: causal attention visits about half the tiles ------------------------------------------------------


def _causal_recorded() -> dict:
    shape = dict(B=2, H=32, N=8192, D=128)
    full, causal = (_record("flash-attention-h200", op=Op.FORWARD, impl=Impl.LESSONLIB, causal=c, **shape)
                    for c in (False, True))
    tiles = results.load("flash-attention-h200").notes["default_configs"]["D=128"]["forward"]
    return dict(tokens=8192, block_m=tiles["BLOCK_M"], block_n=tiles["BLOCK_N"], full_us=full["us"],
                causal_us=causal["us"])


def _tiles(tokens, block_m, block_n, **_):
    """(tiles a full pass visits, tiles a causal pass visits): query tile i stops at the key tile holding its last
    row's diagonal key (Nq = Nkv)."""
    query_tiles, key_tiles = -(-tokens // block_m), -(-tokens // block_n)
    causal = sum(-(-min((i + 1) * block_m, tokens) // block_n) for i in range(query_tiles))
    return query_tiles * key_tiles, causal


def _causal_mistakes(tokens, block_m, block_n, **_):
    full, causal = _tiles(tokens, block_m, block_n)
    short = sum(min((i + 1) * block_m, tokens) // block_n for i in range(-(-tokens // block_m)))
    return [("half the work, ignoring the diagonal tiles, gives: a causal query tile also visits the key tile its "
             "diagonal crosses, whole", 2.0),
            ("causal tiles over full tiles gives: the ratio is full time over causal time", causal / full),
            ("stopping one key tile early (floor instead of ceiling) gives: query tile i visits key tiles up to the "
             "one holding key min((i + 1) * BLOCK_M, N) - 1", full / short if short else math.inf)]


CAUSAL = Item(
    "causal_speedup", _causal_recorded,
    # short ragged sequences, query tiles narrower than key tiles: where a wrong tile count shows by more than 0.1%
    lambda rng: dict(tokens=rng.randint(100, 3000), block_m=rng.choice((16, 32)),
                     block_n=rng.choice((64, 128)), full_us=rng.uniform(50, 9000),
                     causal_us=rng.uniform(50, 9000)),
    lambda **shape: (lambda full, causal: full / causal)(*_tiles(**shape)),
    lambda full_us, causal_us, **_: full_us / causal_us,
    _causal_mistakes, 0.10,
    "at N = 8192 the kernel is compute-bound (over 400 TFLOP/s) and every tile costs about the same, so time "
    "follows tiles; the same kernel timed several times in this run spreads over about 5%")


def check_causal_speedup(fn) -> None:
    """``fn(tokens, block_m, block_n, full_us, causal_us) -> (predicted, measured)``: the tiles a full forward
    visits over the tiles a causal one does (Nq = Nkv = tokens), and the full time over the causal time."""
    _check(CAUSAL, fn)


# --- 03: gather the pages, then SDPA, against paged attention reading the pages in place -----------------------


def _gather_recorded() -> dict:
    shape = dict(B=32, context=4096, H=32, Hkv=8, D=128, block_size=16)
    gather, paged = (_record("paged-attention-h200", op=Op.PAGED_ATTENTION, impl=impl, **shape)
                     for impl in (Impl.GATHER_THEN_SDPA, Impl.LESSONLIB))
    return dict(batch=32, context=4096, heads=32, kv_heads=8, head_dim=128, itemsize=2, gather_us=gather["us"],
                paged_us=paged["us"])


def _gather_bytes(batch, context, heads, kv_heads, head_dim, itemsize, **_):
    kv = 2 * batch * context * kv_heads * head_dim * itemsize  # K and V of every sequence
    q_out = 2 * batch * heads * head_dim * itemsize  # one query per sequence read, one output written
    return kv, q_out


def _gather_mistakes(**shape):
    kv, q_out = _gather_bytes(**shape)
    return [("forgetting the copy's write gives: the gather reads the pages and writes a contiguous copy, which "
             "SDPA then reads: 3 trips over K and V", (2 * kv + q_out) / (kv + q_out)),
            ("counting K and V without q and out gives (close, but not the model): add q's read and out's write",
             3.0),
            ("paged bytes over gathered bytes gives: the ratio is the gather path's bytes over the paged kernel's",
             (kv + q_out) / (3 * kv + q_out))]


GATHER = Item(
    "gather_ratio", _gather_recorded,
    lambda rng: dict(batch=rng.randint(1, 64), context=rng.randint(16, 16384), heads=rng.choice((8, 32)),
                     kv_heads=rng.choice((1, 2, 8)), head_dim=rng.choice((64, 128)), itemsize=rng.choice((2, 4)),
                     gather_us=rng.uniform(20, 900), paged_us=rng.uniform(20, 900)),
    lambda **shape: (lambda kv, q_out: (3 * kv + q_out) / (kv + q_out))(*_gather_bytes(**shape)),
    lambda gather_us, paged_us, **_: gather_us / paged_us,
    _gather_mistakes, 0.15,
    "each of the three passes over the 537 MB of K and V is memory-bound at this size, over 100 µs against a few µs "
    "of launch, and both paths run at 85 to 90% of the copy bandwidth: the time ratio is the byte ratio to about ±15%")


def check_gather_ratio(fn) -> None:
    """``fn(batch, context, heads, kv_heads, head_dim, itemsize, gather_us, paged_us) -> (predicted, measured)``:
    the bytes of "gather the pages, then SDPA" over paged attention's, and the ratio of their recorded times."""
    _check(GATHER, fn)


# --- 05: what a CUDA graph saves the fused decode step at batch 1 ---------------------------------------------


def _graph_recorded() -> dict:
    shape = dict(B=1, context=1024)
    fused, graph = (_record("cuda-graphs-h200", op=Op.DECODE_STEP, impl=impl, **shape)
                    for impl in (Impl.FUSED_STEP, Impl.FUSED_STEP_GRAPH))
    launch = _record("fusion-h200", regime=Regime.PER_CALL, op=Op.LAUNCH_OVERHEAD, impl=Impl.OPS_SWIGLU)
    return dict(launches=fused["launches"], launch_us=launch["us"], fused_us=fused["us"], graph_us=graph["us"])


GRAPH = Item(
    "graph_saving", _graph_recorded,
    lambda rng: dict(launches=rng.randint(2, 800), launch_us=rng.uniform(2, 60), fused_us=rng.uniform(100, 3000),
                     graph_us=rng.uniform(50, 900)),
    lambda launches, launch_us, **_: launches * launch_us,
    lambda fused_us, graph_us, **_: fused_us - graph_us,
    lambda launches, launch_us, fused_us, graph_us: [
        ("one launch's cost alone gives: the graph removes the host's cost of every launch of the step",
         launch_us),
        ("the step's time over the launch cost gives: predict µs saved, launches x µs per launch",
         fused_us / launch_us)],
    0.30,
    "the cost per launch used is one op's (lessonlib.ops.swiglu at T=1); the step's launches include cheaper cuBLAS "
    "GEMMs and lessonlib ops with more arguments (add_rms_norm: 50 µs), about ±30% either way", unit=" µs")


def check_graph_saving(fn) -> None:
    """``fn(launches, launch_us, fused_us, graph_us) -> (predicted, measured)``: the µs a CUDA graph saves the fused
    decode step at batch 1, from its launch count x the host's cost of one launch, and from the recorded times."""
    _check(GRAPH, fn)
