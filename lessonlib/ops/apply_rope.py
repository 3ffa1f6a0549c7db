"""apply_rope: rotary position embedding on q and k in one kernel (Hugging Face's rotate_half convention).

Eager PyTorch builds rotate_half with a slice, a negation and a concatenation, then two multiplies and an add, for
q and again for k: ten kernels (torch.profiler on the H200, lessonlib/results/fusion-h200.json) and as many
temporaries. The fused kernel reads each (b, t) row of cos/sin once, rotates every head of q and of k with it, and
writes q_rot and k_rot once.

Backward: RoPE is linear in q and k, a rotation of each (x1, x2) pair by the position's angle, so the gradient is
the transposed map: the same kernel rotating d(q_rot) and d(k_rot) the other way (``INVERSE``). It needs only
cos and sin: nothing of the forward is saved. Tables are constants: no gradient flows to cos and sin (asking for
one is an error).

``apply_rope`` is the op a model calls: ``torch.ops.lessonlib.apply_rope`` (a custom op with a fake and an autograd
formula) when autograd or torch.compile needs it, the launcher directly otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lessonlib.ops._common import check_tensors, launch, next_power_of_2, refuse_gradient


@triton.jit
def _rotate_heads(
    x_ptr,  # x[b, 0, t, 0]: first head of one (b, t) row
    out_ptr,  # out[b, 0, t, 0]
    n_heads,
    stride_xh,
    stride_out_h,
    half,  # head_dim // 2
    # (BLOCK_D,) float32: the two halves of this position's cos and sin rows
    cos1, cos2, sin1, sin2,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    # rotate by minus the angle: the backward (the transpose of the rotation)
    INVERSE: tl.constexpr,
):
    d = tl.arange(0, BLOCK_D)[None, :]
    for h0 in range(0, n_heads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H))[:, None]
        mask = (h < n_heads) & (d < half)
        x_row = x_ptr + h * stride_xh + d
        out_row = out_ptr + h * stride_out_h + d
        x1 = tl.load(x_row, mask=mask).to(tl.float32)
        x2 = tl.load(x_row + half, mask=mask).to(tl.float32)
        if INVERSE:
            # The transpose of the map below: out1 takes what x1 fed (x1 * cos1 and x1 * sin2), out2
            # what x2 fed.
            out1 = x1 * cos1 + x2 * sin2
            out2 = x2 * cos2 - x1 * sin1
        else:
            # rotate_half(x) = (-x2, x1), so x * cos + rotate_half(x) * sin is, half by half:
            out1 = x1 * cos1 - x2 * sin1
            out2 = x2 * cos2 + x1 * sin2
        tl.store(out_row, out1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_row + half, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _apply_rope_kernel(
    q_ptr, k_ptr,  # (B, H, T, D) and (B, Hkv, T, D), any strides but the last
    cos_ptr, sin_ptr,  # (B, T, D) views; stride 0 along B when one table serves every batch row
    q_out_ptr, k_out_ptr,  # like q and k
    seq_len, n_q_heads, n_kv_heads, half,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_cos_b, stride_cos_t,
    stride_sin_b, stride_sin_t,
    stride_q_out_b, stride_q_out_h, stride_q_out_t,
    stride_k_out_b, stride_k_out_h, stride_k_out_t,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    INVERSE: tl.constexpr,  # the backward: rotate the gradients back
):
    pid = tl.program_id(0).to(tl.int64)  # one program per (b, t)
    b = pid // seq_len
    t = pid % seq_len
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    cos_row = cos_ptr + b * stride_cos_b + t * stride_cos_t
    sin_row = sin_ptr + b * stride_sin_b + t * stride_sin_t
    cos1 = tl.load(cos_row + d, mask=dmask).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + half + d, mask=dmask).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row + d, mask=dmask).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + half + d, mask=dmask).to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr + b * stride_qb + t * stride_qt, q_out_ptr + b * stride_q_out_b + t * stride_q_out_t,
        n_q_heads, stride_qh, stride_q_out_h, half, cos1, cos2, sin1, sin2,
        BLOCK_HQ, BLOCK_D, INVERSE,
    )
    _rotate_heads(
        k_ptr + b * stride_kb + t * stride_kt, k_out_ptr + b * stride_k_out_b + t * stride_k_out_t,
        n_kv_heads, stride_kh, stride_k_out_h, half, cos1, cos2, sin1, sin2,
        BLOCK_HK, BLOCK_D, INVERSE,
    )


def _heads_block(n_heads: int, block_d: int) -> int:
    # A tile of heads x half-dims of at most 4096 elements per half keeps registers in check.
    return max(1, min(next_power_of_2(n_heads), 4096 // block_d))


def _check(q, k, cos, sin) -> None:
    check_tensors("apply_rope", q=q, k=k, cos=cos, sin=sin)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rope: q and k must be 4-D (B, H, T, D), got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    batch, n_q_heads, seq_len, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq_len, head_dim):
        raise ValueError(f"apply_rope: k {tuple(k.shape)} must match q {tuple(q.shape)} in B, T and D (heads may differ)")
    if head_dim % 2:
        raise ValueError(f"apply_rope: head_dim must be even (rotate_half splits it in two halves), got {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() not in (2, 3) or tuple(table.shape[-2:]) != (seq_len, head_dim) or (
            table.dim() == 3 and table.shape[0] not in (1, batch)
        ):
            raise ValueError(f"apply_rope: {name} must be (T, D) = ({seq_len}, {head_dim}) or (B, T, D) with B in (1, {batch}), got {tuple(table.shape)}")


def config(n_q_heads: int, n_kv_heads: int, head_dim: int, profile=None) -> dict:
    """Tiles (heads x half-dims) and warps.
    The same on every GPU, ``profile`` accepted for a uniform interface: the kernel keeps its elements in registers
    and needs no shared memory beyond nothing (compiled for sm_75 to sm_90: tests/ops/test_compile_targets.py)."""
    block_d = next_power_of_2(head_dim // 2)
    return dict(BLOCK_HQ=_heads_block(n_q_heads, block_d), BLOCK_HK=_heads_block(n_kv_heads, block_d),
                BLOCK_D=block_d, num_warps=4)


def _rotate(q, k, cos, sin, inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel on checked inputs: rotate every head of q and k by its position's angle (or back)."""
    batch, n_q_heads, seq_len, head_dim = q.shape
    cos = cos.expand(batch, seq_len, head_dim)  # stride 0 along B when one table serves every batch row
    sin = sin.expand(batch, seq_len, head_dim)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.numel() == 0 or k.numel() == 0:
        return q_out, k_out
    half = head_dim // 2
    launch(
        _apply_rope_kernel, (batch * seq_len,),
        q, k, cos, sin, q_out, k_out, seq_len, n_q_heads, k.shape[1], half,
        *q.stride()[:3], *k.stride()[:3], cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        *q_out.stride()[:3], *k_out.stride()[:3],
        INVERSE=inverse, **config(n_q_heads, k.shape[1], head_dim),
    )
    return q_out, k_out


