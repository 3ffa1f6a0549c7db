"""absmax_normalize: ``x / max|x|`` over a whole tensor, where fusion meets synchronisation.

Every output needs max|x| over *every* element, and the elements are spread over many programs that cannot wait
for each other: a program may only scale its elements after all programs have finished their maxima. That wait is
a grid-wide barrier, and Triton offers none (CUDA has one only for cooperative launches, which guarantee that every
block is resident at once). Two ways that are correct anyway, both here:

- ``strategy="two_launches"``: a reduction kernel writes one partial maximum per program, then an element-wise kernel
  reduces those few partials and scales. The launch boundary is the barrier: the second kernel starts after every
  program of the first has ended and its writes are visible. Cost: one more launch, and x read twice (3 passes).
- ``strategy="one_program"``: a single program walks x twice (the maximum, then the scaling). No barrier is needed,
  but one program runs on one SM (an H200 has 132), and one SM cannot draw the whole GPU's bandwidth.

The third way, one launch with a barrier built from an atomic counter (each program adds 1, then spins until the
counter reaches the number of programs), is not here: it is correct only while every program is resident at once.
A program that is not yet scheduled cannot arrive, and the programs spinning on the SMs never leave to make room
for it: a deadlock. Nothing in Triton's launch guarantees residency, and the interpreter runs programs one after
another, so there the first program would spin forever.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lessonlib.ops._common import check_tensors, launch, next_power_of_2, num_warps_for, refuse_gradient

STRATEGIES = ("two_launches", "one_program")
BLOCK = 4096  # elements per step; not swept (swiglu's sweep found 2048-4096 elements per program best)
MAX_PARTIALS = 1024  # programs of the reduction: the element-wise kernel loads all their maxima at once (4 KB)


@triton.jit
def _absmax_partials_kernel(
    x_ptr,  # (n,) contiguous
    partials_ptr,  # (programs,) float32: this program's max|x| over its blocks
    n,
    BLOCK: tl.constexpr,  # elements per step
):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    offsets = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    # a grid-stride loop: at most MAX_PARTIALS partials
    for start in range(pid * BLOCK, n, programs * BLOCK):
        x = tl.load(x_ptr + start + offsets, mask=start + offsets < n, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    tl.store(partials_ptr + pid, tl.max(amax, axis=0))


@triton.jit
def _absmax_scale_kernel(
    x_ptr,  # (n,) contiguous
    # (n_partials,) float32, written by the previous launch: complete, since it has ended
    partials_ptr,
    out_ptr,  # (n,) contiguous
    n,
    n_partials,
    BLOCK: tl.constexpr,  # elements per program
    BLOCK_PARTIALS: tl.constexpr,  # next power of 2 >= n_partials
):
    p = tl.arange(0, BLOCK_PARTIALS)
    # every program, from L2
    amax = tl.max(tl.load(partials_ptr + p, mask=p < n_partials, other=0.0), axis=0)
    amax = tl.where(amax > 0, amax, 1.0)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n).to(tl.float32)
    tl.store(out_ptr + offsets, (x / amax).to(out_ptr.dtype.element_ty), mask=offsets < n)


@triton.jit
def _absmax_one_program_kernel(
    x_ptr,  # (n,) contiguous
    out_ptr,  # (n,) contiguous
    n,
    BLOCK: tl.constexpr,  # elements per step
):
    offsets = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):  # first pass: the maximum
        x = tl.load(x_ptr + start + offsets, mask=start + offsets < n, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    total = tl.max(amax, axis=0)
    total = tl.where(total > 0, total, 1.0)
    # second pass: x read again (it does not fit in one program's registers)
    for start in range(0, n, BLOCK):
        x = tl.load(x_ptr + start + offsets, mask=start + offsets < n).to(tl.float32)
        tl.store(out_ptr + start + offsets, (x / total).to(out_ptr.dtype.element_ty),
                 mask=start + offsets < n)


def block_for(n: int) -> int:
    """Elements per step: BLOCK, or fewer for a small x (the interpreter's time is per element of a block)."""
    return min(BLOCK, max(16, next_power_of_2(n)))


def partial_programs(n: int) -> int:
    """How many programs the two-launch reduction runs: one per block of x, at most :data:`MAX_PARTIALS`."""
    return min(triton.cdiv(n, block_for(n)), MAX_PARTIALS)


def absmax_normalize(x: torch.Tensor, strategy: str = "two_launches") -> torch.Tensor:
    """``x / max|x|`` over all of x (``lessonlib.reference.absmax_normalize``'s twin; an all-zero x comes back
    unchanged). x: any shape, contiguous; float16, float32 or bfloat16 (where supported). ``strategy``:
    ``"two_launches"`` (a reduction kernel, then an element-wise kernel) or ``"one_program"`` (one launch of a
    single program). The maximum is exact in float32; the division rounds once."""
    if strategy not in STRATEGIES:
        raise ValueError(f"absmax_normalize: strategy must be one of {STRATEGIES}, got {strategy!r}")
    refuse_gradient("absmax_normalize", "it has no backward: a lesson's example", x=x)
    check_tensors("absmax_normalize", x=x)
    if not x.is_contiguous():
        raise ValueError("absmax_normalize: x must be contiguous; call .contiguous()")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.numel()
    if n == 0:
        return out
    block = block_for(n)
    if strategy == "one_program":
        launch(_absmax_one_program_kernel, (1,), x, out, n, BLOCK=block, num_warps=num_warps_for(block))
        return out
    programs = partial_programs(n)
    partials = torch.empty(programs, dtype=torch.float32, device=x.device)
    launch(_absmax_partials_kernel, (programs,), x, partials, n, BLOCK=block, num_warps=num_warps_for(block))
    launch(_absmax_scale_kernel, (triton.cdiv(n, block),), x, partials, out, n, programs, BLOCK=block,
           BLOCK_PARTIALS=next_power_of_2(programs), num_warps=num_warps_for(block))
    return out

