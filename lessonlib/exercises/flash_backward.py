"""Lesson 02's backward exercise (notebook 02_flash_attention): the FlashAttention backward for one key tile, dK and
dV. A module of its own, beside :mod:`~lessonlib.exercises.flash_attention` (the forward's checkers).

The student's kernel runs one program per (key tile, batch x head). It keeps its tile of K and V and its dK, dV
accumulators on chip and loops over the query tiles, recomputing P = exp(s - lse) from the forward's saved
log-sum-exp instead of reading a stored (N, N) matrix:

    dV_j += P_ij^T dO_i,   dP_ij = dO_i V_j^T,   dS_ij = P_ij * (dP_ij - delta_i),   dK_j += scale * dS_ij^T Q_i

with delta_i = rowsum(dO_i * O_i). The launcher (given) computes lse and delta in float32 as the forward would
have saved them; the checker compares dK and dV with float64 autograd through ``reference.attention``.
"""

from __future__ import annotations

import math

import torch

from lessonlib import reference, runtime
from lessonlib.exercises._checking import (ExerciseFailed, _diagnose, _not_implemented_output, _require_kernel,
                                          passed)
from lessonlib.exercises._guards import Guards, launch_guards, launch_kernel
from lessonlib.exercises.triton_basics import _run, check_guards, guarded
from lessonlib.testing import ROUNDINGS, to_float64

# (batch, heads, n_q, n_kv, head_dim): ragged tiles, Nq != Nkv, several tiles each way, and one key last: a single
# key's dK is 0 whatever the mistake (its softmax is 1), so a mistake is named on the shapes before it; at one key a
# mistake that only scales dK's rounding noise (no final sm_scale) could fail unnamed.
FLASH_DKDV_CASES = (
    (1, 2, 7, 20, 16),
    (2, 1, 37, 9, 32),
    (1, 2, 45, 33, 16),
    (1, 1, 1, 1, 16),
)


def flash_dkdv_config() -> dict:
    """16 x 16 tiles in the interpreter (the checker's lengths span several tiles each way), 32 x 32 on a GPU."""
    return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4) if runtime.on_gpu() else dict(BLOCK_M=16, BLOCK_N=16, num_warps=1)


