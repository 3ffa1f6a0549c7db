"""Measuring: time per call, kernel launches per call, and the two ceilings (copy bandwidth, matmul rate).

On the GPU, times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs). On CPU the
kernels run in Triton's interpreter, whose time says nothing about GPU speed: such timings carry the label
"interpreter time" and the notebooks never present them as performance.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from lessonlib import runtime
from lessonlib.results import Ceilings, Impl


@dataclass(frozen=True)
class Timing:
    median_us: float
    on_gpu: bool

    @property
    def label(self) -> str:
        return "GPU time" if self.on_gpu else "interpreter time (CPU, not performance)"

    def __str__(self) -> str:
        return f"{self.median_us:,.1f} µs ({self.label})"


def time_fn(fn, *args, warmup_ms: int = 25, rep_ms: int = 100, cpu_reps: int = 3, **kwargs) -> Timing:
    """Median time of ``fn(*args, **kwargs)``."""
    if runtime.on_gpu():
        import triton.testing

        ms = triton.testing.do_bench(lambda: fn(*args, **kwargs), warmup=warmup_ms, rep=rep_ms, return_mode="median")
        return Timing(ms * 1e3, on_gpu=True)
    fn(*args, **kwargs)  # warm-up, as on the GPU
    samples = []
    for _ in range(cpu_reps):
        start = time.perf_counter()
        fn(*args, **kwargs)
        samples.append(time.perf_counter() - start)
    return Timing(statistics.median(samples) * 1e6, on_gpu=False)


def time_back_to_back(fn, calls: int = 200, samples: int = 5) -> Timing:
    """Time per call when ``calls`` calls run back to back, as a decode loop makes them: launch overhead included
    (the GPU waits for the host whenever the host launches slower than the kernels run). The median of ``samples``
    CUDA-event spans of ``calls`` calls each, no cache flush between calls. On CPU: :func:`time_fn`."""
    if not runtime.on_gpu():
        return time_fn(fn)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    spans = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        spans.append(start.elapsed_time(end) * 1e3 / calls)
    return Timing(statistics.median(spans), on_gpu=True)


def time_graph(fn, *args, reps: int = 200, **kwargs) -> Timing:
    """GPU time of ``fn(*args, **kwargs)`` with the host taken out: the call is captured once into a CUDA graph
    and replayed, the L2 flushed before each replay as in :func:`time_fn`. Where a call's Python costs more than
    its kernels (decode-sized work), :func:`time_fn` measures the host and this measures the GPU; lesson 05 is
    about that difference. ``fn`` must be capturable: no host sync, no CPU tensors created inside."""
    if not runtime.on_gpu():
        raise RuntimeError("time_graph needs a CUDA GPU")
    from lessonlib.cuda_graphs import Graphed

    graphed = Graphed(lambda: fn(*args, **kwargs))
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # larger than the L2, as triton.testing uses
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        graphed.graph.replay()
        end.record()
    torch.cuda.synchronize()
    return Timing(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3, on_gpu=True)


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Keep the GPU busy for a moment so its clocks leave idle before the first timing (an idle H200 reports
    a few hundred MHz, and the first case of a run would be timed while the clocks climb)."""
    if not runtime.on_gpu():
        return
    a = torch.randn(4096, 4096, device="cuda", dtype=runtime.dtype())
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


# Operators that only relabel memory (views), allocate it, or dispatch to another operator: no kernel of their
# own runs on a GPU. The operators they call are counted instead.
_NO_KERNEL = {
    "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::_reshape_alias", "aten::t", "aten::transpose",
    "aten::permute", "aten::expand", "aten::slice", "aten::select", "aten::chunk", "aten::split",
    "aten::split_with_sizes", "aten::unsqueeze", "aten::squeeze", "aten::as_strided", "aten::detach",
    "aten::alias", "aten::narrow", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::result_type", "aten::contiguous", "aten::to",
    "aten::_to_copy", "aten::matmul", "aten::linear", "aten::set_",
}


@dataclass
class LaunchCount:
    total: int
    by_name: Counter = field(default_factory=Counter)
    what: str = ""

    def __str__(self) -> str:
        return f"{self.total} {self.what}"


