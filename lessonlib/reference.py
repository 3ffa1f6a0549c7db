"""Plain-PyTorch references: the definitions every fast kernel in ``lessonlib.ops`` must reproduce.

Nothing here imports Triton; it runs anywhere PyTorch runs. Each function has the same name and signature as its
fused twin in ``lessonlib.ops``, and the tests compare the two.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the activation of a gated MLP (SwiGLU). Eager PyTorch runs two kernels here."""
    return F.silu(gate) * up


def bias_swiglu(gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor,
                up_bias: torch.Tensor) -> torch.Tensor:
    """silu(gate + gate_bias) * (up + up_bias): swiglu on the outputs of two Linear layers with a
    bias (the bias added after the GEMM, as an unfused epilogue does). Eager PyTorch runs four
    kernels here."""
    return F.silu(gate + gate_bias) * (up + up_bias)


def dequant_matmul(x: torch.Tensor, weight_int8: torch.Tensor,
                   scales: torch.Tensor) -> torch.Tensor:
    """``x @ (weight_int8 * scales[:, None]).T``: a linear layer whose (N, K) weight is stored as
    int8 with one scale per output row (weight-only quantisation). Eager PyTorch converts the whole
    weight, scales it, then multiplies: three kernels and a full-size 16-bit weight written and read
    back."""
    return F.linear(x, weight_int8.to(x.dtype) * scales[:, None])


def quantise_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8 quantisation of an (N, K) weight: ``scales = max|row| / 127`` (in the weight's
    dtype; 1 for an all-zero row) and ``weight_int8 = round(weight / scales)``, so that
    ``weight_int8 * scales[:, None]`` is the weight to within half a scale per element: what
    :func:`dequant_matmul` takes."""
    amax = weight.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    weight_int8 = torch.round(weight.float() / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return weight_int8, scales


def absmax_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / max|x|`` over the whole tensor (an all-zero x is returned unchanged): every element needs a statistic
    of every other element, the shape of reduction that a kernel cannot finish without a grid-wide barrier."""
    amax = x.abs().amax()
    return x / torch.where(amax > 0, amax, torch.ones_like(amax))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         activation: str | None = None) -> torch.Tensor:
    """A linear layer, ``x @ weight.T + bias``; with ``activation="swiglu"`` the weight holds gate rows then up rows
    and the result is ``swiglu(gate, up)``: two launches (the GEMM, then swiglu) and a (M, N) intermediate."""
    y = F.linear(x, weight, bias)
    if activation == "swiglu":
        return swiglu(*y.chunk(2, dim=-1))
    return y


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add followed by RMSNorm, as a pre-norm transformer block does between sub-layers.

    Returns ``(normalized, updated_residual)``: ``updated_residual = x + residual`` (in the input
    dtype, it is the next layer's residual stream) and
    ``normalized = weight * rms_norm(updated_residual)``, with the mean of squares taken in float32
    (as Llama-style models do), cast back to the input dtype before the weight."""
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


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, *, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """RoPE on the new tokens' q and k, then k and v written into their paged-cache slots (in place).

    qkv: (T, (H + 2 Hkv) D), q's columns then k's then v's; cos, sin: (T, D); k_cache, v_cache: (num_blocks,
    block_size, Hkv, D); slots: (T,) distinct, block * block_size + offset. Returns q rotated, (T, H, D).
    """
    tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(tokens, num_heads, head_dim).transpose(0, 1)[None]  # (1, H, T, D): the tokens as one batch row
    k = k.reshape(tokens, num_kv_heads, head_dim).transpose(0, 1)[None]
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k_rot[0].transpose(0, 1)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v.reshape(tokens, num_kv_heads, head_dim)
    return q_rot[0].transpose(0, 1).contiguous()


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (*positions.shape, head_dim), laid out as Llama's rotary embedding lays them."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    angles = positions.to(torch.float64)[..., None] * inv_freq  # (..., D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (..., D): both halves see the same frequency
    return angles.cos().to(dtype), angles.sin().to(dtype)


def decode_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                norm_weight: torch.Tensor | None = None, eps: float = 1e-6, activation: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """A batch-1 decode projection with its neighbours: ``add_rms_norm``'s normed x (``norm_weight``: RMSNorm of x
    first; the residual stream is x itself), :func:`gemv`, then ``residual += y`` in place (returned) when a
    residual is given. The engine's unfused path: three launches."""
    if norm_weight is not None:
        x = add_rms_norm(x, torch.zeros_like(x), norm_weight, eps)[0]  # x + 0 is x exactly
    y = gemv(x, weight, bias, activation)
    if residual is None:
        return y
    residual.copy_(residual + y)
    return residual


