"""FlashAttention (forward and backward) in Triton, the algorithm of ``lessonlib.reference.flash_attention_tiled``.

Forward: one program per (query tile, batch x head). It streams the key/value tiles of its KV head through on-chip
memory, keeps the online-softmax state (running max ``m``, running sum ``l``, unnormalised output ``acc``) in
registers, and writes the output and the log-sum-exp (LSE) once. Scores never reach HBM.

Backward (FlashAttention-2): P is recomputed from Q, K and the saved LSE instead of being stored.
``delta_i = sum_d dO_i * O_i`` is one small PyTorch op. Then one kernel per key/value tile accumulates dK and dV
over every query tile and every query head of its GQA group (no atomics), and one kernel per query tile accumulates
dQ over the key/value tiles.

``flash_attention`` is the op a model calls: the custom op ``torch.ops.lessonlib.flash_attention`` (fake
implementation, autograd formula calling ``torch.ops.lessonlib.flash_attention_backward``) when autograd or
torch.compile needs it, the forward launcher directly otherwise.

Causal attention is aligned to the end (query i sees keys j <= i + Nkv - Nq). Key tiles entirely above the diagonal
are never visited; tiles that need no mask (fully visible, fully in bounds) run a mask-free loop, and only the
diagonal band and the ragged last tile pay for masking.

The kernels live in ``_flash_attention_forward.py`` and ``_flash_attention_backward.py``; this file holds what
launches them: the H200-tuned configurations, the input checks, the launchers and the op. Every name is importable
from here, kernels included.
"""

from __future__ import annotations

import math

import torch
import triton

from lessonlib import runtime
from lessonlib.ops._common import check_tensors, first_that_fits, launch
from lessonlib.ops._flash_attention_backward import _flash_attention_dkdv_kernel, _flash_attention_dq_kernel
from lessonlib.ops._flash_attention_forward import _attend_tiles, _flash_attention_forward_kernel  # noqa: F401
# (_attend_tiles is imported here for notebook 02, which shows it: the kernels live in the two modules above.)

HEAD_DIMS = (16, 32, 64, 128)


