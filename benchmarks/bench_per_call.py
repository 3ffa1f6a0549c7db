"""Issue 27's per-call row: swiglu and add_rms_norm called one at a time from Python, against eager PyTorch.

    python -m benchmarks.bench_per_call --out lessonlib/results/per-call-h200.json

At decode sizes an op's time is its host time: the Python of validation, allocation and Triton's launch. Each op,
bf16, at T=1 and T=128 (hidden 4096, intermediate 14336: bench_fusion.py's shapes), through
  * ``lessonlib.ops.<op>`` with the cached launch (ops/_launcher.py: the compiled kernel's own launcher), and
    from the second call of one signature of inputs its plan (``_plans.Plans``: validation and the launch key
    skipped, the C launch function called with the new tensors' addresses);
  * the same with every launch through Triton's plain ``kernel[grid]`` (``_launcher.plain_launches``);
  * the bare ``kernel[grid](...)`` call, inputs and outputs ready (what Triton's launch alone costs);
  * eager PyTorch: ``F.silu(g) * u``; ``h = x + r`` then ``F.rms_norm(h, (H,), w, eps)``.
Timing: after a sync, ``CALLS`` back-to-back calls timed with ``time.perf_counter`` up to a sync at the end; each
round times every peer in one order, then in the reverse order (A B C D, D C B A), ``ROUNDS`` rounds; the record is
the median of those samples, with their spread. The notes hold each op's ratio to eager (issue 27's target: <= 1.0
for the cached launch), whether the cached launch is on (``_launcher.why_not``) and whether it ran for each case
(``cached_launch_ran``: the checked call launched without Triton's binder; ``planned_call_ran``: it skipped the
op's validation, i.e. took its plan). Both lessonlib paths are checked
against float64 first, and against each other bit for bit. ``--smoke`` runs tiny sizes in any mode (interpreter:
both lessonlib paths are the plain launch there).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time


import torch
import torch.nn.functional as F

from lessonlib import bench, ops, reference, runtime
from lessonlib.measure import warm_up_gpu
from lessonlib.ops import _launcher
from lessonlib.ops._common import pdl_options
from lessonlib.ops.add_rms_norm import _add_rms_norm_kernel, config as add_rms_norm_config
from lessonlib.ops.swiglu import _swiglu_kernel, config as swiglu_config
from lessonlib.results import Benchmark, Impl, Op, Regime
from lessonlib.testing import check_close, to_float64

SIZES, SMOKE_SIZES = (4096, 14336), (256, 384)  # hidden H, intermediate I
TOKENS, SMOKE_TOKENS = (1, 128), (1, 5)
CALLS, SMOKE_CALLS = 1000, 3
ROUNDS, SMOKE_ROUNDS = 5, 1
EPS = 1e-6


def sync():
    if runtime.on_gpu():
        torch.cuda.synchronize()


def per_call_samples(peers: dict, calls: int, rounds: int) -> dict[str, list[float]]:
    """Microseconds per call of each peer: ``rounds`` rounds, each in the peers' order and then in reverse. The
    plain-launch peer runs its whole loop inside ``plain_launches()`` (entered once, not timed per call)."""
    samples = {impl: [] for impl in peers}
    for impl, fn in peers.items():  # warm-up: compilation, the launch cache, the allocator's blocks
        with launch_path(impl):
            fn(), fn()
    for _ in range(rounds):
        for order in (list(peers), list(reversed(peers))):
            for impl in order:
                fn = peers[impl]
                with launch_path(impl):
                    sync()
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    sync()
                samples[impl].append((time.perf_counter() - start) / calls * 1e6)
    return samples


def launch_path(impl):
    return _launcher.plain_launches() if impl == Impl.LESSONLIB_PLAIN_LAUNCH else contextlib.nullcontext()


def swiglu_case(dtype, tokens, intermediate):
    """The peers of swiglu at one T, and the check both lessonlib paths must pass first."""
    gate, up = bench_randn(tokens, intermediate, dtype), bench_randn(tokens, intermediate, dtype)
    out, meta = torch.empty_like(gate), swiglu_config(intermediate)
    grid = (tokens * -(-intermediate // meta["BLOCK"]),)
    peers = {
        Impl.LESSONLIB_CACHED_LAUNCH: lambda: ops.swiglu(gate, up),
        Impl.LESSONLIB_PLAIN_LAUNCH: lambda: ops.swiglu(gate, up),  # timed inside plain_launches()
        # the private kernel on purpose: Triton's launch with nothing of lessonlib around it
        Impl.BARE_LAUNCH: lambda: _swiglu_kernel[grid](gate, up, out, intermediate, intermediate, intermediate,
                                                       intermediate, **meta),
        Impl.EAGER_SILU_MUL: lambda: F.silu(gate) * up,
    }

    def check():
        plain_out, _ = plain_call(lambda: ops.swiglu(gate, up)), ops.swiglu(gate, up)  # the second fills the cache
        (cached, ran), planned = validation_skipped("swiglu", lambda: binder_skipped(
            _swiglu_kernel, lambda: ops.swiglu(gate, up)))
        check_close("swiglu", cached, reference.swiglu(*to_float64(gate, up)), reference.swiglu(gate, up))
        assert torch.equal(cached, plain_out), "swiglu: the cached and the plain launch differ"
        return ran, planned

    return Op.SWIGLU, {"T": tokens, "I": intermediate}, peers, check


def add_rms_norm_case(dtype, tokens, hidden):
    x, res, w = bench_randn(tokens, hidden, dtype), bench_randn(tokens, hidden, dtype), bench_randn(hidden, dtype)
    out, res_out, meta = torch.empty_like(x), torch.empty_like(x), {**add_rms_norm_config(hidden), **pdl_options()}

    def eager():
        h = x + res
        return F.rms_norm(h, (hidden,), w, EPS), h

    peers = {
        Impl.LESSONLIB_CACHED_LAUNCH: lambda: ops.add_rms_norm(x, res, w, EPS),
        Impl.LESSONLIB_PLAIN_LAUNCH: lambda: ops.add_rms_norm(x, res, w, EPS),  # timed inside plain_launches()
        Impl.BARE_LAUNCH: lambda: _add_rms_norm_kernel[(tokens,)](x, res, w, out, res_out, hidden, hidden, hidden,
                                                                  EPS, **meta),
        Impl.EAGER_ADD_F_RMS_NORM: eager,
    }

    def check():
        plain_out, _ = plain_call(lambda: ops.add_rms_norm(x, res, w, EPS)), ops.add_rms_norm(x, res, w, EPS)
        # from the cache filled by the call before
        (cached, ran), planned = validation_skipped("add_rms_norm", lambda: binder_skipped(
            _add_rms_norm_kernel, lambda: ops.add_rms_norm(x, res, w, EPS)))
        want = reference.add_rms_norm(*to_float64(x, res, w), EPS)
        check_close("add_rms_norm", cached[0], want[0], reference.add_rms_norm(x, res, w, EPS)[0])
        assert all(torch.equal(a, b) for a, b in zip(cached, plain_out)), "add_rms_norm: cached and plain launch differ"
        return ran, planned

    return Op.ADD_RMS_NORM, {"T": tokens, "H": hidden}, peers, check


def plain_call(fn):
    with _launcher.plain_launches():
        return fn()


def skipped(target, name: str, fn):
    """``fn()``, and whether it ran without calling ``target.<name>`` (spied on for the call, then put back)."""
    calls, real, own = [], getattr(target, name), name in vars(target)
    setattr(target, name, lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    try:
        return fn(), not calls
    finally:
        if own:
            setattr(target, name, real)
        else:
            delattr(target, name)  # the class's method again


def binder_skipped(kernel, fn):
    """``fn()``, and whether it launched ``kernel`` without Triton's ``JITFunction.run`` (its binder): whether the
    cached launch, not only its switch, ran for the call the cached peer times."""
    return skipped(kernel, "run", fn)


def validation_skipped(op, fn):
    """``fn()``, and whether it ran without the op's validation (``_check``): whether the op took its plan."""
    return skipped(sys.modules[f"lessonlib.ops.{op}"], "_check", fn)