def apply_rope_forward(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward launcher: fused rotary embedding; returns ``(q_rot, k_rot)`` like ``lessonlib.reference.apply_rope``.

    q: (B, H, T, D); k: (B, Hkv, T, D); cos, sin: (T, D) or (B, T, D) (a leading 1 broadcasts). D must be even.
    No autograd: models call :func:`apply_rope`.
    """
    _check(q, k, cos, sin)
    return _rotate(q, k, cos, sin, inverse=False)


def apply_rope_backward(
    grad_q_rot: torch.Tensor, grad_k_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward launcher: ``(d q, d k)``, the gradients rotated back by the same tables."""
    _check(grad_q_rot, grad_k_rot, cos, sin)
    return _rotate(grad_q_rot, grad_k_rot, cos, sin, inverse=True)


# --- the op: torch.ops.lessonlib.apply_rope, with a fake implementation and a gradient --------------------------

@torch.library.custom_op("lessonlib::apply_rope", mutates_args=())
def _apply_rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope_forward(q, k, cos, sin)


@_apply_rope_op.register_fake
def _(q, k, cos, sin):
    _check(q, k, cos, sin)
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("lessonlib::apply_rope_backward", mutates_args=())
def _apply_rope_backward_op(grad_q_rot: torch.Tensor, grad_k_rot: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope_backward(grad_q_rot, grad_k_rot, cos, sin)


@_apply_rope_backward_op.register_fake
def _(grad_q_rot, grad_k_rot, cos, sin):
    return torch.empty_like(grad_q_rot), torch.empty_like(grad_k_rot)


def _save_for_backward(ctx, inputs, output):
    q, k, cos, sin = inputs
    ctx.save_for_backward(cos, sin)  # the tables only: the backward never reads q or k


def _backward(ctx, grad_q_rot, grad_k_rot):
    cos, sin = ctx.saved_tensors
    grad_q_rot = grad_q_rot if grad_q_rot.stride(-1) == 1 else grad_q_rot.clone(memory_format=torch.contiguous_format)
    grad_k_rot = grad_k_rot if grad_k_rot.stride(-1) == 1 else grad_k_rot.clone(memory_format=torch.contiguous_format)
    grad_q, grad_k = torch.ops.lessonlib.apply_rope_backward(grad_q_rot, grad_k_rot, cos, sin)
    return grad_q, grad_k, None, None


_apply_rope_op.register_autograd(_backward, setup_context=_save_for_backward)
_APPLY_ROPE = torch.ops.lessonlib.apply_rope.default


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused rotary embedding with gradients for q and k: the op a model calls (``lessonlib.reference.apply_rope``'s
    twin). Returns ``(q_rot, k_rot)``. q: (B, H, T, D); k: (B, Hkv, T, D); cos, sin: (T, D) or (B, T, D) (a leading
    1 broadcasts), constants: no gradient flows to them. D must be even. Goes through the custom op
    ``torch.ops.lessonlib.apply_rope`` when autograd must record it or torch.compile traces it."""
    refuse_gradient("apply_rope", "the rotary tables are constants", cos=cos, sin=sin)
    if getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False) or torch.compiler.is_compiling():
        return _APPLY_ROPE(q, k, cos, sin)
    return apply_rope_forward(q, k, cos, sin)
