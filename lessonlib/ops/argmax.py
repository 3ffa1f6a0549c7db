"""argmax over each row's last dimension, as ``torch.argmax(x, dim=-1)``: the serving engine's greedy sampling.

Why a kernel: a decode step ends by picking, in each of B rows of logits, the largest of V values (V = 128,256 for
Llama 3). PyTorch's reduction gives each row to one thread block, so at B=1 one block of one SM reads the whole
row: 40 us on the H200 for 0.5 MB, longer than a layer of the model (measured in lesson 07's step breakdown). Here
each row is cut into chunks, one program per (row, chunk) across the whole GPU, each writing its chunk's largest
value and where it is; a second pass (PyTorch, over B x chunks values) picks each row's winning chunk.

Ties go to the first index, as in torch.argmax: within a chunk ``tl.max(..., return_indices_tie_break_left=True)``
and a strict ``>`` across the chunk's tiles; across chunks torch.argmax's own first-maximum rule, over chunks in
index order. Values are compared in float32 (exact for float16 and bfloat16).

A row holding NaN or an infinity has no meaningful answer (torch.argmax returns the NaN's index). With ``nonfinite``
given, such a row gets that index instead (the engine passes ``sampler.ABORTED``): a chunk that meets a non-finite
value reports +inf at that index, and the second pass, which takes the first maximum, picks it (a chunk of finite
values never reports +inf). Without it, a row holding NaN has no defined answer here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lessonlib import runtime
from lessonlib.ops._common import check_tensors, launch, pdl_options, pdl_wait_then_trigger

BLOCK = 1024  # elements a program reads per step of its chunk
PROGRAMS_PER_SM = 2


@triton.jit
def _argmax_chunk_kernel(x_ptr, values_ptr, indices_ptr, n_cols, stride_xrow, chunk, nonfinite_index,
                         BLOCK: tl.constexpr, CHECK_FINITE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, c): the largest value of columns [c * chunk, (c + 1) * chunk) of one row and its first index.
    CHECK_FINITE: a chunk holding NaN or an infinity reports (+inf, nonfinite_index) instead. PDL: launched with
    programmatic dependent launch (ops._common.pdl_options)."""
    pdl_wait_then_trigger(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    start = c * chunk
    end = tl.minimum(start + chunk, n_cols)
    best_value = tl.full((), float("-inf"), tl.float32)
    best_index = start  # a chunk of -inf only: its first column, the first index of its maximum
    nonfinite = tl.zeros((), tl.int32)
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xrow + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
        value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = value > best_value  # strict: an earlier tile keeps a tie
        best_index = tl.where(better, offset + index, best_index)
        best_value = tl.where(better, value, best_value)
        if CHECK_FINITE:  # NaN, +inf or -inf among the row's own columns (the padding's -inf is not one)
            bad = ((x != x) | (tl.abs(x) == float("inf"))) & (cols < end)
            nonfinite = tl.maximum(nonfinite, tl.max(bad.to(tl.int32), axis=0))
    if CHECK_FINITE:
        best_index = tl.where(nonfinite > 0, nonfinite_index, best_index)
        best_value = tl.where(nonfinite > 0, float("inf"), best_value)
    out = row * tl.num_programs(1) + c
    tl.store(values_ptr + out, best_value)
    tl.store(indices_ptr + out, best_index.to(tl.int64))


def num_chunks(rows: int, n_cols: int, multiprocessors: int | None = None) -> int:
    """Chunks per row: about PROGRAMS_PER_SM programs per SM over all rows, each chunk at least one BLOCK long. In
    the interpreter one chunk per row (every program instance costs milliseconds of Python there)."""
    if multiprocessors is None:
        profile = runtime.gpu_profile()
        if profile is None:
            return 1
        multiprocessors = profile.multiprocessors
    wanted = max(1, PROGRAMS_PER_SM * multiprocessors // max(rows, 1))
    return max(1, min(wanted, triton.cdiv(n_cols, BLOCK)))


def argmax(x: torch.Tensor, nonfinite: int | None = None) -> torch.Tensor:
    """Index of the largest value of each row of ``x`` (rows, n), int64 (rows,); the first one on ties. ``x``: float32,
    float16 or bfloat16 (where the GPU has it), last dimension contiguous. ``nonfinite``: the index given to a row
    holding NaN or an infinity (any int64; None: no check). No host sync: CUDA-graph safe."""
    check_tensors("argmax", x=x)  # dtype, device, last dimension contiguous
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax: x must be (rows, n) with n >= 1, got {tuple(x.shape)}")
    if nonfinite is not None and (isinstance(nonfinite, bool) or not isinstance(nonfinite, int)
                                  or not -2**63 <= nonfinite < 2**63):
        raise TypeError(f"argmax: nonfinite must be an int64 index or None, got {nonfinite!r}")
    rows, n_cols = x.shape
    chunks = num_chunks(rows, n_cols)
    chunk = triton.cdiv(triton.cdiv(n_cols, chunks), BLOCK) * BLOCK  # whole tiles: no chunk starts mid-tile
    chunks = triton.cdiv(n_cols, chunk)  # none empty
    values = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    indices = torch.empty(rows, chunks, dtype=torch.int64, device=x.device)
    if rows:
        launch(_argmax_chunk_kernel, (rows, chunks), x, values, indices, n_cols, x.stride(0), chunk,
               0 if nonfinite is None else nonfinite, BLOCK=BLOCK, CHECK_FINITE=nonfinite is not None, num_warps=4,
               **pdl_options())
    if chunks == 1:
        return indices[:, 0]
    return indices.gather(1, values.argmax(dim=1, keepdim=True))[:, 0]
