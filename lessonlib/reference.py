"""Plain-PyTorch references: the definitions every fast kernel in ``lessonlib.ops`` must reproduce.

Nothing here imports Triton; it runs anywhere PyTorch runs. Each function has the same name and signature as its
fused twin in ``lessonlib.ops``, and the tests compare the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the activation of a gated MLP (SwiGLU). Eager PyTorch runs two kernels here."""
    return F.silu(gate) * up


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add followed by RMSNorm, as a pre-norm transformer block does between sub-layers.

    Returns ``(normalized, updated_residual)``: ``updated_residual = x + residual`` (in the input dtype, it is the
    next layer's residual stream) and ``normalized = weight * rms_norm(updated_residual)``, with the mean of
    squares taken in float32 (as Llama-style models do), cast back to the input dtype before the weight.
    """
    updated_residual = x + residual
    hidden = updated_residual.float()
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    normalized = weight * hidden.to(x.dtype)
    return normalized, updated_residual


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension (Hugging Face transformers' convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding on queries and keys, rotate_half convention.

    q: (B, H, T, D); k: (B, Hkv, T, D); cos, sin: (T, D) or (B, T, D), broadcast over heads.
    """
    cos = cos.unsqueeze(-3)  # (..., 1, T, D): one row of angles shared by every head
    sin = sin.unsqueeze(-3)
    q_rot = q * cos + rotate_half(q) * sin
    k_rot = k * cos + rotate_half(k) * sin
    return q_rot, k_rot


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (*positions.shape, head_dim), laid out as Llama's rotary embedding lays them."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    angles = positions.to(torch.float64)[..., None] * inv_freq  # (..., D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (..., D): both halves see the same frequency
    return angles.cos().to(dtype), angles.sin().to(dtype)


class GatedMLP(nn.Module):
    """The feed-forward block of Llama-style models: down(silu(gate(x)) * up(x)).

    Eager PyTorch runs it as three GEMMs and two elementwise kernels, with two (T, I) intermediates written to and
    read back from memory.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, sm_scale: float | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache, the plain way: gather each sequence's pages into contiguous K and V
    (following its block table), then ordinary attention in the tensors' dtype, softmax in float32.

    q: (B, H, D), one new token per sequence; k_cache, v_cache: (num_blocks, block_size, Hkv, D); block_table:
    (B, max_blocks) int32; seq_lens: (B,) int32. H a multiple of Hkv: each KV head serves H / Hkv query heads.
    """
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = sm_scale if sm_scale is not None else head_dim ** -0.5
    out = torch.empty_like(q)
    for b in range(batch):
        n = int(seq_lens[b])
        blocks = block_table[b, : -(-n // block_size)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, dim=1)  # (n, H, D)
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:n].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b], k) * scale  # (H, n)
        p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out
