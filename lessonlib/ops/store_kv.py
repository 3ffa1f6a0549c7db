"""store_kv: write new tokens' keys and values into their slots of a paged KV cache (vLLM: reshape_and_cache).

Token t's K and V rows go to slot ``slots[t]`` = physical block * block_size + offset in the block. One program per
token copies its (num_kv_heads * head_dim) row of K and of V: a pure copy, so the bar is copy bandwidth.

``store_kv`` is the op a model calls: the custom op ``torch.ops.lessonlib.store_kv`` (mutating k_cache and v_cache,
with a fake implementation) under torch.compile, the launcher directly otherwise. It has no backward: inputs that
require grad are refused (outside ``torch.no_grad()``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lessonlib.ops._common import check_tensors, launch, next_power_of_2, refuse_gradient


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,  # (T, num_kv_heads, head_dim): token rows stride_kt / stride_vt apart, each row contiguous
    k_cache_ptr, v_cache_ptr,  # (num_slots, row) contiguous: (num_blocks, block_size, num_kv_heads, head_dim)
    slots_ptr,  # (T,) int64: where each token goes
    stride_kt,
    stride_vt,
    row,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    for start in range(0, row, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < row
        tl.store(k_cache_ptr + slot * row + cols, tl.load(k_ptr + token * stride_kt + cols, mask=mask), mask=mask)
        tl.store(v_cache_ptr + slot * row + cols, tl.load(v_ptr + token * stride_vt + cols, mask=mask), mask=mask)


def _check(k, v, k_cache, v_cache, slots) -> None:
    check_tensors("store_kv", k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"store_kv: k and v must both be (T, num_kv_heads, head_dim), got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"store_kv: caches must be (num_blocks, block_size, {k.shape[1]}, {k.shape[2]}) and alike, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv: k_cache and v_cache must be contiguous")
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] > 0 and t.shape[1] > 1 and t.stride(1) != k.shape[2]:  # one head: its stride is never used
            raise ValueError(f"store_kv: each token's {name} row (num_kv_heads, head_dim) must be contiguous")
    check_slots("store_kv", slots, k.shape[0], k.device)


def check_slots(op: str, slots, tokens: int, device: torch.device) -> None:
    """slots' type, shape and device: what can be checked without reading it (fake implementations too)."""
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64) or slots.shape != (tokens,):
        raise TypeError(f"{op}: slots must be an integer tensor of shape ({tokens},)")
    if slots.device != device:
        raise ValueError(f"{op}: slots on {slots.device}, the tensors on {device}")


def check_slot_values(op: str, slots: torch.Tensor, num_slots: int) -> None:
    """Checked on the host before launch: a bad slot would write outside the pool, a repeated one would race.
    Reads slots: a device sync and a sort, which a caller with trusted slots skips (``validate=False``)."""
    if bool(((slots < 0) | (slots >= num_slots)).any()):
        raise ValueError(f"{op}: slots must lie in [0, {num_slots})")
    if torch.unique(slots).numel() != slots.numel():
        raise ValueError(f"{op}: two tokens map to the same slot")


def config(row: int, profile=None) -> dict:
    """BLOCK (elements of a token's row copied per step) and warps.
    The same on every GPU, ``profile`` accepted for a uniform interface: the kernel keeps its elements in registers
    and needs no shared memory beyond nothing (compiled for sm_75 to sm_90: tests/ops/test_compile_targets.py)."""
    return dict(BLOCK=min(next_power_of_2(row), 4096), num_warps=4)


def store_kv_forward(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, validate: bool = True) -> None:
    """The launcher (models call :func:`store_kv`, same arguments)."""
    _check(k, v, k_cache, v_cache, slots)
    row = k.shape[1] * k.shape[2]
    if k.shape[0] == 0:
        return
    if validate:
        check_slot_values("store_kv", slots, k_cache.shape[0] * k_cache.shape[1])
    launch(_store_kv_kernel, (k.shape[0],), k, v, k_cache, v_cache, slots.to(torch.int64), k.stride(0), v.stride(0),
           row, **config(row))


# --- the op: torch.ops.lessonlib.store_kv, writing into the caches, no gradient -----------------------------------

@torch.library.custom_op("lessonlib::store_kv", mutates_args=("k_cache", "v_cache"))
def _store_kv_op(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 validate: bool) -> None:
    store_kv_forward(k, v, k_cache, v_cache, slots, validate)


@_store_kv_op.register_fake
def _(k, v, k_cache, v_cache, slots, validate):
    _check(k, v, k_cache, v_cache, slots)  # the slot range checks read values: at run time only


_STORE_KV = torch.ops.lessonlib.store_kv.default


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             validate: bool = True) -> None:
    """k, v: (T, num_kv_heads, head_dim); k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim),
    contiguous; slots: (T,) integer, distinct, each below num_blocks * block_size. Writes in place.

    ``validate=False`` skips the range and distinctness checks of ``slots`` (a device sync and a sort per call):
    only for slots from a trusted source, such as PagedKVCache, which builds them from its own block tables.
    No backward: inputs that require grad are refused (outside ``torch.no_grad()``)."""
    refuse_gradient("store_kv", "it writes into the cache in place, and attention reads the cache back as a constant",
                    k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if torch.compiler.is_compiling():
        return _STORE_KV(k, v, k_cache, v_cache, slots, validate)
    return store_kv_forward(k, v, k_cache, v_cache, slots, validate)
