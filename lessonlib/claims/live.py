"""Claims decided by a live check on this machine: tiny inputs, fresh each time, on the course's device (the CPU
without a GPU). About two seconds together on a 2-core CPU, most of it the first call under a dispatch mode."""

from __future__ import annotations

import math

import torch

from lessonlib import kv_memory, reference, runtime, traffic
from lessonlib.claims.verdicts import Verdict


def additive_mask() -> Verdict:
    """softmax(QKᵀ/√D + M)V with M the additive causal mask, against the causal flag, in float64 (N=7, D=16)."""
    n = 7
    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    q, k, v = (torch.randn(2, 3, n, 16, dtype=torch.float64) for _ in range(3))
    with_mask, with_flag = reference.attention(q, k, v, mask=mask), reference.attention(q, k, v, causal=True)
    diff = (with_mask - with_flag).abs().max().item()
    measured = f"float64, fresh inputs (N={n}): largest difference from causal=True {diff:.1e}"
    return Verdict(measured, "holds: the additive -inf mask is the causal flag" if diff == 0 else
                   "does not hold: the two differ")


def allocated_bytes(fn, *inputs) -> int:
    """Bytes of the new tensors ``fn(*inputs)`` allocates through PyTorch, in all (views and in-place results not
    counted). A kernel's scratch outside PyTorch (registers, shared memory; the interpreter's numpy) is not seen."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                     if isinstance(a, torch.Tensor)}
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                    Count.total += t.untyped_storage().nbytes()
            return out

    with Count():
        fn(*inputs)
    return Count.total


def growth_exponent(fn, n: int, head_dim: int = 16) -> float:
    """log2 of how much more ``fn`` allocates at 2n tokens than at n: 1 is linear, 2 quadratic."""
    sizes = [allocated_bytes(fn, *(torch.randn(1, 1, m, head_dim, device=runtime.device(), dtype=runtime.dtype())
                                   for _ in range(3))) for m in (n, 2 * n)]
    return math.log2(sizes[1] / sizes[0])


def linear_memory() -> Verdict:
    from lessonlib import ops

    flash = growth_exponent(lambda q, k, v: ops.flash_attention(q, k, v), 32)
    naive = growth_exponent(reference.attention, 32)
    dtype = str(runtime.dtype()).removeprefix("torch.")
    measured = (f"bytes allocated per call, N=32 -> 64 ({dtype}, live): lessonlib's kernel x{2 ** flash:.1f} "
                f"(N^{flash:.2f}), naive attention x{2 ** naive:.1f} (N^{naive:.2f})")
    linear, quadratic = flash < 1.5, naive > 1.5  # 1.5: halfway between linear and quadratic growth
    return Verdict(measured, "holds: the kernel's memory grows linearly, the score matrix's quadratically"
                   if linear and quadratic else "does not hold here")


def op_order() -> Verdict:
    """silu(gate) * up in the course's 16-bit dtype: eager against lessonlib's fused swiglu, on lesson 04's seeded
    draw (``compiler.rounding_order``), so the table quotes the figures lesson 04 prints."""
    from lessonlib import compiler

    order = compiler.rounding_order(runtime.dtype())
    dtype = str(order.dtype).removeprefix("torch.")
    measured = (f"{dtype}, lesson 04's seeded draw: eager and fused differ on {order.differ:.0%} of elements; off "
                f"float64 by up to {order.eager_units:.2f} units (eager) and {order.fused_units:.2f} (fused)")
    return Verdict(measured, "holds: the order of roundings changes the result" if order.differ > 0 else
                   "does not hold at this size: identical outputs")


# --- lesson 03: paging ---------------------------------------------------------------------------------------------


def paging_waste() -> Verdict:
    held = kv_memory.reservation(kv_memory.request_lengths(n=256, median=600, max_len=4096), 4096, 16)
    measured = (f"256 requests (lesson 03's spread), block_size 16: paged leaves {held.paged_waste:.1%} unused, "
                f"4,096-token slabs {held.contiguous_waste:.1%}")
    return Verdict(measured, "holds" if held.paged_waste < held.contiguous_waste else "does not hold")


def paging_quadratic() -> Verdict:
    """How the paged cache, a slab, and one layer's score matrix grow from N to 2N tokens."""
    n, max_len = 8192, 32768
    held = [kv_memory.reservation(torch.tensor([m]), max_len, 16) for m in (n, 2 * n)]
    paged = math.log2(held[1].paged_tokens / held[0].paged_tokens)
    slab = math.log2(held[1].contiguous_tokens / held[0].contiguous_tokens)
    scores = math.log2(traffic.score_matrix_bytes(2 * n) / traffic.score_matrix_bytes(n))
    measured = (f"N={n:,} -> {2 * n:,}: paged KV grows as N^{paged:.2f}, a {max_len:,} slab as N^{slab:.2f}, one "
                f"layer's score matrix as N^{scores:.2f}")
    if max(paged, slab) < 1.5 < scores:
        return Verdict(measured, "does not hold: no KV cache grows quadratically, paged or not; the quadratic term "
                       "is the score matrix, which FlashAttention (not paging) avoids")
    return Verdict(measured, "holds")


def dropout_on_cpu() -> str:
    """Which SDPA backend PyTorch picks on the CPU with and without dropout (its private chooser, where present)."""
    from torch.nn.attention import SDPBackend

    q = torch.randn(1, 2, 40, 32)
    try:
        picks = [SDPBackend(torch._fused_sdp_choice(q, q, q, dropout_p=p)).name for p in (0.0, 0.1)]
    except (AttributeError, RuntimeError, ValueError):
        return ""
    return f"on this CPU PyTorch picks {picks[0]} without dropout, {picks[1]} with dropout_p=0.1"
