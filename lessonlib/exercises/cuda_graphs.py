"""Lesson 05's checkers (notebook 05_cuda_graphs): refreshing a captured graph's static inputs, and a decode step
made graph-safe (kernel exercise 4).
"""

from __future__ import annotations

import torch

from lessonlib import reference, runtime
from lessonlib.exercises._checking import ExerciseFailed, passed
from lessonlib.testing import check_close


def check_refresh_static_inputs(fn) -> None:
    """``fn(static, new) -> None``: before a CUDA-graph replay, put the values of the tensors in ``new`` (a dict of
    name -> tensor) into the graph's ``static`` tensors (same names, shapes, dtypes), in place. A replay reads the
    addresses recorded at capture: rebinding a name to a new tensor, or replacing it in the dict, changes nothing
    the graph will see."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for trial in range(5):
        shapes = {"hidden": (3, 8), "slots": (3,), "block_table": (3, 4), "seq_lens": (3,)}
        static = {name: torch.zeros(shape) for name, shape in shapes.items()}
        addresses = {name: t.data_ptr() for name, t in static.items()}
        originals = dict(static)
        new = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
        try:
            result = fn(static, new)
        except NotImplementedError as e:
            raise ExerciseFailed(f"refresh_static_inputs: not implemented yet ({str(e) or 'NotImplementedError'}). "
                                 "Fill in the stub.") from None
        for name in shapes:
            if static[name] is not originals[name] or static[name].data_ptr() != addresses[name]:
                raise ExerciseFailed(f"refresh_static_inputs: static[{name!r}] is a different tensor now; the graph "
                                     "still reads the old one. Copy into it in place (Tensor.copy_).")
            if not torch.equal(originals[name], new[name]):
                raise ExerciseFailed(f"refresh_static_inputs: static[{name!r}] does not hold the new values")
        if result is not None:
            raise ExerciseFailed("refresh_static_inputs: work in place and return None")
    passed("refresh_static_inputs: new values in the captured tensors, every address unchanged")


# --- 4. A decode step made graph-safe (notebook 05) ---------------------------------------------------------------


def eager_decode_step(q, k_new, v_new, k_cache, v_cache, lengths):
    """One step of decode attention over a per-sequence KV cache of fixed capacity, written the
    eager way; it works, and a CUDA graph cannot capture it.

    q: (B, H, D), each sequence's new query; k_new, v_new: (B, Hkv, D), its new key and value;
    k_cache, v_cache: (B, Hkv, capacity, D); lengths: (B,) int64, tokens cached per sequence. Writes
    the new K, V at position lengths[b], attends over positions 0 ... lengths[b], advances lengths
    by one. Returns (B, H, D)."""
    outs = []
    for b in range(q.shape[0]):
        n = int(lengths[b])  # the CPU reads a value the GPU computed: a host sync
        k_cache[b, :, n] = k_new[b]
        v_cache[b, :, n] = v_new[b]
        # a shape that changes every step
        k, v = k_cache[b:b + 1, :, : n + 1], v_cache[b:b + 1, :, : n + 1]
        outs.append(reference.attention(q[b:b + 1, :, None], k, v)[:, :, 0])
    lengths += 1
    return torch.cat(outs)  # a new tensor every call


def _op_signature(args, kwargs):
    """What a CUDA graph fixes about one op: the shapes, dtypes and devices of its tensors, and every other argument."""
    from torch.utils._pytree import tree_map

    def describe(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), str(a.dtype).removeprefix("torch."))
        return a if isinstance(a, (int, float, bool, str, type(None))) else repr(a)

    return tree_map(describe, (args, kwargs))


def _trace_ops(fn, *args):
    """Run ``fn(*args)``; return its result and the list of (op, signature) it dispatched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Trace(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            self.ops.append((str(func), _op_signature(args, kwargs)))
            return func(*args, **kwargs)

    with Trace() as trace:
        result = fn(*args)
    return result, trace.ops


def _line_in(fn, traceback_) -> str:
    """The last line of ``fn``'s own source that the traceback passes through (where the student's step did it)."""
    import linecache
    import traceback

    code = getattr(fn, "__code__", None)
    lines = [frame for frame in traceback.extract_tb(traceback_) if code and frame.filename == code.co_filename]
    if not lines:
        return ""
    frame = lines[-1]
    text = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    return f" (line {frame.lineno - code.co_firstlineno + 1} of your function: `{text}`)"


def _check_no_host_read(name: str, fn, args) -> None:
    """Run ``fn`` on fake tensors, which have shapes and dtypes but no values: any read of a value by Python (a host
    sync on a GPU: .item(), int(), bool(), .tolist(), a Python `if` on a tensor, a shape that depends on values),
    and any tensor built from Python data inside the step (a host-to-device copy on a GPU), is refused."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode)
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoHostData(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.lift_fresh.default:
                raise _HostData()
            return func(*args, **(kwargs or {}))

    mode = FakeTensorMode()
    fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    try:
        with mode, NoHostData():
            fn(*fake)
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise ExerciseFailed(
            f"{name}: your step reads a tensor's value on the CPU{_line_in(fn, e.__traceback__)}. On a GPU that is a "
            "host sync: during capture no value is computed yet, and capture fails. Keep values on the device: "
            "index with the lengths tensor itself (advanced indexing, scatter, torch.where, a mask) instead of a "
            "Python int made from it.") from None
    except _HostData as e:
        raise ExerciseFailed(
            f"{name}: your step builds a tensor from Python data{_line_in(fn, e.__traceback__)} (torch.tensor(...)). "
            "On a GPU that is a copy from host memory, refused during capture: build it once, outside the step, or "
            "derive it on the device (torch.arange(..., device=...)).") from None
    except RuntimeError as e:
        if "numpy" in str(e):
            raise ExerciseFailed(f"{name}: your step reads a tensor's values on the CPU{_line_in(fn, e.__traceback__)}"
                                 " (.numpy()): a host sync on a GPU") from None
        raise


class _HostData(Exception):
    pass


GRAPH_SAFE_STEPS = 4  # steps checked: enough for every sequence's length and the cache's contents to move


def _graph_safe_problem(dtype, device):
    batch, heads, kv_heads, head_dim, capacity = 3, 4, 2, 16, 12
    # Ragged lengths; the longest stays inside the capacity for the GPU check's GRAPH_SAFE_STEPS + 2 steps (one eager,
    # then replays): a position past the capacity would be an out-of-bounds write on the device.
    lengths = torch.tensor([0, 5, capacity - GRAPH_SAFE_STEPS - 2], dtype=torch.int64, device=device)
    k_cache, v_cache = (torch.randn(batch, kv_heads, capacity, head_dim, device=device).to(dtype) for _ in range(2))
    new_inputs = [[torch.randn(shape, device=device).to(dtype)
                   for shape in ((batch, heads, head_dim), (batch, kv_heads, head_dim), (batch, kv_heads, head_dim))]
                  for _ in range(GRAPH_SAFE_STEPS + 3)]
    return k_cache, v_cache, lengths, new_inputs


def check_graph_safe_decode_step(fn) -> None:
    """``fn(q, k_new, v_new, k_cache, v_cache, lengths, out) -> out``: what :func:`eager_decode_step` computes, with
    the step's result written into the static tensor ``out``, and nothing a CUDA graph cannot capture.

    Everywhere: values against the eager step (float64 and the dtype's own) over several steps with ragged lengths;
    ``out`` returned, the same tensor each call; no value read by Python and no tensor built from Python data (run
    on fake tensors, which have no values); the same operations with the same shapes and arguments on every call
    (what a graph replays). On a GPU also: no synchronising CUDA call (torch.cuda.set_sync_debug_mode("error")),
    then the step captured into a CUDA graph and replayed step after step, each replay checked.
    Not proven on a CPU: that CUDA accepts the capture (an op whose GPU implementation syncs internally would pass
    here), and that a replay is faster."""
    device = runtime.device()
    for dtype in runtime.supported_dtypes():
        k_cache, v_cache, lengths, new_inputs = _graph_safe_problem(dtype, device)
        static = [t.clone() for t in new_inputs[0]]  # the step's input buffers, refreshed in place, as a graph's
        out = torch.empty_like(static[0]).fill_(float("nan"))
        eager = [k_cache.clone(), v_cache.clone(), lengths.clone()]  # the eager step's own state, in dtype
        eager64 = [k_cache.double(), v_cache.double(), lengths.clone()]  # and in float64: the truth
        state = (k_cache, v_cache, lengths, out)
        traces = []
        for step in range(GRAPH_SAFE_STEPS):
            for buffer, new in zip(static, new_inputs[step]):
                buffer.copy_(new)
            want_low = eager_decode_step(*new_inputs[step], *eager)
            want = eager_decode_step(*(t.double() for t in new_inputs[step]), *eager64)
            try:
                result, ops = _trace_ops(fn, *static, *state)
            except NotImplementedError as e:
                raise ExerciseFailed(f"graph_safe_decode_step: not implemented yet ({str(e) or 'NotImplementedError'}). "
                                     "Fill in the stub.") from None
            except Exception as e:
                raise ExerciseFailed(f"graph_safe_decode_step raised {type(e).__name__} at step {step + 1}"
                                     f"{_line_in(fn, e.__traceback__)}: {e}") from e
            if result is not out:
                raise ExerciseFailed(
                    "graph_safe_decode_step returned " + ("None" if result is None else "a new tensor") + ", not `out`. "
                    "A replayed graph writes its result at the address captured: write into out (out.copy_(...), or "
                    "an out= argument) and return out.")
            label = f"step {step + 1} of {GRAPH_SAFE_STEPS} (lengths before it: {(eager[2] - 1).tolist()}), {str(dtype).removeprefix('torch.')}"
            if not torch.equal(lengths, eager[2]):
                raise ExerciseFailed(f"graph_safe_decode_step: after {label}, lengths = {lengths.tolist()}, expected "
                                     f"{eager[2].tolist()}: advance it in place (lengths += 1), so the next replay sees it")
            for cache, want_cache, what in ((k_cache, eager[0], "k_cache"), (v_cache, eager[1], "v_cache")):
                if not torch.equal(cache, want_cache):
                    b, h, position, _ = (int(i) for i in (cache != want_cache).nonzero()[0])
                    raise ExerciseFailed(f"graph_safe_decode_step: after {label}, {what}[{b}, {h}, {position}] differs "
                                         "from the eager step's: the new K and V go to position lengths[b] of sequence b")
            try:
                check_close("graph_safe_decode_step", out, want, want_low)
            except AssertionError as e:
                raise ExerciseFailed(f"{e}\n  after {label}. Each sequence sees positions 0 ... lengths[b] (the new "
                                     "token included), no more.") from None
            if step == 0:
                _check_no_host_read("graph_safe_decode_step", fn, (*static, *state))
            traces.append(ops)
            if ops != traces[0]:
                index = next((i for i, (a, b) in enumerate(zip(traces[0], ops)) if a != b), min(len(ops), len(traces[0])))
                first = traces[0][index][0] if index < len(traces[0]) else "nothing"
                now = ops[index][0] if index < len(ops) else "nothing"
                raise ExerciseFailed(
                    f"graph_safe_decode_step: step {step + 1} ran other operations than step 1 (op #{index + 1}: "
                    f"{now} where step 1 ran {first}, {len(ops)} ops against {len(traces[0])}). A graph replays step "
                    "1's operations, with step 1's shapes and arguments, forever. Keep every shape and Python value "
                    "the same each step; let only tensor contents (lengths) change.")
        if runtime.on_gpu():
            _check_capture(fn, dtype)
    where = (", captured and replayed as a CUDA graph" if runtime.on_gpu() else
             " (capture itself needs a GPU: run this on one for the full check)")
    passed(f"graph_safe_decode_step: right values over {GRAPH_SAFE_STEPS} steps with ragged lengths, out reused, no host "
          f"read, the same ops and shapes every step{where}")


def _check_capture(fn, dtype) -> None:
    """On a GPU: no synchronising call, then capture one step and replay it step after step against the eager step."""
    device = runtime.device()
    k_cache, v_cache, lengths, new_inputs = _graph_safe_problem(dtype, device)
    static = [t.clone() for t in new_inputs[0]]
    out = torch.empty_like(static[0])
    eager = [k_cache.clone(), v_cache.clone(), lengths.clone()]
    eager64 = [k_cache.double(), v_cache.double(), lengths.clone()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(*static, k_cache, v_cache, lengths, out)  # step 1, eager, on the side of the capture: must not sync
    except RuntimeError as e:
        raise ExerciseFailed(f"graph_safe_decode_step: a synchronising CUDA call{_line_in(fn, e.__traceback__)}: "
                             f"{str(e).splitlines()[0]}") from None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eager_decode_step(*new_inputs[0], *eager)
    eager_decode_step(*(t.double() for t in new_inputs[0]), *eager64)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(graph):  # capture records step 2 without running it
            fn(*static, k_cache, v_cache, lengths, out)
    except RuntimeError as e:
        raise ExerciseFailed(f"graph_safe_decode_step: CUDA refused to capture the step{_line_in(fn, e.__traceback__)}: "
                             f"{str(e).splitlines()[0]}") from None
    for step in range(1, GRAPH_SAFE_STEPS + 2):
        for buffer, new in zip(static, new_inputs[step]):
            buffer.copy_(new)
        graph.replay()
        want_low = eager_decode_step(*new_inputs[step], *eager)
        want = eager_decode_step(*(t.double() for t in new_inputs[step]), *eager64)
        torch.cuda.synchronize()
        if not (torch.equal(lengths, eager[2]) and torch.equal(k_cache, eager[0]) and torch.equal(v_cache, eager[1])):
            raise ExerciseFailed(f"graph_safe_decode_step: replay {step} left lengths or the caches different from the "
                                 "eager step's")
        try:
            check_close("graph_safe_decode_step (replayed)", out, want, want_low)
        except AssertionError as e:
            raise ExerciseFailed(f"{e}\n  at replay {step} of the captured graph") from None