def count_launches(fn, *args, **kwargs) -> LaunchCount:
    """Kernels launched by one call of ``fn``, read from ``torch.profiler``.

    GPU: the CUDA kernels the profiler records (cuBLAS, PyTorch's and Triton's kernels alike).
    CPU: the outermost operators that launch a kernel on a GPU (views, allocations and dispatchers such as
    ``aten::linear`` are looked through), plus lessonlib's Triton launches, which the interpreter records as
    ``triton::<kernel>`` (the NumPy work inside them is not counted).
    """
    from torch.profiler import ProfilerActivity, profile

    fn(*args, **kwargs)  # warm-up: compilation and autotuning stay out of the count
    on_gpu = runtime.on_gpu()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    prof = profile(activities=activities)
    with _native_stderr_silenced():  # some torch builds print a "USDT: profiler_start" line on each start/stop
        prof.start()
    try:
        fn(*args, **kwargs)
        if on_gpu:
            torch.cuda.synchronize()
    finally:
        with _native_stderr_silenced():
            prof.stop()
    names: Counter = Counter()
    if on_gpu:
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CUDA and not evt.name.startswith(("Memcpy", "Memset")):
                names[evt.name] += 1
        return LaunchCount(sum(names.values()), names, "GPU kernels")

    def visit(evt):
        if evt.name.startswith("triton::") or (evt.name.startswith("aten::") and evt.name not in _NO_KERNEL):
            names[evt.name] += 1
            return
        for child in evt.cpu_children:
            visit(child)

    for evt in prof.events():
        if evt.cpu_parent is None:
            visit(evt)
    return LaunchCount(sum(names.values()), names, "kernel launches (counted on CPU: operators that launch a GPU kernel)")


def gpu_busy_seconds(fn, *args, **kwargs):
    """(``fn(*args, **kwargs)``'s result, the seconds the GPU spent running kernels meanwhile): the sum of the
    kernel durations torch.profiler records (CUDA activity only; kernels replayed from a CUDA graph included).
    Unlike a wall time it leaves out every moment the GPU waited for the host, so a faster kernel shows even where
    the host's time dominates. The seconds are None without a GPU, or where the profiler recorded no kernel.
    The profiler costs the host a little per launch: time the wall clock in a run of its own. Keep one call's
    kernels to tens of thousands: past its buffer limit kineto stops collecting, and the sum comes out short
    (``lessonlib.cases.serving_engine.profiled_gpu_seconds`` profiles a long run in windows)."""
    if not runtime.on_gpu():
        return fn(*args, **kwargs), None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    prof = profile(activities=[ProfilerActivity.CUDA])
    with _native_stderr_silenced():
        prof.start()
    try:
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
    finally:
        with _native_stderr_silenced():
            prof.stop()
    cuda, copies = torch.autograd.DeviceType.CUDA, ("Memcpy", "Memset")
    try:  # the raw kineto events, not prof.events(): building FunctionEvents for a million kernels takes minutes
        total_ns = sum(e.duration_ns() for e in prof.profiler.kineto_results.events()
                       if e.device_type() == cuda and not e.name().startswith(copies))
    except AttributeError:  # a torch whose raw events lack these accessors: the slow, public way
        total_ns = 1000 * sum(e.device_time for e in prof.events()
                              if e.device_type == cuda and not e.name.startswith(copies))
    return out, (total_ns * 1e-9 if total_ns else None)


@contextlib.contextmanager
def _native_stderr_silenced():
    """Point file descriptor 2 (where C++ code writes) at /dev/null; Python's sys.stderr object is untouched."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def measure_ceilings(copy_bytes: int = 2 << 30, matmul_size: int = 8192) -> Ceilings:
    """Measure copy bandwidth and the matmul rate on the current GPU (a few seconds), in the course's dtype there:
    bfloat16, or float16 on a GPU without it (a T4's tensor cores take float16)."""
    import triton.testing

    if not runtime.on_gpu():
        raise RuntimeError("measure_ceilings needs a GPU; on CPU use lessonlib.results.recorded_ceilings()")
    dtype = runtime.dtype()
    src = torch.empty(copy_bytes // 2, dtype=dtype, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    bandwidth = 2 * copy_bytes / (ms * 1e-3) / 1e9
    del src, dst
    a = torch.randn(matmul_size, matmul_size, dtype=dtype, device="cuda")
    b = torch.randn(matmul_size, matmul_size, dtype=dtype, device="cuda")
    ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    tflops = 2 * matmul_size**3 / (ms * 1e-3) / 1e12
    name = str(dtype).removeprefix("torch.")
    return Ceilings(bandwidth, tflops, f"measured live on {runtime.gpu_profile().name}, {name} matmul")


def gbps(nbytes: int, timing: Timing) -> float:
    return nbytes / (timing.median_us * 1e-6) / 1e9


def compare_bandwidth(impls: dict, *args, nbytes: int) -> dict[str, float]:
    """GB/s of each ``impls[name](*args)``, counting ``nbytes`` (the fewest bytes the op must move), plus a plain
    device copy of the same number of bytes: the practical ceiling at this size."""
    out = {name: gbps(nbytes, time_fn(fn, *args)) for name, fn in impls.items()}
    out[Impl.COPY] = gbps(nbytes, time_copy(nbytes))
    return out


def copy_call(nbytes: int):
    """A device-to-device copy that reads nbytes / 2 and writes nbytes / 2, as a call to time: what moving those
    bytes costs at best (the benchmarks' "copy (same bytes)" peer)."""
    src = torch.empty(nbytes // 4, dtype=torch.float16, device=runtime.device()).normal_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def time_copy(nbytes: int) -> Timing:
    """The time of :func:`copy_call`'s copy of ``nbytes``."""
    return time_fn(copy_call(nbytes))