def decode_qkv_rope_store_kv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             norm_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, *, num_heads: int,
                             num_kv_heads: int, eps: float = 1e-6) -> torch.Tensor:
    """The qkv projection of a decode step with its neighbours: :func:`decode_gemv` (RMSNorm, then the product),
    then :func:`rope_store_kv` (q rotated, returned; k rotated and v written into the caches at ``slots``)."""
    qkv = decode_gemv(x, weight, bias, norm_weight=norm_weight, eps=eps)
    return rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads=num_heads, num_kv_heads=num_kv_heads)

class GatedMLP(nn.Module):
    """The feed-forward block of Llama-style models: down(silu(gate(x)) * up(x)).

    Eager PyTorch runs it as three GEMMs and two elementwise kernels, with two (T, I) intermediates
    written to and read back from memory."""

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


def _expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, N, D) -> (B, H, N, D): each KV head serves H / Hkv consecutive query heads (GQA; MQA when Hkv=1)."""
    return k.repeat_interleave(heads // k.shape[1], dim=1)


def causal_mask(n_q: int, n_kv: int, device=None) -> torch.Tensor:
    """True where query i may see key j: j <= i + (n_kv - n_q). Aligned to the end, as FlashAttention-2 does, so a
    query block that continues a cached prefix sees the whole prefix. With n_q > n_kv the first n_q - n_kv queries
    see no key at all."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_kv, device=device)[None, :]
    return j <= i + (n_kv - n_q)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              sm_scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Textbook attention, softmax(Q Kᵀ · scale + M) V, materialising the (Nq, Nkv) score matrix per
    head.

    q: (B, H, Nq, D); k, v: (B, Hkv, Nkv, D), H a multiple of Hkv. ``mask``: an additive M
    broadcastable to (B, H, Nq, Nkv) (0 to keep, -inf to drop); ``causal=True`` adds the end-aligned
    causal mask (:func:`causal_mask`). Scores and P·V in the inputs' dtype, softmax in float32
    (float64 for float64 inputs). A query that sees no key at all gets output 0 (as FlashAttention-2
    defines it), not the NaN a plain softmax over nothing would give.
    """
    heads, n_q, head_dim = q.shape[1], q.shape[2], q.shape[3]
    n_kv = k.shape[2]
    scale = sm_scale if sm_scale is not None else head_dim ** -0.5
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k.transpose(-1, -2)).to(softmax_dtype) * scale  # (B, H, Nq, Nkv): the T² matrix
    if mask is not None:
        scores = scores + mask.to(softmax_dtype)
    if causal:
        scores = scores.masked_fill(~causal_mask(n_q, n_kv, q.device), float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key: 0, not NaN
    return p.to(q.dtype) @ v


def attention_score_bytes(batch: int, heads: int, n_q: int, n_kv: int, dtype: torch.dtype) -> int:
    """The most bytes of score matrices :func:`attention` holds at once for inputs of ``dtype``: three (B, H, Nq, Nkv)
    tensors in the softmax's dtype (float32, float64 for float64 inputs), the scaled scores, their softmax and its
    NaN-free copy. Inputs and output not counted. 12 bytes per score for 16-bit inputs: six times the scores in the
    inputs' dtype."""
    return 3 * batch * heads * n_q * n_kv * torch.promote_types(dtype, torch.float32).itemsize


