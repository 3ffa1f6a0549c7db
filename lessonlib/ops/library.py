"""lessonlib's Triton ops registered as PyTorch custom ops (``torch.library.custom_op``), each with a fake (meta)
implementation that gives the output's shape and dtype without running anything.

Why: ``torch.compile`` cannot trace into a Python function that launches a Triton kernel by hand (and in
interpreter mode, Dynamo fails inside Triton's interpreter). As a custom op the kernel is one opaque node in the
graph: a compiled model calls it with ``fullgraph=True``, no graph break, and Inductor fuses what is around it.

    torch.ops.lessonlib.swiglu(gate, up)
    torch.ops.lessonlib.add_rms_norm(x, residual, weight, eps)
    torch.ops.lessonlib.paged_attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale)

The ops validate inputs as the plain functions do, except paged_attention's table checks (validate=False: they
read device tensors, which a compiled graph or a CUDA graph cannot afford per call; build tables with
PagedKVCache).
"""

from __future__ import annotations

import torch

from lessonlib.ops.add_rms_norm import add_rms_norm as _add_rms_norm
from lessonlib.ops.paged_attention import paged_attention as _paged_attention
from lessonlib.ops.swiglu import swiglu as _swiglu


@torch.library.custom_op("lessonlib::swiglu", mutates_args=())
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _swiglu(gate, up)


@swiglu.register_fake
def _(gate, up):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op("lessonlib::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _add_rms_norm(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("lessonlib::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, sm_scale: float) -> torch.Tensor:
    return _paged_attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale, validate=False)


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
