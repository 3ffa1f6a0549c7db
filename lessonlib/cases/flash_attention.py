"""Lesson 02's timed cases, shared by ``benchmarks/bench_flash_attention.py`` (the recorded run) and the notebook's
"measure on this GPU" view (:mod:`lessonlib.widgets.recorded`): the same inputs, the same peers, the same float64
check before anything is timed.

bf16 (``runtime.dtype()``). TFLOP/s counts 4·B·H·N²·D for the forward (halved when causal) and 2.5 times that for
the backward.
"""

from __future__ import annotations

import torch

from lessonlib import ops, reference, runtime, sdpa
from lessonlib.bench import Case
from lessonlib.results import SDPA_BACKEND_IMPLS, Impl, Op
from lessonlib.testing import check_close, to_float64

NAIVE_BACKWARD_MAX_N = 4096  # naive's backward keeps the score matrix and its gradient: beyond, it only measures OOM


def forward_flops(batch, heads, n_q, n_kv, head_dim, causal):
    flops = 4 * batch * heads * n_q * n_kv * head_dim
    return flops / 2 if causal else flops


def peers():
    """Every implementation timed: lessonlib, naive attention, and SDPA forced onto each backend (on CPU: SDPA as
    PyTorch chooses)."""
    found = {Impl.LESSONLIB: lambda q, k, v, causal, **kw: ops.flash_attention(q, k, v, causal=causal, **kw),
             Impl.NAIVE: lambda q, k, v, causal: reference.attention(q, k, v, causal=causal)}
    if not runtime.on_gpu():
        return {**found, Impl.SDPA: lambda q, k, v, causal: sdpa.scaled_dot_product_attention(q, k, v, causal)}
    for backend in sdpa.BACKENDS:
        if backend in SDPA_BACKEND_IMPLS:
            found[SDPA_BACKEND_IMPLS[backend]] = lambda q, k, v, causal, b=backend: sdpa.scaled_dot_product_attention(
                q, k, v, causal, backends=(b,))
    return found


def backward_of(fn, q, k, v, causal):
    """A closure timing only the backward: the forward runs once, its graph is kept for every repetition."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal)
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)


def inputs(run, batch, heads, n, head_dim, n_q=None):
    """q (n_q rows, default n), k, v, and their first batch entry's first two heads: the slice checked in float64
    (the float64 scores of every head would cost 10s of GB)."""
    def randn(rows):
        return torch.randn(batch, heads, rows, head_dim, device=runtime.device(), dtype=torch.float32).to(run.dtype)

    q, k, v = randn(n if n_q is None else n_q), randn(n), randn(n)
    return q, k, v, (q[:1, :2], k[:1, :2], v[:1, :2])


def _error(error):
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def speed_cases(run, shapes, implementations):
    """Forward, then backward, of every implementation at each shape; lessonlib checked against float64 first."""
    for batch, heads, n, head_dim, causal in dict.fromkeys(shapes):
        q, k, v, one = inputs(run, batch, heads, n, head_dim)
        shape = {"B": batch, "H": heads, "N": n, "D": head_dim, "causal": causal}
        flops = forward_flops(batch, heads, n, n, head_dim, causal)
        failing = tuple(i for i in implementations if i != Impl.LESSONLIB)  # out of memory, or a backend refusing

        def check(one=one, causal=causal):
            check_close("flash_attention", ops.flash_attention(*one, causal=causal),
                        reference.attention(*to_float64(*one), causal=causal), reference.attention(*one, causal=causal))

        timed = {impl: (lambda fn=fn, q=q, k=k, v=v: fn(q, k, v, causal)) for impl, fn in implementations.items()}
        yield Case(Op.FORWARD, shape, timed, check, flops=flops, may_fail=failing)
        for impl, fn in implementations.items():
            if impl == Impl.NAIVE and n > NAIVE_BACKWARD_MAX_N:
                continue
            try:
                closure = backward_of(fn, q, k, v, causal)
            except (torch.OutOfMemoryError, RuntimeError) as error:
                run.record(Op.BACKWARD, impl, shape, None, error=_error(error))
                continue
            yield Case(Op.BACKWARD, shape, {impl: closure}, flops=2.5 * flops, may_fail=failing)
            del closure
        del q, k, v