def bench_randn(*shape_and_dtype):
    *shape, dtype = shape_and_dtype
    return torch.randn(*shape, device=runtime.device(), dtype=torch.float32).to(dtype)


EAGER = {Op.SWIGLU: Impl.EAGER_SILU_MUL, Op.ADD_RMS_NORM: Impl.EAGER_ADD_F_RMS_NORM}


def main():
    args = bench.parse_args(__doc__, "bench_per_call.py")
    smoke = args.smoke
    run = bench.Run(Benchmark.PER_CALL, smoke=smoke, check_only=args.check)
    warm_up_gpu()
    hidden, intermediate = SMOKE_SIZES if smoke else SIZES
    calls, rounds = (SMOKE_CALLS, SMOKE_ROUNDS) if smoke else (CALLS, ROUNDS)
    run.notes["cached_launch"] = _launcher.why_not() or "on"
    run.notes["timing"] = (f"{calls} back-to-back calls between syncs, time.perf_counter; {rounds} rounds, each in "
                           "the peers' order then reversed; median and spread of the samples")
    ratios, cached_ran, planned_ran = {}, {}, {}
    with torch.inference_mode():
        for tokens in SMOKE_TOKENS if smoke else TOKENS:
            for op, shape, peers, check in (swiglu_case(run.dtype, tokens, intermediate),
                                            add_rms_norm_case(run.dtype, tokens, hidden)):
                cached_ran[f"{op} T={tokens}"], planned_ran[f"{op} T={tokens}"] = check()
                if run.check_only:
                    continue
                samples = per_call_samples(peers, calls, rounds)
                median = {impl: statistics.median(s) for impl, s in samples.items()}
                for impl, s in samples.items():
                    run.record(op, impl, shape, median[impl], regime=Regime.PER_CALL,
                               samples_us=[round(v, 3) for v in s])
                ratios[f"{op} T={tokens}"] = round(median[Impl.LESSONLIB_CACHED_LAUNCH] / median[EAGER[op]], 3)
    run.notes["cached_over_eager"], run.notes["cached_launch_ran"] = ratios, cached_ran
    run.notes["planned_call_ran"] = planned_ran
    print("cached launch:", run.notes["cached_launch"], "| ran (binder skipped):", cached_ran,
          "| planned (validation skipped):", planned_ran,
          "| lessonlib (cached) / eager per call:", ratios)
    run.save(args.out, {})


if __name__ == "__main__":
    main()