def saved_statistics(q, k, v, grad_out):
    """What the forward saves for the backward, in float32: lse (B, H, Nq), the natural log-sum-exp of each query's
    scaled scores, and delta (B, H, Nq) = rowsum(dO * O)."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v.float()
    return lse.contiguous(), (grad_out.float() * out).sum(-1).contiguous()


def flash_dkdv(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
               config: dict | None = None, guards: Guards | None = None):
    """Launch the exercise's kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, n_q, n_kv,
    sm_scale, BLOCK_M, BLOCK_N, HEAD_DIM) on a grid of (Nkv / BLOCK_N, B * H). q, grad_out: (B, H, Nq, D); k, v:
    (B, H, Nkv, D), as many heads as q (no GQA here), all contiguous after this call. Returns (dk, dv) like k; both
    sit in guarded buffers, and a store outside them fails. ``guards``: the checker's
    (:mod:`~lessonlib.exercises._guards`)."""
    import triton

    from lessonlib.ops.flash_attention import check_inputs

    check_inputs(q, k, v)
    if k.shape[1] != q.shape[1] or grad_out.shape != q.shape or grad_out.dtype != q.dtype:
        raise ValueError(f"flash_dkdv: k, v need q's heads and grad_out q's shape and dtype; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, grad_out {tuple(grad_out.shape)} {grad_out.dtype}")
    q, k, v, grad_out = (t.contiguous() for t in (q, k, v, grad_out))
    batch, heads, n_q, head_dim = q.shape
    n_kv = k.shape[2]
    config = config or flash_dkdv_config()
    lse, delta = saved_statistics(q, k, v, grad_out)
    guard = 2 * config["BLOCK_N"] * head_dim  # a whole tile past the end stays inside it
    grads = [guarded(1, k.numel(), k.dtype, guard) for _ in range(2)]
    (dk, dk_buffer), (dv, dv_buffer) = ((view[0].view(k.shape), buffer) for view, buffer in grads)
    grid = (triton.cdiv(n_kv, config["BLOCK_N"]), batch * heads)
    with launch_guards("flash_dkdv", guards) as guards:
        if guards is not None:
            dk, dv = guards.track(dk, output=True), guards.track(dv, output=True)
        launch_kernel(guards, "flash_dkdv", kernel, grid, q, k, v, grad_out, lse, delta, dk, dv, n_q, n_kv,
                      head_dim ** -0.5, HEAD_DIM=head_dim, **config)
    for name, view, buffer in (("dk", dk, dk_buffer), ("dv", dv, dv_buffer)):
        check_guards("flash_dkdv", name, view.view(-1), buffer, "Mask the stores with keys < n_kv.")
    return dk, dv


def _magnitudes(q64, k64, v64, do64):
    """The terms' largest magnitudes for dK and dV: testing.check_attention's derivation, without GQA or a mask."""
    scale = q64.shape[-1] ** -0.5
    scores = (q64 @ k64.transpose(-1, -2)) * scale
    p = torch.softmax(scores, dim=-1)
    column_sums = p.sum(dim=-2).max().item()
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    recompute = 1.0 + (scores.abs() + lse.abs()).max().item() * math.log2(math.e)
    d_p = (do64.abs() * v64.abs().amax(dim=-2, keepdim=True)).sum(dim=-1).max().item()
    return {"dk": scale * d_p * q64.abs().max().item() * column_sums * recompute,
            "dv": do64.abs().max().item() * column_sums * recompute}


def _mistakes(q64, k64, v64, do64, block_m: int):
    """(explanation, float64 dk, float64 dv) of known mistakes."""
    scale = q64.shape[-1] ** -0.5
    scores = (q64 @ k64.transpose(-1, -2)) * scale
    p = torch.softmax(scores, dim=-1)
    d_p = do64 @ v64.transpose(-1, -2)
    delta = (do64 * (p @ v64)).sum(-1, keepdim=True)
    right_dk, right_dv = scale * (p * (d_p - delta)).transpose(-1, -2) @ q64, p.transpose(-1, -2) @ do64
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    p_unscaled = torch.exp(q64 @ k64.transpose(-1, -2) - lse)  # s taken without sm_scale, the lse with it
    return [("dK without the final scale gives: dK = scale * dS^T Q, the scale of the scores' chain rule",
             right_dk / scale, right_dv),
            ("dS = P * dP, without subtracting delta, gives: dS = P * (dP - delta), delta_i = rowsum(dO_i * O_i) "
             "from delta_ptr", scale * (p * d_p).transpose(-1, -2) @ q64, right_dv),
            ("P recomputed from scores without sm_scale gives: s = (Q K^T) * sm_scale, the scores the forward's "
             "lse was taken over", scale * (p_unscaled * (d_p - delta)).transpose(-1, -2) @ q64,
             p_unscaled.transpose(-1, -2) @ do64),
            ("dV = P^T dO with P not normalised (exp(s), lse not subtracted) gives: P = exp(s - lse)",
             right_dk, torch.exp(scores).transpose(-1, -2) @ do64),
            (f"a loop over the first query tile only (BLOCK_M = {block_m}) gives: every query contributes to every "
             "key's dK and dV, for start_m in range(0, n_q, BLOCK_M)",
             scale * (p * (d_p - delta))[..., :block_m, :].transpose(-1, -2) @ q64[..., :block_m, :],
             p[..., :block_m, :].transpose(-1, -2) @ do64[..., :block_m, :])]


def check_flash_dkdv_kernel(kernel) -> None:
    """``kernel``: the exercise's @triton.jit dK/dV kernel, launched by :func:`flash_dkdv`. dK and dV against
    float64 autograd through ``reference.attention`` (non-causal), on N = 1, 7, 9, 20, 33, 37, 45, in every dtype
    the FlashAttention kernels take here, outputs NaN inside a guard; a wrong answer is matched to known mistakes."""
    from lessonlib.ops.flash_attention import flash_attention_dtypes

    _require_kernel("flash_dkdv", kernel)
    for dtype in flash_attention_dtypes():
        for batch, heads, n_q, n_kv, head_dim in FLASH_DKDV_CASES:
            q, grad_out = (torch.randn(batch, heads, n_q, head_dim, device=runtime.device()).to(dtype) for _ in "qo")
            k, v = (torch.randn(batch, heads, n_kv, head_dim, device=runtime.device()).to(dtype) for _ in "kv")
            where = f"q {tuple(q.shape)}, k/v {tuple(k.shape)}, {str(dtype).removeprefix('torch.')}"
            guards = Guards("flash_dkdv", "store dK and dV for its tile of keys", {"dk": "Mask the stores with keys < n_kv.", "dv": "Mask the stores with keys < n_kv."})
            dk, dv = _run("flash_dkdv", lambda: flash_dkdv(kernel, q, k, v, grad_out, guards=guards), (q, k, v))
            guards.certify(dk, dv)
            with guards.judged():
                truth = [t.requires_grad_() for t in to_float64(q, k, v)]
                reference.attention(*truth).backward(grad_out.double())
                low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                reference.attention(*low).backward(grad_out)
                q64, k64, v64, do64 = (t.detach().cpu() for t in (*truth, grad_out.double()))
                terms = _magnitudes(q64, k64, v64, do64)
                mistakes = _mistakes(q64, k64, v64, do64, flash_dkdv_config()["BLOCK_M"])
                # dV first: it has no cancellation, so a wrong P shows there even where dK's truth is 0 (one key)
                for name, got, want, lowp, index in (("dv", dv, truth[2].grad, low[2].grad, 2),
                                                     ("dk", dk, truth[1].grad, low[1].grad, 1)):
                    if got.isnan().all():
                        raise ExerciseFailed(f"flash_dkdv: not implemented yet: the kernel stored no {name} (it is still "
                                             "NaN, as the checker fills it).")
                    _not_implemented_output(f"flash_dkdv {name}", got, want)
                    allowance = ROUNDINGS * torch.finfo(dtype).eps * terms[name]  # the cancelling terms' roundings
                    _diagnose(f"flash_dkdv {name}", got.cpu(), want.cpu(), lowp.cpu(),
                              [(m[0], m[index]) for m in mistakes], where, allowance)
    passed(f"flash_dkdv: your kernel's dK and dV match float64 autograd on {len(FLASH_DKDV_CASES)} shapes (N = 1 to 45, "
          f"Nq != Nkv) in {', '.join(str(d).removeprefix('torch.') for d in flash_attention_dtypes())}"
          f"{' on the GPU' if runtime.on_gpu() else ' (Triton interpreter)'}")
