"""Checking a fast kernel against its reference: used by tests/ and by the exercise checkers alike.

Tolerance, derived rather than guessed (flash-attention's rule): compute the reference twice, once in float64
(the truth) and once in the kernel's own dtype with plain PyTorch (what an honest low-precision implementation
gets). The kernel passes when its worst error against the truth is at most twice the worst error of that
low-precision reference, plus two units of rounding of the output dtype at the output's largest magnitude. The
two units are the fused kernel's right to round at other steps than eager PyTorch does: it keeps intermediates in
float32 and reduces in another order (for add_rms_norm in float32 that alone measured up to 1.6 units, where the
PyTorch reference, whose statistic is nearly exact, stays at half a unit). NaN or Inf where the truth is finite
never passes.

Attention adds one derived allowance (``attention_allowance``): its scores are float32 sums on every path, and
which roundings they get depends on the summation order, so in float32 the kernel's and the reference's errors are
two independent draws of the same size, and "twice the reference's" fails now and then (measured: 2 runs in 60 at
head_dim 128). Each score s_ij = scale * q_i . k_j is then off by about a rounding of its terms'
size, scale * sum_d |q_id k_jd|; p_ij = exp(s_ij - m_i) by that much relative; the output o_i = sum_j p_ij v_j by
at most that times max_j |v_j - o_i| <= 2 max|V|. Two such float32 roundings are allowed, over the worst pair. In
float16/bfloat16 this is about 1% of the tolerance; in float32 it is a bound 10-25 times the rest of the tolerance
(measured, paged decode), still hundreds of times below the error of TF32 products, the float32 mistake to catch.
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import torch

ERROR_FACTOR = 2.0
ROUNDINGS = 2
# Each is called as observe(name, dtype, worst_error, tolerance) by every check_close before it passes or fails:
# tests/tolerance_hunt.py logs each check's error as a fraction of its tolerance.
OBSERVERS: list = []


def to_float64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().to(torch.float64) for t in tensors]


def tolerance(truth: torch.Tensor, low_precision: torch.Tensor, dtype: torch.dtype,
              magnitude: float | None = None) -> float:
    reference_error = (low_precision.double() - truth).abs().max().item() if truth.numel() else 0.0
    if magnitude is None:
        magnitude = truth.abs().max().item() if truth.numel() else 0.0
    rounding = torch.finfo(dtype).eps * max(magnitude, 1e-30)
    return ERROR_FACTOR * reference_error + ROUNDINGS * rounding


def attention_allowance(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None) -> float:
    """The float32 score roundings' share of an attention output's error (module docstring), for inputs of any
    layout whose last dimension is the head dimension: dense (batch, heads, tokens, D), decode (batch, heads, D),
    or a paged pool (blocks, block_size, kv_heads, D). Every query row is paired with every key row, a bound on the
    pairs attention really forms."""
    head_dim = q.shape[-1]
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    q_abs, k_abs = (t.detach().abs().reshape(-1, head_dim).float() for t in (q, k))
    if not q_abs.numel() or not k_abs.numel():
        return 0.0
    terms = max((rows @ k_abs.T).max().item() for rows in q_abs.split(1024))
    return ROUNDINGS * torch.finfo(torch.float32).eps * scale * terms * 2 * v.detach().abs().max().item()


def check_close(name: str, out: torch.Tensor, truth: torch.Tensor, low_precision: torch.Tensor,
                magnitude: float | None = None, allowance: float = 0.0) -> None:
    """Raise AssertionError, with a message a student can act on, unless ``out`` is as close to the float64
    ``truth`` as the tolerance above allows.

    ``magnitude``: where an output is a sum of terms that cancel (a gradient through softmax: P * (dP - delta),
    exactly 0 when a query sees a single key), the roundings are those of the terms, not of the small result; pass
    the terms' largest magnitude. By default it is the output's. ``allowance``: a further absolute error the caller
    derives (attention: ``attention_allowance``)."""
    if tuple(out.shape) != tuple(truth.shape):
        raise AssertionError(f"{name}: shape {tuple(out.shape)}, expected {tuple(truth.shape)}")
    if out.dtype != low_precision.dtype:
        raise AssertionError(f"{name}: dtype {out.dtype}, expected {low_precision.dtype} (the input dtype)")
    got = out.detach().double().cpu()
    truth = truth.cpu()
    bad = ~torch.isfinite(got) & torch.isfinite(truth)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {got.numel()} elements are NaN/Inf (first at index {first}); "
            "outputs start as NaN in these checks, so these elements were probably never written"
        )
    err = (got - truth).abs()
    tol = tolerance(truth, low_precision.cpu(), out.dtype, magnitude) + allowance
    worst = err.max().item() if err.numel() else 0.0
    for observe in OBSERVERS:
        observe(name, out.dtype, worst, tol)
    if worst > tol:
        where = tuple(int(i) for i in (err == err.max()).nonzero()[0])
        raise AssertionError(
            f"{name}: max error {worst:.3g} at index {where} (got {got[where].item():.6g}, expected "
            f"{truth[where].item():.6g}); allowed {tol:.3g} = {ERROR_FACTOR:g} x the {out.dtype} reference's own "
            f"error + {ROUNDINGS} roundings" + (f" + {allowance:.3g} derived (float32 roundings)" if allowance else "")
        )


def _nan_filled(factory):
    def make(*args, **kwargs):
        t = factory(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    return make


@contextlib.contextmanager
def poisoned_outputs():
    """Inside this block, ``torch.empty`` and ``torch.empty_like`` return NaN-filled tensors, so any output
    element a kernel fails to write shows up as NaN instead of as leftover memory that happens to look right."""
    with mock.patch.object(torch, "empty", _nan_filled(torch.empty)), \
            mock.patch.object(torch, "empty_like", _nan_filled(torch.empty_like)):
        yield


def check_attention(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, name: str = "flash_attention"):
    """Check an attention function's output and its gradients for q, k and v against float64 autograd through
    ``lessonlib.reference.attention``, each within the tolerance rule above. ``fn(q, k, v, causal=...)`` may return
    ``out`` or ``(out, lse)``. Outputs and gradients start as NaN (poisoned). Returns the output.

    Two effects set the rounding allowance of the gradients, each from the algorithm rather than from a guess:

    * Cancellation. dQ_i = scale * sum_j P_ij (dP_ij - delta_i) K_j with dP = dO V^T and delta_i = sum_j P_ij dP_ij
      is exactly 0 when a query sees a single key, so roundings scale with the terms, not the (possibly zero)
      result. dP_ij and delta_i are themselves dot products over D whose roundings (another summation order in
      the kernel) scale with their terms: both are bounded by dPt = max_i sum_d |dO_id| * max_j |V_jd| (O is a
      convex combination of V's rows). So: scale * dPt * max|K| for dQ (a row of P sums to 1), and
      scale * dPt * max|Q| * the largest column sum of P for dK, which sums over queries and the GQA group's heads.
      (Measured with max|dP| in its place: 1 of 59 float32 dQ checks failed, at 1.3x, one of the 6 at N=1.)
    * Recomputing P. A FlashAttention backward rebuilds P_ij = exp(s_ij - lse_i) from the saved log-sum-exp
      instead of storing it (in log2 units: exp2(s_ij * log2 e - lse_i * log2 e)). s_ij and lse_i are each
      rounded at their own size, so the argument is off by about (|s_ij| + |lse_i|) * log2 e roundings, and P by
      that many relative roundings. Every gradient's allowance is multiplied by (1 + X), X the largest
      (|s_ij| + |lse_i|) * log2 e over visible pairs (about 10 for random inputs); dV = P^T dO (no cancellation)
      gets max|dO| * the largest column sum of P * (1 + X).
    """
    from lessonlib import reference

    grad_out = torch.randn(q.shape, dtype=torch.float32, device=q.device).to(q.dtype)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with poisoned_outputs():
        out = fn(*leaves, causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad_out)
    truth_leaves = [t.requires_grad_() for t in to_float64(q, k, v)]
    truth = reference.attention(*truth_leaves, causal=causal)
    truth.backward(grad_out.double())
    low_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    low = reference.attention(*low_leaves, causal=causal)
    low.backward(grad_out)
    check_close(name, out, truth, low, allowance=attention_allowance(q, k, v))

    q64, k64, v64 = (t.detach() for t in truth_leaves)
    group, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    scores = (q64 @ k64.repeat_interleave(group, dim=1).transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~reference.causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    column_sums = p.unflatten(1, (k.shape[1], group)).sum(dim=(2, 3)).max().item()
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    visible = torch.isfinite(scores) & torch.isfinite(lse)
    exponent = (scores.abs() + lse.abs())[visible].max().item() * math.log2(math.e) if visible.any() else 0.0
    v_columns = v64.abs().amax(dim=-2, keepdim=True).repeat_interleave(group, dim=1)  # max_j |V_jd| per head
    d_p = (grad_out.double().abs() * v_columns).sum(dim=-1).max().item()  # dPt above
    recompute = 1.0 + exponent
    magnitudes = {"q": scale * d_p * k64.abs().max().item() * recompute,
                  "k": scale * d_p * q64.abs().max().item() * column_sums * recompute,
                  "v": grad_out.double().abs().max().item() * column_sums * recompute}
    for which, ours, theirs, lowp in zip("qkv", leaves, truth_leaves, low_leaves):
        if ours.grad is None:
            raise AssertionError(f"{name}: no gradient reached {which}")
        check_close(f"{name} d{which}", ours.grad, theirs.grad, lowp.grad, magnitudes[which])
    return out


def swiglu_grad_magnitudes(args, grads) -> dict[str, float]:
    """d(gate) = g * up * s * (1 + gate * (1 - s)), s = sigmoid(gate): near silu's minimum (gate ~ -1.28) the last
    factor cancels to 0, and the roundings are those of its terms, |g * up * s| * (1 + |gate| * (1 - s)), not of the
    small result (a single element there failed the result's 2 roundings about once in 100 draws; measured with
    this magnitude: at most 1.9 roundings in 4,000). d(up) = g * silu(gate) has no cancellation."""
    gate, up = args
    s = torch.sigmoid(gate)
    return {"gate": (grads[0].abs() * up.abs() * s * (1 + gate.abs() * (1 - s))).max().item()}


# A float32 sigmoid's own roundings, relative: exp (within 1 unit; CUDA's fast exp 2), the add and the reciprocal.
SIGMOID_UNITS = 3


def swiglu_allowance(gate: torch.Tensor, up: torch.Tensor) -> float:
    """The float32 sigmoid's share of swiglu's error: silu(gate) * up is off by up to :data:`SIGMOID_UNITS`
    relative, a draw of the kernel's own. The reference's error does not bound it where a tensor has few elements
    (at (1, 1) its one error can be a lucky near-zero sample: 0.64 of the plain rule's tolerance in 20 runs)."""
    gate, up = (t.detach().double() for t in (gate, up))
    if not gate.numel():
        return 0.0
    silu = gate * torch.sigmoid(gate)
    return SIGMOID_UNITS * torch.finfo(torch.float32).eps * (silu * up).abs().max().item()


def swiglu_grad_allowances(args, grads) -> dict[str, float]:
    """The sigmoid's share (:func:`swiglu_allowance`) of swiglu's output and gradients: d(up) = g * silu(gate) carries
    it once; d(gate) = g * up * s * (1 + gate * (1 - s)) through s and 1 - s, whose absolute error is s's, so at
    most |g * up * s| * (1 + |gate|)."""
    (gate, up), (g,) = args, grads
    if not gate.numel():
        return {}
    s, unit = torch.sigmoid(gate), SIGMOID_UNITS * torch.finfo(torch.float32).eps
    return {"output 0": swiglu_allowance(gate, up), "up": unit * (g * gate * s).abs().max().item(),
            "gate": unit * (g * up * s * (1 + gate.abs())).abs().max().item()}


def float32_sum_allowance(terms: torch.Tensor) -> float:
    """The float32 roundings of a sum of many terms, in an order of the kernel's own (check_close's ``allowance``).
    ``terms``: float64, (..., K), the K terms each output sums. Each step of a float32 sum rounds its partial sum
    by up to half a unit (u) of that partial sum's size; the roundings have random signs, so they add in quadrature,
    one standard deviation u * sqrt(sum_k S_k^2), S_k the running sum in K's order (the kernel's tiles take another
    order of the same terms: the size of its partial sums is alike). ROUNDINGS units of eps (four u: four standard
    deviations), at the worst output. The kernel's sum and the reference's (cuBLAS's) are two independent draws of
    this size, which "twice the reference's error" does not cover (dequant_matmul in float32 on the H200: 0.70 of
    that rule's tolerance at K = 515). In 16 bits it is a small fraction of one output rounding; TF32 products, the
    float32 mistake to catch, still exceed the tolerance 20-150 times at K = 70-2,048 (measured, CPU)."""
    if not terms.numel():
        return 0.0
    walk = terms.cumsum(-1).square().sum(-1).sqrt().max().item()
    return ROUNDINGS * torch.finfo(torch.float32).eps * walk


def dequant_matmul_magnitude(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> float:
    """The largest sum of |terms| of a dequant_matmul output, max over (m, n) of sum_k |x_mk| |w_nk| s_n: the float32
    accumulation's and the 16-bit reference's roundings scale with it, not with the (cancelling) result (check_close's
    magnitude; gemv's test derives its tolerance the same way)."""
    terms = (x.double().abs() @ weight_int8.double().abs().T) * scales.double().abs()
    return terms.max().item() if terms.numel() else 0.0


def gated_mlp_magnitude(mlp, x: torch.Tensor) -> float:
    """A gated MLP's output is down_proj(act), act = silu(gate_proj(x)) * up_proj(x): a sum over the intermediate
    size with random signs, whose roundings (FusedGatedMLP's and the reference's, in other orders) are those of its
    terms, sum_j |W_ij| |act_j|, not of the smaller result (check_close's magnitude). ``mlp``, ``x``: float64.
    Measured with max|out| instead: the fused decode step at 0.53 of its float32 tolerance in 15 draws (0.34 with
    this), FusedGatedMLP alone at 0.35 in the median."""
    with torch.no_grad():
        act = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
        return (act.abs() @ mlp.down_proj.weight.abs().T).max().item() if act.numel() else 0.0


# rsqrt's own error on a GPU: CUDA documents rsqrtf within 2 ulp (the interpreter: a square root then a reciprocal,
# two half-unit roundings).
RSQRT_UNITS = 2


def rms_statistic_units(n_cols: int) -> float:
    """A bound, in float32 units relative, on how far a kernel's rstd = rsqrt(mean(h^2) + eps) may be from the truth.
    rstd is one float32 number per row that multiplies every element of the row, and the kernel and the reference
    round it at other steps (summation order, rsqrt's implementation): the kernel's offset is a draw of its own that
    the reference's error does not bound (measured in float32: 1.65 units at the output's largest element where
    PyTorch's is 0.45, a fraction of 0.55 of the plain rule's tolerance). rsqrt's argument carries half a unit from
    the squares, from the mean and from the eps add, and a tree sum of positive terms half a unit per level (depth
    about log2 H); the square root halves that, and rsqrt adds its own (:data:`RSQRT_UNITS`)."""
    depth = math.ceil(math.log2(max(n_cols, 2)))
    return RSQRT_UNITS + (depth + 3) / 4


def rms_norm_allowance(truth: torch.Tensor) -> float:
    """The statistic's share of an (add_)rms_norm output's error: every element of a row inherits rstd's relative
    offset (:func:`rms_statistic_units`). ``truth``: the float64 normalized output, (..., H)."""
    if not truth.numel():
        return 0.0
    return rms_statistic_units(truth.shape[-1]) * torch.finfo(torch.float32).eps * truth.abs().max().item()


def _add_rms_norm_terms(args, grads):
    """The float64 pieces of add_rms_norm's backward (module lessonlib.ops.add_rms_norm): h = x + residual,
    n = h * rstd, d_n = d(out) * weight, d_h = d(residual_out) + rstd * (d_n - n * mean(d_n * n))."""
    x, residual, weight, eps = args
    grad_out, grad_residual = grads
    h = x + residual
    rstd = torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    n = h * rstd
    d_n = grad_out * weight
    return h, rstd, n, d_n, grad_residual


def add_rms_norm_grad_magnitudes(args, grads) -> dict[str, float]:
    """d_h = d(residual_out) + rstd * (d_n - n * mean(d_n * n)) cancels where a row is short: at H = 1, n = +-1 up to
    eps and d_n - n * (d_n * n) is d_n * eps / (h^2 + eps), a tiny result of terms rstd * |d_n| (a CI run failed
    at 1.08x of the result's 2 roundings). The terms: |d(residual_out)| + rstd * |d_n| + rstd * |n| * mean|d_n * n|.
    d(weight) = sum over rows of d(out) * n: random signs cancel across rows, and the partial sums round at up to
    the column's sum of |d(out) * n|."""
    h, rstd, n, d_n, grad_residual = _add_rms_norm_terms(args, grads)
    mean_term = (d_n * n).abs().mean(-1, keepdim=True)
    d_h = (grad_residual.abs() + rstd * d_n.abs() + rstd * n.abs() * mean_term).max().item()
    d_weight = (grads[0] * n).abs().reshape(-1, n.shape[-1]).sum(0).max().item() if n.numel() else 0.0
    return {"x": d_h, "residual": d_h, "weight": d_weight}


def add_rms_norm_grad_allowances(args, grads) -> dict[str, float]:
    """rstd's relative offset (:func:`rms_statistic_units`, float32: the kernel computes rstd in float32 for every
    dtype) carried by each output and gradient: once by the normalized output, by rstd * d_n and by d(weight)'s
    terms; three times by rstd * n * mean(d_n * n), which holds rstd cubed (n = h * rstd twice)."""
    h, rstd, n, d_n, grad_residual = _add_rms_norm_terms(args, grads)
    if not h.numel():
        return {}
    offset = rms_statistic_units(h.shape[-1]) * torch.finfo(torch.float32).eps
    d_h = (rstd * d_n.abs() + 3 * rstd * n.abs() * (d_n * n).abs().mean(-1, keepdim=True)).max().item()
    d_weight = (grads[0] * n).abs().reshape(-1, n.shape[-1]).sum(0).max().item()
    return {"output 0": offset * (n * args[2]).abs().max().item(), "x": offset * d_h, "residual": offset * d_h,
            "weight": offset * d_weight}


def check_gradients(name: str, fn, reference_fn, args: tuple, names: tuple, magnitudes=None,
                    allowances=None) -> None:
    """Check ``fn(*args)``'s outputs and the gradients of its inputs against float64 autograd through
    ``reference_fn``, each within the tolerance rule above (the low-precision yardstick: PyTorch's own autograd
    through the reference in the inputs' dtype). ``names[i]`` names argument i; arguments named None get no
    gradient (tables, eps). Every output gets a fresh random gradient; outputs and gradients start as NaN
    (poisoned), so an element a backward kernel never writes fails. ``magnitudes(args, grads)``, both float64, gives
    {name: the largest magnitude of the terms} for gradients whose terms cancel (``check_close``'s magnitude), e.g.
    :func:`swiglu_grad_magnitudes`; ``allowances(args, grads)`` the same way {name or "output i": a further absolute
    error} (``check_close``'s allowance), e.g. :func:`add_rms_norm_grad_allowances`."""
    wanted = [n is not None for n in names]

    def leaves(convert):
        return [convert(a).requires_grad_() if want else (convert(a) if isinstance(a, torch.Tensor) else a)
                for a, want in zip(args, wanted)]

    def run(f, inputs, grads):
        outs = f(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grads)])
        return outs

    ours = leaves(lambda a: a.detach().clone())
    probe = reference_fn(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
    grads = [torch.randn(o.shape, dtype=torch.float32, device=o.device).to(o.dtype)
             for o in (probe if isinstance(probe, tuple) else (probe,))]
    with poisoned_outputs():
        outs = run(fn, ours, grads)
    truth = leaves(lambda a: a.detach().to(torch.float64))
    truth_outs = run(reference_fn, truth, grads)
    truth_args = [a.detach() if isinstance(a, torch.Tensor) else a for a in truth]
    truth_grads = [g.double() for g in grads]
    terms = magnitudes(truth_args, truth_grads) if magnitudes else {}
    extra = allowances(truth_args, truth_grads) if allowances else {}
    low = leaves(lambda a: a.detach().clone())
    low_outs = run(reference_fn, low, grads)
    for i, (o, t, lp) in enumerate(zip(outs, truth_outs, low_outs)):
        check_close(f"{name} output {i}", o, t.detach(), lp.detach(), allowance=extra.get(f"output {i}", 0.0))
    for n, o, t, lp in zip(names, ours, truth, low):
        if n is None:
            continue
        if o.grad is None:
            raise AssertionError(f"{name}: no gradient reached {n}")
        check_close(f"{name} d{n}", o.grad, t.grad, lp.grad, terms.get(n), extra.get(n, 0.0))