def flash_attention_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                          sm_scale: float | None = None, block_m: int = 64, block_n: int = 64):
    """FlashAttention's algorithm in plain PyTorch: loop over query tiles and key/value tiles, keep
    per query row a running maximum ``m``, a running sum ``l`` and an unnormalised output ``acc``
    (the online softmax), and never build the full score matrix: only a (block_m, block_n) tile of
    it at a time. Causal: key tiles entirely above the diagonal are skipped, not computed and
    masked.

    Same arguments as :func:`attention` (no additive mask). Returns ``(out, lse)``: out like q, and
    the log-sum-exp of each query's scores, (B, H, Nq) float32 (float64 for float64 inputs), which
    the backward pass uses to recompute P without storing it.
    """
    batch, heads, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    scale = sm_scale if sm_scale is not None else head_dim ** -0.5
    acc_dtype = torch.promote_types(q.dtype, torch.float32)  # float32 for 16-bit inputs
    k, v = _expand_kv(k, heads).to(acc_dtype), _expand_kv(v, heads).to(acc_dtype)
    out = torch.zeros(batch, heads, n_q, head_dim, dtype=acc_dtype, device=q.device)
    lse = torch.full((batch, heads, n_q), float("-inf"), dtype=acc_dtype, device=q.device)
    offset = n_kv - n_q  # causal: query i sees keys j <= i + offset
    for m0 in range(0, n_q, block_m):
        m1 = min(m0 + block_m, n_q)
        q_tile = q[:, :, m0:m1].to(acc_dtype) * scale
        rows = (batch, heads, m1 - m0)
        m = torch.full(rows, float("-inf"), dtype=acc_dtype, device=q.device)  # running max per row
        l = torch.zeros(rows, dtype=acc_dtype, device=q.device)  # running sum of exp(score - m)
        # running sum of exp(score - m) * v
        acc = torch.zeros(*rows, head_dim, dtype=acc_dtype, device=q.device)
        last_key = min(n_kv, m1 + offset) if causal else n_kv  # past it: tiles above the diagonal
        for n0 in range(0, max(last_key, 0), block_n):
            n1 = min(n0 + block_n, n_kv)
            s = q_tile @ k[:, :, n0:n1].transpose(-1, -2)  # (B, H, tile_m, tile_n)
            if causal:  # only tiles on the diagonal have anything to mask
                keys = torch.arange(n0, n1, device=q.device)
                queries = torch.arange(m0, m1, device=q.device)
                s = s.masked_fill(~(keys[None, :] <= queries[:, None] + offset), float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row that saw no key yet
            correction = torch.exp(m - m_safe)  # rescale what was summed under the old maximum
            p = torch.exp(s - m_safe[..., None])
            l = l * correction + p.sum(dim=-1)
            acc = acc * correction[..., None] + p @ v[:, :, n0:n1]
            m = m_new
        seen = l > 0
        out[:, :, m0:m1] = torch.where(seen[..., None], acc / l.clamp_min(1e-30)[..., None], 0.0)
        lse[:, :, m0:m1] = torch.where(seen, m + torch.log(l.clamp_min(1e-30)), float("-inf"))
    return out.to(q.dtype), lse


def online_softmax_trace(scores: torch.Tensor, values: torch.Tensor, block: int) -> list[dict]:
    """The online softmax on one query row, tile by tile, for the notebook to step through.

    scores: (N,) one query's scores; values: (N, D). After each tile of ``block`` keys: the running max ``m``, the
    running sum ``l`` of exp(score - m), and the output so far ``acc / l``, which equals softmax over the keys seen
    so far times their values. The last step's output is the exact attention output.
    """
    m, l = float("-inf"), 0.0
    acc = torch.zeros(values.shape[1], dtype=torch.float64)
    steps = []
    for start in range(0, scores.shape[0], block):
        s, v = scores[start:start + block].double(), values[start:start + block].double()
        m_new = max(m, s.max().item())
        correction = math.exp(m - m_new) if m != float("-inf") else 0.0
        p = torch.exp(s - m_new)
        l = l * correction + p.sum().item()
        acc = acc * correction + p @ v
        m = m_new
        steps.append({"keys_seen": min(start + block, scores.shape[0]), "m": m, "l": l, "correction": correction,
                      "out": acc / l})
    return steps


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_starts: torch.Tensor, sm_scale: float | None = None,
) -> torch.Tensor:
    """Prefill attention over a paged KV cache: each sequence's new tokens attend, causally, to everything before
    them, a cached prefix included. The plain way: gather each sequence's pages, then :func:`attention` with the
    end-aligned causal mask (the new tokens are the sequence's last ones).

    q: (T, H, D), the new tokens of B sequences packed one after another: sequence b's are rows
    ``query_starts[b]`` to ``query_starts[b + 1] - 1`` (query_starts: (B + 1,) int32, starting at 0); their K and V
    are already in the cache. k_cache, v_cache: (num_blocks, block_size, Hkv, D); block_table: (B, max_blocks) int32;
    seq_lens: (B,) int32, each sequence's length including its new tokens. Returns (T, H, D).
    """
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    out = torch.empty_like(q)
    for b in range(block_table.shape[0]):
        n, start, end = int(seq_lens[b]), int(query_starts[b]), int(query_starts[b + 1])
        blocks = block_table[b, : -(-n // block_size)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1)[None]  # (1, Hkv, n, D)
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1)[None]
        out[start:end] = attention(q[start:end].transpose(0, 1)[None], k, v, causal=True, sm_scale=sm_scale)[0].transpose(0, 1)
    return out
