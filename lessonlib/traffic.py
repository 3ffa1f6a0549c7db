"""The bytes-and-FLOPs model: what each kernel of an op must read and write, eager chain vs fused.

Every number here is counted, not measured: each input read once and each output written once per kernel, the
fewest bytes that kernel can move. Eager PyTorch runs one kernel per operator, so its chain writes every
intermediate to memory and reads it back; a fused kernel keeps intermediates in registers. The notebooks set these
counts beside profiler launch counts and measured times.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32 = 4  # bytes of the float32 temporaries eager PyTorch creates for statistics


@dataclass(frozen=True)
class Kernel:
    name: str
    bytes_read: int
    bytes_written: int
    flops: int
    memcpy: bool = False  # a plain copy in one dtype: on a GPU a cudaMemcpy, which the profiler lists apart from kernels

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True)
class Chain:
    """The kernels one implementation of an op launches, in order."""

    label: str
    kernels: tuple[Kernel, ...]

    @property
    def launches(self) -> int:
        return len(self.kernels)

    @property
    def gpu_kernels(self) -> int:
        """The launches a GPU's profiler lists as kernels (``measure.count_launches`` on a GPU): the copies are
        device-to-device cudaMemcpy calls there."""
        return sum(not k.memcpy for k in self.kernels)

    @property
    def bytes(self) -> int:
        return sum(k.bytes for k in self.kernels)

    @property
    def flops(self) -> int:
        return sum(k.flops for k in self.kernels)

    @property
    def intensity(self) -> float:
        """FLOPs per byte of memory traffic."""
        return self.flops / self.bytes

    def time_floor_s(self, bandwidth_bytes_s: float, flops_s: float) -> float:
        """Roofline floor: each kernel takes at least its bytes over bandwidth or its FLOPs over peak."""
        return sum(max(k.bytes / bandwidth_bytes_s, k.flops / flops_s) for k in self.kernels)


@dataclass(frozen=True)
class OpTraffic:
    op: str
    shape: dict
    eager: Chain
    fused: Chain

    @property
    def byte_ratio(self) -> float:
        """How many times fewer bytes the fused version moves."""
        return self.eager.bytes / self.fused.bytes


def swiglu(tokens: int, intermediate: int, itemsize: int = 2) -> OpTraffic:
    n = tokens * intermediate * itemsize
    elems = tokens * intermediate
    eager = Chain("eager", (
        Kernel("silu(gate)", n, n, 4 * elems),  # exp, add, divide, multiply per element
        Kernel("mul(·, up)", 2 * n, n, elems),
    ))
    fused = Chain("fused", (Kernel("swiglu", 2 * n, n, 5 * elems),))
    return OpTraffic("swiglu", {"T": tokens, "I": intermediate}, eager, fused)


def bias_swiglu(tokens: int, intermediate: int, itemsize: int = 2) -> OpTraffic:
    """silu(gate + gate_bias) * (up + up_bias): eager adds each bias in a kernel of its own before silu and mul."""
    n, b = tokens * intermediate * itemsize, intermediate * itemsize
    elems = tokens * intermediate
    eager = Chain("eager", (
        Kernel("add(gate, gate_bias)", n + b, n, elems),
        Kernel("silu", n, n, 4 * elems),
        Kernel("add(up, up_bias)", n + b, n, elems),
        Kernel("mul", 2 * n, n, elems),
    ))
    fused = Chain("fused", (Kernel("bias_swiglu", 2 * n + 2 * b, n, 7 * elems),))
    return OpTraffic("bias_swiglu", {"T": tokens, "I": intermediate}, eager, fused)


def dequant_matmul(tokens: int, out_features: int, in_features: int, itemsize: int = 2) -> OpTraffic:
    """x (M, K) @ (int8 weight (N, K) * scales (N,)).T. Eager converts the weight to x's dtype, scales it (a full
    16-bit weight written twice and read twice), then multiplies; fused reads the int8 weight once. A plain 16-bit
    layer (F.linear) reads M K + N K 16-bit elements: between the two."""
    m, n, k = tokens, out_features, in_features
    x, w8, w, s, y = m * k * itemsize, n * k, n * k * itemsize, n * itemsize, m * n * itemsize
    flops = 2 * m * n * k
    eager = Chain("eager", (
        Kernel("weight.to(dtype)", w8, w, 0),
        Kernel("* scales[:, None]", w + s, w, n * k),
        Kernel("matmul", x + w, y, flops),
    ))
    fused = Chain("fused", (Kernel("dequant_matmul", x + w8 + s, y, flops + m * n),))
    return OpTraffic("dequant_matmul", {"M": m, "N": n, "K": k}, eager, fused)


def absmax_normalize(elements: int, itemsize: int = 2, programs: int = 1024,
                     strategy: str = "two_launches") -> OpTraffic:
    """x / max|x| over all of x. Eager: abs, amax, then a guard against an all-zero x (compare, a tensor of ones,
    where) and the division. Fused, ``two_launches``: ``programs`` partial maxima (float32), then every program of
    the scaling kernel reads them (L2, counted once) with x again; ``one_program``: one program reads x twice."""
    n = elements * itemsize
    one, flag = itemsize, 1
    eager = Chain("eager", (
        Kernel("abs", n, n, elements),
        Kernel("amax", n, one, elements),
        Kernel("amax > 0", one, flag, 1),
        Kernel("ones_like", 0, one, 0),
        Kernel("where", flag + 2 * one, one, 1),
        Kernel("div", n + one, n, elements),
    ))
    if strategy == "one_program":
        fused = Chain("one program", (Kernel("absmax_normalize, one program", 2 * n, n, 2 * elements),))
    else:
        partial = programs * FP32
        fused = Chain("two launches", (
            Kernel("partial maxima", n, partial, elements),
            Kernel("reduce partials, scale", n + partial, n, elements + programs),
        ))
    return OpTraffic("absmax_normalize", {"n": elements}, eager, fused)


def add_rms_norm(tokens: int, hidden: int, itemsize: int = 2) -> OpTraffic:
    elems = tokens * hidden
    n, f = elems * itemsize, elems * FP32
    row = tokens * FP32  # one float32 statistic per row
    upcast = itemsize != FP32  # .float() and .to(dtype) are no-ops for float32 inputs
    kernels = [Kernel("add (x + residual)", 2 * n, n, elems)]
    if upcast:
        kernels.append(Kernel("to(float32)", n, f, 0))
    kernels += [
        Kernel("pow(2)", f, f, elems),
        Kernel("mean", f, row, elems),
        Kernel("add eps", row, row, tokens),
        Kernel("rsqrt", row, row, tokens),
        Kernel("mul(hidden, rstd)", f + row, f, elems),
    ]
    if upcast:
        kernels.append(Kernel("to(dtype)", f, n, 0))
    kernels.append(Kernel("mul(weight, ·)", n + hidden * itemsize, n, elems))
    fused = Chain("fused", (Kernel("add_rms_norm", 2 * n + hidden * itemsize, 2 * n, 4 * elems),))
    return OpTraffic("add_rms_norm", {"T": tokens, "H": hidden}, Chain("eager", tuple(kernels)), fused)


def apply_rope(batch: int, heads: int, kv_heads: int, tokens: int, head_dim: int, itemsize: int = 2) -> OpTraffic:
    table = tokens * head_dim * itemsize  # one cos or sin table, broadcast over batch and heads
    kernels, q_and_k = [], 0
    for name, h in (("q", heads), ("k", kv_heads)):
        n = batch * h * tokens * head_dim * itemsize
        elems = batch * h * tokens * head_dim
        q_and_k += n
        kernels += [
            Kernel(f"neg(second half of {name})", n // 2, n // 2, elems // 2),
            Kernel(f"cat → rotate_half({name})", n, n, 0),
            Kernel(f"{name} * cos", n + table, n, elems),
            Kernel(f"rotate_half({name}) * sin", n + table, n, elems),
            Kernel(f"add → {name}_rot", 2 * n, n, elems),
        ]
    fused = Chain("fused", (Kernel("apply_rope", q_and_k + 2 * table, q_and_k, 3 * q_and_k // itemsize),))
    shape = {"B": batch, "H": heads, "Hkv": kv_heads, "T": tokens, "D": head_dim}
    return OpTraffic("apply_rope", shape, Chain("eager", tuple(kernels)), fused)


def rope_store_kv(tokens: int, heads: int, kv_heads: int, head_dim: int, itemsize: int = 2) -> OpTraffic:
    """The new tokens' RoPE and KV-cache write. ``eager`` is the serving engine's chain of separate kernels (copies
    of q and k out of the projection's rows, apply_rope, store_kv); ``fused`` is ops.rope_store_kv. The difference:
    the copies (2 q + 2 k) and k_rot written by apply_rope and read back by store_kv (2 k)."""
    q, kv = tokens * heads * head_dim * itemsize, tokens * kv_heads * head_dim * itemsize
    table = tokens * head_dim * itemsize  # one cos or sin row per token
    rotate_flops = 3 * (q + kv) // itemsize
    separate = Chain("eager", (
        Kernel("q.contiguous()", q, q, 0),
        Kernel("k.contiguous()", kv, kv, 0),
        Kernel("apply_rope", q + kv + 2 * table, q + kv, rotate_flops),
        Kernel("store_kv", 2 * kv, 2 * kv, 0),
    ))
    fused = Chain("fused", (Kernel("rope_store_kv", q + 2 * kv + 2 * table, q + 2 * kv, rotate_flops),))
    return OpTraffic("rope_store_kv", {"T": tokens, "H": heads, "Hkv": kv_heads, "D": head_dim}, separate, fused)


def gated_mlp(tokens: int, hidden: int, intermediate: int, itemsize: int = 2) -> OpTraffic:
    x, act, w = tokens * hidden * itemsize, tokens * intermediate * itemsize, hidden * intermediate * itemsize
    gemm_flops = 2 * tokens * hidden * intermediate
    act_elems = tokens * intermediate
    eager = Chain("eager", (
        Kernel("gate_proj GEMM", x + w, act, gemm_flops),
        Kernel("up_proj GEMM", x + w, act, gemm_flops),
        Kernel("silu(gate)", act, act, 4 * act_elems),
        Kernel("mul(·, up)", 2 * act, act, act_elems),
        Kernel("down_proj GEMM", act + w, x, gemm_flops),
    ))
    fused = Chain("fused", (
        Kernel("gate_up_proj GEMM", x + 2 * w, 2 * act, 2 * gemm_flops),
        Kernel("swiglu", 2 * act, act, 5 * act_elems),
        Kernel("down_proj GEMM", act + w, x, gemm_flops),
    ))
    return OpTraffic("gated_mlp", {"T": tokens, "H": hidden, "I": intermediate}, eager, fused)


def swiglu_backward(tokens: int, intermediate: int, itemsize: int = 2) -> OpTraffic:
    """d(gate), d(up) from d(out). Eager autograd keeps silu(gate) from the forward and runs mul's backward (two
    products) then silu's backward; the fused kernel keeps gate and up, recomputes sigmoid(gate) in registers and
    writes both gradients in one pass."""
    n = tokens * intermediate * itemsize
    elems = tokens * intermediate
    eager = Chain("eager", (
        Kernel("d(silu) = grad * up", 2 * n, n, elems),
        Kernel("d(up) = grad * silu(gate)", 2 * n, n, elems),
        Kernel("silu_backward(d(silu), gate)", 2 * n, n, 5 * elems),
    ))
    fused = Chain("fused", (Kernel("swiglu backward", 3 * n, 2 * n, 10 * elems),))
    return OpTraffic("swiglu_backward", {"T": tokens, "I": intermediate}, eager, fused)


def add_rms_norm_backward(tokens: int, hidden: int, itemsize: int = 2, programs: int = 264) -> OpTraffic:
    """d(x) = d(residual), d(weight) from the gradients of both outputs. Eager autograd walks back through every
    kernel of the forward (float32 temporaries included); the fused kernel reads d(out), d(updated residual) and
    the saved updated residual once, writes d_h once (x and residual share it), and ``programs`` partial rows of
    d(weight) in float32, which one small reduction sums (2 x 132 SMs on an H200 by default)."""
    elems = tokens * hidden
    n, f, w = elems * itemsize, elems * FP32, hidden * itemsize
    row = tokens * FP32
    upcast = itemsize != FP32
    kernels = [
        Kernel("d(weight) terms: grad * normalized", 2 * n, n, elems),
        Kernel("sum over rows → d(weight)", n, w, elems),
        Kernel("d(normalized) = grad * weight", n + w, n, elems),
    ]
    if upcast:
        kernels.append(Kernel("to(float32)", n, f, 0))
    kernels += [
        Kernel("d(hidden) * rstd", f + row, f, elems),
        Kernel("d(hidden) * hidden", 2 * f, f, elems),
        Kernel("sum → d(rstd)", f, row, elems),
        Kernel("rstd ** 3", row, row, 2 * tokens),
        Kernel("* -0.5", row, row, tokens),
        Kernel("d(rstd) * · → d(variance)", 2 * row, row, tokens),
        Kernel("mean's backward: expand / H", row, f, elems),
        Kernel("pow's backward: hidden ** 1, a copy", f, f, 0, memcpy=True),
        Kernel("* 2", f, f, elems),
        Kernel("d(variance) * 2 hidden", 2 * f, f, elems),
        Kernel("add the two d(hidden)", 2 * f, f, elems),
    ]
    if upcast:
        kernels.append(Kernel("to(dtype)", f, n, 0))
    kernels.append(Kernel("+ d(updated residual)", 2 * n, n, elems))
    partial = programs * hidden * FP32
    fused = [
        Kernel("add_rms_norm backward", 3 * n + w, n + partial, 8 * elems),
        Kernel("sum partial d(weight) rows", partial, hidden * FP32, programs * hidden),
    ]
    if upcast:
        fused.append(Kernel("to(dtype)", hidden * FP32, w, 0))
    return OpTraffic("add_rms_norm_backward", {"T": tokens, "H": hidden}, Chain("eager", tuple(kernels)),
                     Chain("fused", tuple(fused)))


OPS = {"swiglu": swiglu, "add_rms_norm": add_rms_norm, "apply_rope": apply_rope, "gated_mlp": gated_mlp}
BACKWARD_OPS = {"swiglu": swiglu_backward, "add_rms_norm": add_rms_norm_backward}


def score_matrix_bytes(tokens: int, heads: int = 32, itemsize: int = 2, batch: int = 1) -> int:
    """Bytes of the attention score matrix naive attention writes for one layer: one (T, T) matrix per head (and
    as many again for the probabilities after softmax, which this does not count)."""
    return batch * heads * tokens * tokens * itemsize


def attention_io_bytes(tokens: int, heads: int = 32, head_dim: int = 128, itemsize: int = 2, batch: int = 1) -> int:
    """Bytes FlashAttention must move for one layer: read Q, K, V and write O, each (B, H, T, D). Linear in T."""
    return 4 * batch * heads * tokens * head_dim * itemsize


def prescale_q_bytes(tokens: int, heads: int = 32, head_dim: int = 128, itemsize: int = 2, batch: int = 1) -> int:
    """Bytes added when the softmax scale multiplies Q in a pass of its own before attention: Q read once and the
    scaled Q written once, each (B, H, T, D). (Attention then reads the scaled copy instead of Q: no change there.)
    Folded into the kernel's exp2 instead, the scale costs no bytes at all."""
    return 2 * batch * heads * tokens * head_dim * itemsize
