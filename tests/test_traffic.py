"""The bytes-and-FLOPs model must describe what actually runs: its kernel lists are checked against the launches
torch.profiler counts for the reference (eager) and the fused implementations."""

import pytest
import torch

from lessonlib import ops, reference, runtime, traffic
from lessonlib.measure import count_launches
from tests.conftest import DEVICE, randn


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_launch_counts_match_the_model(dtype):
    itemsize = torch.tensor([], dtype=dtype).element_size()
    T, H, I = 5, 64, 96
    cases = {
        "swiglu": (traffic.swiglu(T, I, itemsize), reference.swiglu, ops.swiglu, (randn(T, I, dtype=dtype), randn(T, I, dtype=dtype))),
        "add_rms_norm": (traffic.add_rms_norm(T, H, itemsize), reference.add_rms_norm, ops.add_rms_norm,
                         (randn(T, H, dtype=dtype), randn(T, H, dtype=dtype), randn(H, dtype=dtype))),
    }
    q, k = randn(1, 4, T, 32, dtype=dtype), randn(1, 2, T, 32, dtype=dtype)
    cos, sin = reference.rope_cos_sin(torch.arange(T, device=DEVICE), 32, dtype=dtype)
    cases["apply_rope"] = (traffic.apply_rope(1, 4, 2, T, 32, itemsize), reference.apply_rope, ops.apply_rope, (q, k, cos, sin))
    if DEVICE.type == "cpu":  # on a GPU cuBLAS may run one GEMM as several kernels
        mlp = reference.GatedMLP(H, I, device=DEVICE, dtype=dtype)
        cases["gated_mlp"] = (traffic.gated_mlp(T, H, I, itemsize), mlp, ops.FusedGatedMLP(mlp), (randn(T, H, dtype=dtype),))
    with torch.no_grad():
        for name, (model, eager, fused, args) in cases.items():
            assert count_launches(eager, *args).total == model.eager.launches, name
            assert count_launches(fused, *args).total == model.fused.launches, name


def test_rope_store_kv_model_counts_the_launches_and_the_bytes_it_saves():
    from lessonlib.ops.rope_store_kv import apply_rope_then_store_kv

    T, H, Hkv, D = 3, 4, 2, 16
    model = traffic.rope_store_kv(T, H, Hkv, D, itemsize=4)
    qkv = randn(T, (H + 2 * Hkv) * D)
    cos, sin = reference.rope_cos_sin(torch.arange(T, device=DEVICE), D)
    pool = [torch.zeros(4, 4, Hkv, D, device=DEVICE) for _ in range(2)]
    args = (qkv, cos, sin, *pool, torch.tensor([9, 2, 14], device=DEVICE))
    fused = lambda *a, **kw: ops.rope_store_kv(*a, **kw, validate=False)  # noqa: E731 (the slot checks launch too)
    for fn, chain in ((apply_rope_then_store_kv, model.eager), (fused, model.fused)):
        assert count_launches(lambda: fn(*args, num_heads=H, num_kv_heads=Hkv)).total == chain.launches, chain.label
    q, kv = T * H * D * 4, T * Hkv * D * 4
    assert model.eager.bytes - model.fused.bytes == 2 * q + 4 * kv  # the copies, and k_rot's round trip
    assert model.fused.bytes == 2 * (q + 2 * kv) + 2 * T * D * 4


def test_fused_bytes_are_one_read_and_one_write_per_tensor():
    assert traffic.swiglu(8192, 14336).fused.bytes == 3 * 8192 * 14336 * 2
    assert traffic.add_rms_norm(8192, 4096).fused.bytes == 4 * 8192 * 4096 * 2 + 4096 * 2
    rope = traffic.apply_rope(2, 32, 8, 100, 128)
    assert rope.fused.bytes == 2 * (2 * 32 * 100 * 128 * 2 + 2 * 8 * 100 * 128 * 2) + 2 * 100 * 128 * 2
    assert traffic.swiglu(8192, 14336).byte_ratio == pytest.approx(5 / 3)


def test_roofline_floor_takes_the_larger_term():
    chain = traffic.gated_mlp(8192, 4096, 14336).fused
    bandwidth, peak = 4e12, 700e12
    gemm = chain.kernels[0]
    assert gemm.flops / peak > gemm.bytes / bandwidth  # compute-bound at T=8192
    assert chain.time_floor_s(bandwidth, peak) == pytest.approx(
        sum(max(k.bytes / bandwidth, k.flops / peak) for k in chain.kernels))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_backward_launch_counts_match_the_model(dtype):
    # Eager: autograd through the reference; fused: the custom op's backward. Only the backward pass is counted.
    itemsize = torch.tensor([], dtype=dtype).element_size()
    T, H, I = 5, 64, 96
    gate, up = randn(T, I, dtype=dtype).requires_grad_(), randn(T, I, dtype=dtype).requires_grad_()
    x, res, w = (randn(T, H, dtype=dtype).requires_grad_(), randn(T, H, dtype=dtype).requires_grad_(),
                 randn(H, dtype=dtype).requires_grad_())
    cases = {
        "swiglu": (traffic.swiglu_backward(T, I, itemsize), reference.swiglu, ops.swiglu, (gate, up)),
        "add_rms_norm": (traffic.add_rms_norm_backward(T, H, itemsize), reference.add_rms_norm, ops.add_rms_norm,
                         (x, res, w)),
    }
    for name, (model, eager, fused, args) in cases.items():
        for impl, fn, chain in (("eager", eager, model.eager), ("fused", fused, model.fused)):
            # On a GPU pow's backward copies hidden ** 1 with a cudaMemcpy, which the profiler lists apart from kernels
            expected = chain.gpu_kernels if runtime.on_gpu() else chain.launches
            outs = fn(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            grads = [torch.randn_like(o) for o in outs]
            count = count_launches(lambda: torch.autograd.grad(outs, args, grads, retain_graph=True))
            assert count.total == expected, (name, impl, dict(count.by_name))


def test_fused_backward_bytes():
    n = 8192 * 14336 * 2
    assert traffic.swiglu_backward(8192, 14336).fused.bytes == 5 * n
    assert traffic.swiglu_backward(8192, 14336).eager.bytes == 9 * n
    partial = 264 * 4096 * 4
    assert traffic.add_rms_norm_backward(8192, 4096).fused.bytes == 4 * 8192 * 4096 * 2 + 2 * 4096 * 2 + 2 * partial + 2 * 4096 * 4