def key_tile_bounds(start_m: int, block_m: int, n_q: int, n_kv: int, causal: bool, block_n: int) -> tuple[int, int]:
    """The forward kernel's loop bounds for the query tile starting at ``start_m``, in plain Python: key tiles
    [0, full_hi) need no mask, [full_hi, hi) need one, and from hi on they are skipped (above the diagonal, or past
    the end). The kernel computes exactly these; notebook 02 draws them."""
    offset = n_kv - n_q
    if causal:
        hi = min(n_kv, min(start_m + block_m, n_q) + offset)
        full_hi = min((start_m + offset + 1) // block_n * block_n, n_kv // block_n * block_n)
    else:
        hi, full_hi = n_kv, n_kv // block_n * block_n
    hi = max(hi, 0)
    return max(min(full_hi, hi), 0), hi


def tile_plan(n_q: int, n_kv: int, block_m: int, block_n: int, causal: bool) -> torch.Tensor:
    """(query tiles, key tiles) int tensor: 0 skipped, 1 computed without a mask, 2 computed with a mask."""
    plan = torch.zeros(triton.cdiv(n_q, block_m), triton.cdiv(n_kv, block_n), dtype=torch.int64)
    for i, start_m in enumerate(range(0, n_q, block_m)):
        full_hi, hi = key_tile_bounds(start_m, block_m, n_q, n_kv, causal, block_n)
        plan[i, : triton.cdiv(full_hi, block_n)] = 1
        plan[i, full_hi // block_n: triton.cdiv(hi, block_n)] = 2
    return plan


def flash_attention_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes flash_attention takes here, a subset of ``runtime.supported_dtypes()`` (what the element-wise
    kernels take): the GPU's 16-bit dtypes (float16, and bfloat16 from sm_80 on); float32 and float16 in the
    interpreter. No float32 on a GPU: ``tl.dot`` would run it as TF32, a different function."""
    if not runtime.on_gpu():
        return (torch.float32, torch.float16)
    return tuple(d for d in (torch.float16, torch.bfloat16) if d in runtime.supported_dtypes())


# Configurations, best first: each launcher takes the first whose shared memory fits the GPU (runtime.gpu_profile()).
# The order is the H200 sweep's (benchmarks/bench_flash_attention.py, lessonlib/results/flash-attention-h200.json,
# D=128 non-causal: 128x128/8 warps/3 stages 500 TFLOP/s, 128x64/8/3 476, 64x64/4/3 473, 64x64/4/2 436), so a
# Hopper GPU keeps the tuned first rung and a smaller GPU the fastest of the rest that fits; the smaller GPUs were not
# swept. Rungs are (BLOCK_M, BLOCK_N, num_warps, num_stages).
FORWARD_LADDER = {
    64: ((64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2)),  # H200 at D=64: 64x64, four programs per SM
    128: ((128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2)),
}
# sm_75 (T4): Triton 3.x lowers tl.dot to FMA there, no tensor cores, and nothing is pipelined (no cp.async), so
# registers decide, not stages. Compiled for sm_75 with Triton 3.9 (tools/compile_targets.py --registers, ptxas -v of
# the wheel), forward at D=128: 64x32 spills 9 KB, 32x32 1.4 KB (larger tiles were not measured; 128x128 and 64x64
# need 128 and 64 KB of shared memory there); 32x16 and 16x32 compile without spills (237 and 229 registers, 24 KB
# of shared memory). At D=64: 64x32
# spills 940 B, 32x32 none (246 registers). 32x16 rather than 16x32 at D=128: each program re-reads all of K and V,
# so twice the query rows per program halves that traffic. Not timed on a T4.
FORWARD_LADDER_SM75 = {
    64: ((32, 32, 4, 1),),
    128: ((32, 16, 4, 1),),
}
# The dK/dV kernel keeps a key tile (BLOCK_N) and streams query tiles (BLOCK_M) past it; the dQ kernel the other way
# round, so the kept tile is the large one (as in Triton's fused-attention tutorial). H200 sweep at D=128: 32/64-row
# tiles, 4 warps, 3 stages 330 TFLOP/s, 2 stages 314. Rungs: (small tile, large tile, num_warps, num_stages).
BACKWARD_LADDER = ((32, 64, 4, 3), (32, 64, 4, 2), (16, 32, 4, 2))
# sm_75: the smallest tiles tl.dot takes. Compiled as above: no spills at D=64; at D=128 255 registers and 804 B
# (dK/dV) and 560 B (dQ) of spill stores, where 32/64-row tiles spill 6 KB and 3.6 KB and need 80 KB.
BACKWARD_LADDER_SM75 = ((16, 32, 4, 1),)


def _rung(rung) -> dict:
    block_m, block_n, num_warps, num_stages = rung
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)


def forward_shared_memory(config: dict, head_dim: int, profile: runtime.GPUProfile, itemsize: int = 2) -> int:
    """Bytes of shared memory the forward kernel asks for with ``config`` on ``profile``'s architecture: an upper
    bound, checked against the compiled kernels of every architecture by tests/ops/test_compile_targets.py.

    The pipeliner keeps ``num_stages`` K and V tiles in flight on Hopper (async copies ahead of wgmma), one fewer on
    Ampere, Ada and Blackwell's sm_120 (cp.async ahead of mma: no wgmma there), and Q sits in shared memory beside
    them. Compiled at D=128, 3 stages, 128x128 tiles:
    sm_90 3 x 64 KB + 32 KB = 224 KB, sm_80 2 x 64 KB + 32 KB = 160 KB, both exactly the formula. Below Hopper, tiles
    of 64 query rows or fewer also pass P through shared memory on its way into the second product (compiled sm_80,
    D=128, 64x64, 3 stages: 88 KB = 2 x 32 + 16 + 8); at 128 rows the compiled kernels need no extra buffer for it.
    sm_75: see :func:`_sm75_shared_memory`."""
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    if not profile.triton_tensor_cores:
        return _sm75_shared_memory(itemsize * (block_m * head_dim + 2 * block_n * head_dim + block_m * block_n))
    kv = 2 * block_n * head_dim * itemsize
    q = block_m * head_dim * itemsize
    p = block_m * block_n * itemsize if block_m <= 64 else 0
    stages = config.get("num_stages", 3)
    if profile.has_wgmma:
        return stages * kv + q
    return max(1, stages - 1) * kv + q + p


def _sm75_shared_memory(operand_bytes: int) -> int:
    """sm_75, where Triton's tl.dot is FMA: no async copies to pipeline, but every operand of every product passes
    through shared memory on its way into the FMA layout. Compiled for sm_75 (Triton 3.9): the forward at D=128 and
    128x128 tiles needs exactly its operands (128 KB), at 64x64 64 KB for 56 KB of operands, at 64x32 48 KB for 36 KB
    (1.33x); the dK/dV kernel at 16x32 40 KB for 34 KB. Reduction scratch and padding come on top: half is allowed."""
    return 3 * operand_bytes // 2


def backward_shared_memory(config: dict, head_dim: int, profile: runtime.GPUProfile, itemsize: int = 2) -> int:
    """Upper bound on the shared memory of either backward kernel with ``config`` (one kernel's tiles), checked like
    :func:`forward_shared_memory`. Each streams two tiles of the small size (Q and dO, or K and V) and keeps two of
    the large one; scores and their gradient (small x large) pass through shared memory between products."""
    small, large = sorted((config["BLOCK_M"], config["BLOCK_N"]))
    if not profile.triton_tensor_cores:  # the dK/dV kernel's four products: K, Q; P, dO; V, dO; dS, Q
        return _sm75_shared_memory(itemsize * (2 * large * head_dim + 4 * small * head_dim + 2 * small * large))
    streamed = 2 * small * head_dim * itemsize
    kept = 2 * large * head_dim * itemsize
    scores = 2 * small * large * itemsize
    stages = config.get("num_stages", 3)
    buffers = stages if profile.has_wgmma else max(1, stages - 1) if profile.arch >= 80 else 1
    return buffers * streamed + kept + scores


def forward_config(head_dim: int, profile: runtime.GPUProfile | None = None) -> dict:
    """Tiles, warps and stages of the forward kernel for ``profile`` (default: this GPU's, see runtime.gpu_profile):
    the first rung of the ladder above whose shared memory fits. In the interpreter, small tiles keep each step
    cheap."""
    profile = profile or runtime.gpu_profile()
    if profile is None:
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1)
    ladder = (FORWARD_LADDER_SM75 if not profile.triton_tensor_cores else FORWARD_LADDER)[64 if head_dim <= 64 else 128]
    return first_that_fits("flash_attention", [_rung(r) for r in ladder],
                           lambda c: forward_shared_memory(c, head_dim, profile), profile)


def backward_config(head_dim: int, profile: runtime.GPUProfile | None = None) -> dict:
    """Tiles, warps and stages for the two backward kernels, each its own (see BACKWARD_LADDER), for ``profile``
    (default: this GPU's)."""
    profile = profile or runtime.gpu_profile()
    if profile is None:
        small = dict(BLOCK_M=16, BLOCK_N=16, num_warps=1)
        return {"dkdv": small, "dq": small}
    ladder = BACKWARD_LADDER if profile.triton_tensor_cores else BACKWARD_LADDER_SM75
    dkdv = first_that_fits("flash_attention backward", [_rung(r) for r in ladder],
                           lambda c: backward_shared_memory(c, head_dim, profile), profile)
    # dQ keeps the query tile: the same sizes, the other way round.
    return {"dkdv": dkdv, "dq": dict(dkdv, BLOCK_M=dkdv["BLOCK_N"], BLOCK_N=dkdv["BLOCK_M"])}


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Every check made before a launch: rank, batch, heads, head_dim, dtype, device, lengths."""
    check_tensors("flash_attention", q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be (B, H, N, D), got shape {tuple(t.shape)}")
    if q.dtype not in flash_attention_dtypes():
        where = "on the GPU" if runtime.on_gpu() else "in Triton's interpreter"
        why = f" ({runtime.why_not_bfloat16()})" if q.dtype == torch.bfloat16 else ""
        raise TypeError(f"flash_attention: dtype {q.dtype} is not supported {where}{why}; use one of "
                        f"{', '.join(map(str, flash_attention_dtypes()))}")
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, heads, n_q, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"flash_attention: batch sizes differ: q has {batch}, k and v have {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"flash_attention: head_dim differs: q has {head_dim}, k and v have {k.shape[3]}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"flash_attention: head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if heads % k.shape[1]:
        raise ValueError(f"flash_attention: {heads} query heads is not a multiple of {k.shape[1]} KV heads")
    if n_q < 1 or k.shape[2] < 1:
        raise ValueError(f"flash_attention: sequence lengths must be >= 1, got Nq={n_q}, Nkv={k.shape[2]}")


def _forward(q, k, v, causal, sm_scale, config=None):
    batch, heads, n_q, head_dim = q.shape
    kv_heads, n_kv = k.shape[1], k.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, heads, n_q, dtype=torch.float32, device=q.device)
    config = config or forward_config(head_dim)
    grid = (triton.cdiv(n_q, config["BLOCK_M"]), batch * heads)
    launch(_flash_attention_forward_kernel, grid, q, k, v, out, lse,
           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
           v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
           heads, n_q, n_kv, sm_scale, GROUP=heads // kv_heads, CAUSAL=causal, HEAD_DIM=head_dim, **config)
    return out, lse


def backward(q, k, v, out, lse, grad_out, causal, sm_scale, config=None):
    """dq, dk, dv from the forward's output and log-sum-exp: the two backward kernels alone. ``config`` overrides
    their tiles and warps (see :func:`backward_config`): a knob for benchmarks; autograd uses the default."""
    batch, heads, n_q, head_dim = q.shape
    kv_heads, n_kv = k.shape[1], k.shape[2]
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(-1)  # (B, H, Nq): rowsum(dO * O) = rowsum(P * dP)
    dq = torch.empty(batch, heads, n_q, head_dim, dtype=q.dtype, device=q.device)
    dk = torch.empty(batch, kv_heads, n_kv, head_dim, dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    config = config or backward_config(head_dim)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2))
    meta = dict(GROUP=heads // kv_heads, CAUSAL=causal, HEAD_DIM=head_dim)
    dkdv, dq_tiles = config["dkdv"], config["dq"]
    launch(_flash_attention_dkdv_kernel, (triton.cdiv(n_kv, dkdv["BLOCK_N"]), batch * kv_heads),
           q, k, v, grad_out, lse, delta, dk, dv, *strides, heads, kv_heads, n_q, n_kv, sm_scale, **meta, **dkdv)
    launch(_flash_attention_dq_kernel, (triton.cdiv(n_q, dq_tiles["BLOCK_M"]), batch * heads),
           q, k, v, grad_out, lse, delta, dq, *strides, heads, n_q, n_kv, sm_scale, **meta, **dq_tiles)
    return dq, dk, dv


# --- the op: torch.ops.lessonlib.flash_attention, with a fake implementation and a gradient ---------------------
# Registered as custom ops (forward and backward alike) so that torch.compile treats each as one opaque node: Dynamo
# cannot trace into a Triton launch in interpreter mode, and AOTAutograd traces the backward with fake tensors.

@torch.library.custom_op("lessonlib::flash_attention", mutates_args=())
def _flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs(q, k, v)
    return _forward(q, k, v, causal, sm_scale)


@_flash_attention_op.register_fake
def _(q, k, v, causal, sm_scale):
    check_inputs(q, k, v)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(q.shape[:3], dtype=torch.float32, device=q.device))


@torch.library.custom_op("lessonlib::flash_attention_backward", mutates_args=())
def _flash_attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                 lse: torch.Tensor, grad_out: torch.Tensor, causal: bool,
                                 sm_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(q, k, v, out, lse, grad_out, causal, sm_scale)


@_flash_attention_backward_op.register_fake
def _(q, k, v, out, lse, grad_out, causal, sm_scale):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device))


def _save_for_backward(ctx, inputs, output):
    q, k, v, causal, sm_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)  # returned as a constant (return_lse=True): no gradient flows through it
    ctx.causal, ctx.sm_scale = causal, sm_scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.lessonlib.flash_attention_backward(q, k, v, out, lse, grad_out, ctx.causal, ctx.sm_scale)
    return dq, dk, dv, None, None


_flash_attention_op.register_autograd(_backward, setup_context=_save_for_backward)
_FLASH_ATTENTION = torch.ops.lessonlib.flash_attention.default


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    sm_scale: float | None = None, return_lse: bool = False, config: dict | None = None):
    """Attention without the score matrix, like ``lessonlib.reference.attention`` (no additive mask), with autograd.

    q: (B, H, Nq, D); k, v: (B, Hkv, Nkv, D), H a multiple of Hkv (MHA, GQA, MQA); any Nq, Nkv >= 1; D in
    {16, 32, 64, 128}; last dimension contiguous, other strides free. ``causal=True`` aligns the mask to the end
    (query i sees keys j <= i + Nkv - Nq); a query that sees no key gets 0. Gradients flow to q, k and v through
    the Triton backward. ``return_lse=True`` also returns the log-sum-exp per query, (B, H, Nq) float32, as a
    constant (no gradient flows through it). ``config`` overrides the forward kernel's tiles and warps
    (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``; see :func:`forward_config`): a knob for benchmarks,
    eager and without autograd only.

    Goes through the custom op ``torch.ops.lessonlib.flash_attention`` when autograd must record it or
    torch.compile traces it, straight to the launcher otherwise.
    """
    needs_op = (getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False)
                or getattr(v, "requires_grad", False) or torch.compiler.is_compiling())
    if config is not None:
        if needs_op and (torch.is_grad_enabled() or torch.compiler.is_compiling()):
            raise ValueError("flash_attention: config is a benchmark knob of the eager forward launcher; it cannot be "
                             "used under torch.compile or with inputs that require grad")
        if not {"BLOCK_M", "BLOCK_N"} <= set(config):
            raise ValueError(f"flash_attention: config needs BLOCK_M and BLOCK_N, got {sorted(config)}")
        needs_op = False
    if needs_op:
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        out, lse = _FLASH_ATTENTION(q, k, v, bool(causal), float(scale))
    else:
        check_inputs(q, k, v)
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        out, lse = _forward(q, k, v, bool(causal), float(scale), config)
    return (out, lse) if return_lse else out
