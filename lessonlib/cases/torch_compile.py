"""Lesson 04's timed case, for the notebook's "measure on this GPU" view (:mod:`lessonlib.widgets.recorded`): one op
of lesson 01's recorded run (``benchmarks/bench_fusion.py``) as eager PyTorch, torch.compile and lessonlib, at a
shape the run recorded, lessonlib's output checked against float64 before anything is timed.
"""

from __future__ import annotations

import torch

from lessonlib import measured, ops, reference, runtime, traffic
from lessonlib.bench import Case
from lessonlib.results import Impl, Op
from lessonlib.testing import check_close, gated_mlp_magnitude, to_float64

CHECKED_ROWS = 16  # the GatedMLP's rows are independent: its float64 check runs on the first few (a float64
# product at T=8192, H=4096, I=14336 would take seconds on a GPU with little float64 throughput, such as a T4)


def compile_case(op: str, shape: dict) -> Case:
    """The Case of ``op`` at ``shape``: swiglu, add_rms_norm and apply_rope as lesson 01 times them
    (:func:`lessonlib.measured.calls`, bytes: the fused kernel's), or the whole GatedMLP (FLOPs: its GEMMs')."""
    if op in measured.FUSED_OPS:
        fns, args, check, nbytes = measured.calls(op, shape)
        return Case(op, shape, {impl: (lambda fn=fn: fn(*args)) for impl, fn in fns.items()}, check, nbytes=nbytes)
    if op != Op.GATED_MLP:
        raise ValueError(f"compile_case: op must be {Op.GATED_MLP!r} or one of {measured.FUSED_OPS}, got {op!r}")
    dtype = runtime.dtype()
    mlp = reference.GatedMLP(shape["H"], shape["I"], device=runtime.device(), dtype=dtype)
    fused = ops.FusedGatedMLP(mlp)
    x = torch.randn(shape["T"], shape["H"], device=runtime.device(), dtype=torch.float32).to(dtype)

    def check():
        truth = reference.GatedMLP(shape["H"], shape["I"], device=runtime.device(), dtype=torch.float64)
        truth.load_state_dict({k: v.double() for k, v in mlp.state_dict().items()})
        rows = x[:CHECKED_ROWS]
        with torch.no_grad():
            (rows64,) = to_float64(rows)
            check_close("FusedGatedMLP", fused(rows), truth(rows64), mlp(rows), gated_mlp_magnitude(truth, rows64))

    peers = {Impl.EAGER: mlp, Impl.COMPILE: torch.compile(mlp, dynamic=False), Impl.FUSED_GATED_MLP: fused}
    return Case(op, shape, {impl: (lambda fn=fn: fn(x)) for impl, fn in peers.items()}, check,
                flops=traffic.gated_mlp(shape["T"], shape["H"], shape["I"], dtype.itemsize).eager.flops)
