"""ops.decode_gemv and ops.decode_qkv_rope_store_kv against their references in float64: the RMSNorm prologue, the
SwiGLU, residual-add and RoPE + K/V-write epilogues, odd shapes (K not a multiple of the tile, N not a multiple of
the program's columns), outputs and caches poisoned, the errors raised before any launch, and planted bugs that the
checks must catch."""

import ast
import importlib
import inspect
import textwrap

import pytest
import torch

from lessonlib import ops, reference, runtime
from lessonlib.testing import check_close, poisoned_outputs
from tests.conftest import DEVICE, randn

module = importlib.import_module("lessonlib.ops.decode_gemv")


def small_tiles(monkeypatch):
    """The GPU's shape of configuration at interpreter sizes: a few outputs per program and K in tiles, so that
    several programs, a last one partly past N and a ragged last K tile all run."""
    monkeypatch.setattr(module, "config", lambda n_out, k, epilogue: {"BLOCK_N": 4, "BLOCK_K": 16, "num_warps": 4})


def normed_magnitude(x, weight, bias, norm_weight, eps):
    """The largest sum of |terms| of an output (float64): the scale of a float32 accumulation's roundings."""
    x, weight = x.double(), weight.double()
    if norm_weight is not None:
        x = reference.add_rms_norm(x, torch.zeros_like(x), norm_weight.double(), eps)[0]
    terms = x.abs() @ weight.abs().T + (bias.double().abs() if bias is not None else 0)
    return terms


def check_decode_gemv(m, n, k, dtype, norm, activation, with_residual, with_bias, eps=1e-5):
    x = randn(m, k, dtype=dtype) * 3  # a stream well away from unit RMS: the prologue's rstd matters
    weight = randn(n, k, dtype=dtype, scale=k ** -0.5)
    bias = randn(n, dtype=dtype) if with_bias else None
    norm_weight = (1 + 0.5 * randn(k)).to(dtype) if norm else None
    residual = randn(m, n, dtype=dtype) if with_residual else None
    before = residual.clone() if with_residual else None
    with poisoned_outputs():
        out = ops.decode_gemv(x, weight, bias, norm_weight=norm_weight, eps=eps, activation=activation,
                              residual=residual)
    if with_residual:
        assert out is residual  # updated in place
    verify_decode_gemv(out, x, weight, bias, norm_weight, eps, activation, before)


def verify_decode_gemv(out, x, weight, bias, norm_weight, eps, activation, residual_before):
    """out against float64 on the inputs it was given (``residual_before``: the residual before the call)."""
    kwargs = {"eps": eps, "activation": activation}
    args64 = [t.double() if t is not None else None for t in (x, weight, bias, norm_weight, residual_before)]
    truth = reference.decode_gemv(*args64[:3], norm_weight=args64[3], residual=args64[4], **kwargs)
    low = reference.decode_gemv(x, weight, bias, norm_weight=norm_weight, **kwargs,
                                residual=residual_before.clone() if residual_before is not None else None)
    terms = normed_magnitude(x, weight, bias, norm_weight, eps)
    if activation == "swiglu":
        gate, up = terms.chunk(2, dim=-1)
        terms = gate * up
    magnitude = (terms + (residual_before.double().abs() if residual_before is not None else 0)).max().item()
    check_close("decode_gemv", out, truth, low, magnitude=magnitude)


CASES = [  # (m, n, k, norm, activation, residual, bias): each option on, and together
    (1, 7, 33, True, None, False, False),
    (1, 300, 515, True, "swiglu", False, False),
    (1, 123, 1000, False, None, True, False),
    (2, 10, 77, True, None, True, True),
    (1, 2 * 11, 50, True, "swiglu", False, True),
]


@pytest.mark.parametrize("m, n, k, norm, activation, residual, bias", CASES)
def test_decode_gemv_matches_float64(m, n, k, norm, activation, residual, bias, dtype):
    check_decode_gemv(m, n, k, dtype, norm, activation, residual, bias)


@pytest.mark.parametrize("norm, activation, residual", [(True, "swiglu", False), (True, None, True)])
def test_decode_gemv_with_the_gpus_small_tiles(monkeypatch, norm, activation, residual, dtype):
    small_tiles(monkeypatch)
    check_decode_gemv(1, 2 * 9, 50, dtype, norm, activation, residual, with_bias=True)  # K=50: a ragged tile
    check_decode_gemv(1, 2 * 9, 64, dtype, norm, activation, residual, with_bias=False)  # K=64: no mask along K


def qkv_inputs(m, heads, kv_heads, head_dim, k, dtype, block_size=4, with_bias=True):
    width = (heads + 2 * kv_heads) * head_dim
    x = randn(m, k, dtype=dtype) * 2
    weight, norm_weight = randn(width, k, dtype=dtype, scale=k ** -0.5), (1 + 0.5 * randn(k)).to(dtype)
    bias = randn(width, dtype=dtype) if with_bias else None
    cos, sin = reference.rope_cos_sin(torch.randint(0, 4096, (m,), device=DEVICE), head_dim, dtype=dtype)
    num_blocks = 2 * -(-m // block_size) + 1
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:m]
    return x, weight, bias, norm_weight, cos, sin, k_cache, k_cache.clone(), slots


def check_qkv(inputs, heads, kv_heads, eps=1e-5, launch=ops.decode_qkv_rope_store_kv):
    x, weight, bias, norm_weight, cos, sin, k_cache, v_cache, slots = inputs
    with poisoned_outputs():
        q = launch(x, weight, bias, norm_weight, cos, sin, k_cache, v_cache, slots, num_heads=heads,
                   num_kv_heads=kv_heads, eps=eps)
    verify_qkv(q, inputs, heads, kv_heads, eps)


def verify_qkv(q, inputs, heads, kv_heads, eps):
    """q and the two caches' rows at the slots against float64 (the caches were NaN before the call); every other
    slot still NaN."""
    x, weight, bias, norm_weight, cos, sin, k_cache, v_cache, slots = inputs
    heads_kw = {"num_heads": heads, "num_kv_heads": kv_heads, "eps": eps}
    f64 = [t.double() if t is not None else None for t in (x, weight, bias, norm_weight, cos, sin)]
    k64, v64 = (torch.full_like(k_cache, float("nan"), dtype=torch.float64) for _ in range(2))
    q_truth = reference.decode_qkv_rope_store_kv(*f64, k64, v64, slots, **heads_kw)
    k_low, v_low = (torch.full_like(k_cache, float("nan")) for _ in range(2))
    q_low = reference.decode_qkv_rope_store_kv(x, weight, bias, norm_weight, cos, sin, k_low, v_low, slots, **heads_kw)
    terms = normed_magnitude(x, weight, bias, norm_weight, eps)
    magnitude = 2 * terms.max().item()  # a rotated value mixes two columns, each times a cosine or a sine
    check_close("decode_qkv_rope_store_kv q", q, q_truth, q_low, magnitude=magnitude)
    rows = (lambda cache: cache.view(-1, kv_heads, cache.shape[-1])[slots])
    for name, cache, truth, low in (("k_cache", k_cache, k64, k_low), ("v_cache", v_cache, v64, v_low)):
        check_close(f"decode_qkv_rope_store_kv {name}", rows(cache), rows(truth), rows(low), magnitude=magnitude)
        others = torch.ones(cache.shape[0] * cache.shape[1], dtype=torch.bool, device=DEVICE)
        others[slots] = False
        assert cache.view(-1, kv_heads, cache.shape[-1])[others].isnan().all(), f"{name}: a slot not given written"


@pytest.mark.parametrize("m, heads, kv_heads, head_dim, k", [(1, 4, 2, 16, 33), (2, 5, 1, 8, 100), (1, 14, 2, 4, 61),
                                                             (1, 2, 1, 64, 24), (1, 2, 1, 128, 17)])
def test_decode_qkv_rope_store_kv_matches_float64(m, heads, kv_heads, head_dim, k, dtype):
    check_qkv(qkv_inputs(m, heads, kv_heads, head_dim, k, dtype), heads, kv_heads)


def test_decode_qkv_rope_store_kv_with_the_gpus_small_tiles(monkeypatch, dtype):
    """Four pairs per program: a program holds part of one head's two halves; K in tiles with a ragged end."""
    small_tiles(monkeypatch)
    check_qkv(qkv_inputs(1, 3, 1, 16, 50, dtype, with_bias=False), 3, 1)


def test_the_gpus_own_tiles(monkeypatch):
    """decode_gemv.GPU_TILES as the launchers pick them on the H200 (the profile asked for, the kernels still run in
    the interpreter or on this GPU): K=2048 in one tile, a few outputs per program, every epilogue."""
    monkeypatch.setattr(runtime, "gpu_profile", lambda: runtime.PROFILES["h200"])
    assert module.config(16, 2048, module.ROPE_KV) == {"BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 4}
    assert module.config(16, 896, module.ROPE_KV) == {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4}  # same bytes
    assert module.config(16, 896, module.SWIGLU) == {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4}
    dtype = torch.float32
    check_qkv(qkv_inputs(1, 2, 1, 8, 2048, dtype), 2, 1)
    check_qkv(qkv_inputs(1, 2, 1, 8, 900, dtype), 2, 1)  # K 900: 4 pairs per program, BLOCK_K 1024 with a ragged end
    check_decode_gemv(1, 2 * 9, 2048, dtype, norm=True, activation="swiglu", with_residual=False, with_bias=False)
    check_decode_gemv(1, 9, 2100, dtype, norm=False, activation=None, with_residual=True, with_bias=False)


def swapped_cos_sin(x, weight, bias, norm_weight, cos, sin, *args, **kwargs):
    return ops.decode_qkv_rope_store_kv(x, weight, bias, norm_weight, sin, cos, *args, **kwargs)


def without_norm(x, weight, bias, norm_weight, *args, **kwargs):
    return ops.decode_qkv_rope_store_kv(x, weight, bias, None, *args, **kwargs)


@pytest.mark.parametrize("bug", [swapped_cos_sin, without_norm], ids=["cos and sin swapped", "norm skipped"])
def test_the_checks_catch_a_planted_bug(bug):
    with pytest.raises(AssertionError):
        check_qkv(qkv_inputs(1, 4, 2, 16, 33, torch.float32), 4, 2, launch=bug)


def test_the_residual_check_catches_a_skipped_add(monkeypatch):
    """A residual epilogue that stores y instead of stream + y (the plain store) must fail the check."""
    monkeypatch.setattr(module, "RESIDUAL", module.STORE)
    with pytest.raises(AssertionError):
        check_decode_gemv(1, 7, 33, torch.float32, True, None, True, False)


@pytest.mark.parametrize("call, error, message", [
    (lambda: ops.decode_gemv(randn(1, 8), randn(6, 8), norm_weight=randn(7)), ValueError, r"norm_weight must be"),
    (lambda: ops.decode_gemv(randn(1, 8), randn(6, 8), residual=randn(1, 5)), ValueError, r"residual must be"),
    (lambda: ops.decode_gemv(randn(1, 8), randn(6, 8), activation="swiglu", residual=randn(1, 6)), ValueError,
     "no residual"),
    (lambda: ops.decode_gemv(randn(1, 8), randn(6, 8), activation="gelu"), ValueError, "activation must be"),
    (lambda: ops.decode_gemv(randn(1, 8), randn(6, 8), norm_weight=randn(8), eps=0.0), ValueError, "eps"),
    (lambda: ops.decode_gemv(randn(1, 8), randn(6, 8), residual=randn(1, 6, dtype=torch.float16)), TypeError,
     "mixed dtypes"),
    (lambda: ops.decode_gemv(randn(1, 8), randn(6, 9)), ValueError, "K=8"),
    (lambda: ops.decode_gemv(randn(2, 8), randn(6, 8), residual=randn(1, 6).expand(2, 6)), ValueError,
     "rows overlap"),
])
def test_decode_gemv_rejects_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("activation, residual", [(None, False), ("swiglu", False), (None, True)])
def test_decode_gemv_with_no_outputs_returns_an_empty_result(activation, residual):
    """N = 0 (say, a layer pruned to nothing): an empty (M, 0) result, not a grid of zero programs."""
    stream = randn(2, 0) if residual else None
    out = ops.decode_gemv(randn(2, 8), randn(0, 8), activation=activation, residual=stream)
    assert out.shape == (2, 0) and (out is stream or not residual)


@pytest.mark.parametrize("views", [lambda buf: (buf[:, :8], buf[:, :8]), lambda buf: (buf[:, :8], buf[:, 4:12])],
                         ids=["the same tensor", "overlapping columns"])
def test_decode_gemv_refuses_a_residual_that_overlaps_its_input_and_leaves_it_untouched(views):
    buf = randn(1, 16)
    x, stream = views(buf)
    before = buf.clone()
    with pytest.raises(ValueError, match="residual overlaps x"):
        ops.decode_gemv(x, randn(8, 8), residual=stream)
    assert torch.equal(buf, before)


def test_decode_gemv_takes_a_residual_beside_its_input_in_one_buffer():
    """Views of one allocation that do not overlap are two tensors: served, and right."""
    buf = randn(1, 16)
    x, stream = buf[:, :8], buf[:, 8:14]
    weight, before = randn(6, 8, scale=8 ** -0.5), stream.clone()
    verify_decode_gemv(ops.decode_gemv(x, weight, residual=stream), x, weight, None, None, 1e-6, None, before)


def test_decode_qkv_rope_store_kv_refuses_caches_that_overlap():
    """K and V written into one tensor, or x (read whole by every program) inside a cache being written: a race."""
    x, weight, bias, norm_weight, cos, sin, k_cache, v_cache, slots = qkv_inputs(1, 4, 2, 16, 32, torch.float32)
    for x_, k_, v_ in ((x, k_cache, k_cache), (k_cache.view(1, -1)[:, :32], k_cache, v_cache)):
        with pytest.raises(ValueError, match="overlaps"):
            ops.decode_qkv_rope_store_kv(x_, weight, bias, norm_weight, cos, sin, k_, v_, slots, num_heads=4,
                                         num_kv_heads=2)
    assert k_cache.isnan().all() and v_cache.isnan().all()


def test_decode_qkv_rope_store_kv_takes_k_and_v_side_by_side_in_one_buffer(dtype):
    """vLLM's layout: one (2, blocks, block_size, Hkv, D) tensor per layer, k its [0], v its [1]."""
    x, weight, bias, norm_weight, cos, sin, k_cache, _, slots = qkv_inputs(1, 4, 2, 16, 33, dtype)
    kv = torch.stack([k_cache, k_cache])
    check_qkv((x, weight, bias, norm_weight, cos, sin, kv[0], kv[1], slots), 4, 2)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(weight=a["weight"][:-2], bias=a["bias"][:-2]), "rows"),
    (lambda a: a.update(cos=a["cos"][:, :-2]), "cos must be"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :2]), "caches must be"),
    (lambda a: a.update(slots=a["slots"].float()), "slots must be an integer"),
    (lambda a: a.update(num_kv_heads=3), "caches must be"),
])
def test_decode_qkv_rope_store_kv_rejects_bad_input_before_writing(change, message):
    x, weight, bias, norm_weight, cos, sin, k_cache, v_cache, slots = qkv_inputs(1, 4, 2, 16, 33, torch.float32)
    args = dict(x=x, weight=weight, bias=bias, norm_weight=norm_weight, cos=cos, sin=sin, k_cache=k_cache,
                v_cache=v_cache, slots=slots, num_heads=4, num_kv_heads=2)
    change(args)
    with pytest.raises((ValueError, TypeError), match=message):
        ops.decode_qkv_rope_store_kv(**args)
    assert k_cache.isnan().all() and v_cache.isnan().all()


@pytest.mark.parametrize("bad, message", [(lambda s, n: s.fill_(n), r"slots must lie in \[0, 12\)"),
                                          (lambda s, n: s.fill_(-1), "slots must lie in"),
                                          (lambda s, n: s.fill_(s[0].item()), "same slot")])
def test_decode_qkv_rope_store_kv_refuses_bad_slots_before_writing(bad, message):
    """A slot past the pool, a negative one (a padding marker) or two tokens on one slot would write outside the
    caches or race: refused before the launch, as rope_store_kv refuses them; validate=False (the engine's trusted
    slots, no host sync under graph capture) skips the check."""
    x, weight, bias, norm_weight, cos, sin, k_cache, v_cache, slots = qkv_inputs(2, 4, 2, 16, 33, torch.float32)
    assert k_cache.shape[0] * k_cache.shape[1] == 12
    bad(slots, 12)
    with pytest.raises(ValueError, match=message):
        ops.decode_qkv_rope_store_kv(x, weight, bias, norm_weight, cos, sin, k_cache, v_cache, slots, num_heads=4,
                                     num_kv_heads=2)
    assert k_cache.isnan().all() and v_cache.isnan().all()


def fused_layer(stream, attn, w, k_cache, v_cache, *, cos, sin, slots, heads, kv_heads, eps):
    """EngineLayer.fused_decode's four projections on one token (attention's output given): stream in place."""
    q = ops.decode_qkv_rope_store_kv(stream, w["qkv"], w["qkv_bias"], w["norm1"], cos, sin, k_cache, v_cache, slots,
                                     num_heads=heads, num_kv_heads=kv_heads, eps=eps)
    ops.decode_gemv(attn, w["o"], w["o_bias"], residual=stream)
    act = ops.decode_gemv(stream, w["gate_up"], norm_weight=w["norm2"], eps=eps, activation="swiglu")
    ops.decode_gemv(act, w["down"], residual=stream)
    return q, act


def unfused_layer(stream, attn, w, k_cache, v_cache, *, cos, sin, slots, heads, kv_heads, eps):
    """The same on the engine's unfused batch-1 kernels (EngineLayer.forward): add_rms_norm, gemv, rope_store_kv.
    Returns q, the SwiGLU activation and the stream after the layer."""
    normed, _ = ops.add_rms_norm(stream, torch.zeros_like(stream), w["norm1"], eps)
    q = ops.rope_store_kv(ops.gemv(normed, w["qkv"], w["qkv_bias"]), cos, sin, k_cache, v_cache, slots,
                          num_heads=heads, num_kv_heads=kv_heads)
    normed, stream = ops.add_rms_norm(ops.gemv(attn, w["o"], w["o_bias"]), stream, w["norm2"], eps)
    act = ops.gemv(normed, w["gate_up"], activation="swiglu")
    return q, act, ops.add_rms_norm(ops.gemv(act, w["down"]), stream, w["norm2"], eps)[1]


@pytest.mark.skipif(runtime.on_gpu(), reason="bit for bit needs the same sums in the same order: the interpreter's "
                    "tiles are the same for both paths; a GPU's reduction trees differ (the engine's bf16 test "
                    "compares tokens with the near-tie rule)")
def test_the_fused_layer_rounds_where_the_unfused_engine_rounds(dtype):
    """The fused layer and the unfused engine's kernels on the same inputs give the same bits: the normed x rounded
    before the product, each projection (+ bias) rounded once, RoPE from the rounded q/k, each residual add from
    the rounded product. In float16 a rounding point moved (the normed x kept in float32, y added unrounded)
    changes bits; against float64 the tolerance would not see it. Hidden 40 (head_dim 16, 3 heads, 1 KV head:
    GQA, a q bias), intermediate 36: every sum in one tile in both paths."""
    hidden, inter, heads, kv_heads, d, eps = 40, 36, 3, 1, 16, 1e-5
    width = (heads + 2 * kv_heads) * d

    def weight(n, k):
        return randn(n, k, dtype=dtype, scale=k ** -0.5)

    w = {"qkv": weight(width, hidden), "qkv_bias": randn(width, dtype=dtype), "o": weight(hidden, heads * d),
         "o_bias": randn(hidden, dtype=dtype), "gate_up": weight(2 * inter, hidden), "down": weight(hidden, inter),
         "norm1": (1 + 0.5 * randn(hidden)).to(dtype), "norm2": (1 + 0.5 * randn(hidden)).to(dtype)}
    stream, attn = randn(1, hidden, dtype=dtype) * 3, randn(1, heads * d, dtype=dtype)
    _, _, _, _, cos, sin, k_cache, v_cache, slots = qkv_inputs(1, heads, kv_heads, d, hidden, dtype)
    rope = {"cos": cos, "sin": sin, "slots": slots, "heads": heads, "kv_heads": kv_heads, "eps": eps}
    unfused_caches = (k_cache.clone(), v_cache.clone())
    q, act, stream_after = unfused_layer(stream, attn, w, *unfused_caches, **rope)
    fused_stream = stream.clone()
    with poisoned_outputs():
        fused_q, fused_act = fused_layer(fused_stream, attn, w, k_cache, v_cache, **rope)
    for name, fused, unfused in (("q", fused_q, q), ("k_cache", k_cache, unfused_caches[0]),
                                 ("v_cache", v_cache, unfused_caches[1]), ("SwiGLU", fused_act, act),
                                 ("stream", fused_stream, stream_after)):
        assert torch.equal(fused.nan_to_num(7.0), unfused.nan_to_num(7.0)), name


def test_before_its_wait_the_kernel_reads_only_weights_and_writes_nothing():
    """PDL's rule (ops._common.pdl), read off the kernel's source, since neither the interpreter (PDL off) nor a GPU
    run (a race shows only sometimes) can show it broken: the statements before ``gdc_wait`` name no pointer but
    the weights', store nothing and call no helper that could (x, the stream, the bias, cos, sin and the slots are
    the previous kernels' outputs, or may be in a graph replayed with new inputs)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(module._decode_gemv_kernel.fn))).body[0].body
    wait = next(i for i, statement in enumerate(body) if "gdc_wait()" in ast.unparse(statement))
    before = [node for statement in body[:wait] for node in ast.walk(statement)]
    pointers = {n.id for n in before if isinstance(n, ast.Name) and n.id.endswith("_ptr")}
    calls = {ast.unparse(n.func) for n in before if isinstance(n, ast.Call)}
    assert pointers == {"w_ptr"}, pointers
    assert "tl.load" in calls and not [c for c in calls if not c.startswith("tl.") and not c.endswith(".to")], calls
    assert not [c for c in calls if "store" in c or "atomic" in c], calls


@pytest.mark.skipif(not runtime.on_gpu(), reason="CUDA graphs need a GPU")
def test_a_layer_of_kernels_in_a_cuda_graph():
    """o (residual add into stream a), gate_up (reads a whole: norm prologue, SwiGLU), down (residual add into stream
    b), the next qkv (reads b whole: norm, RoPE, K/V write), at Llama-3.2-1B's sizes, captured in one graph and
    replayed on fresh inputs. With PDL (Hopper) each kernel starts before the previous one ends: one that read its
    x or stream before its wait would read the previous replay's values, and fail its check against float64 on the
    inputs as written."""
    dtype = runtime.supported_dtypes()[-1]
    h, inter, heads, kv_heads, d, eps = 2048, 8192, 32, 8, 64, 1e-5
    attn, a, b = (randn(1, h, dtype=dtype) for _ in range(3))
    wo, wd = randn(h, h, dtype=dtype, scale=h ** -0.5), randn(h, inter, dtype=dtype, scale=inter ** -0.5)
    wgu, norm = randn(2 * inter, h, dtype=dtype, scale=h ** -0.5), (1 + 0.5 * randn(h)).to(dtype)
    qkv = qkv_inputs(1, heads, kv_heads, d, h, dtype)
    wqkv, bqkv, nqkv, cos, sin, k_cache, v_cache, slots = qkv[1:]

    def layer():
        ops.decode_gemv(attn, wo, residual=a)
        act = ops.decode_gemv(a, wgu, norm_weight=norm, eps=eps, activation="swiglu")
        ops.decode_gemv(act, wd, residual=b)
        q = ops.decode_qkv_rope_store_kv(b, wqkv, bqkv, nqkv, cos, sin, k_cache, v_cache, slots, num_heads=heads,
                                         num_kv_heads=kv_heads, eps=eps, validate=False)  # no sync in a capture
        return act, q

    layer()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        act, q = layer()  # kept: the graph writes these tensors at every replay
    for _ in range(3):
        for t in (attn, a, b):
            t.copy_(randn(1, h, dtype=dtype))
        a0, b0 = a.clone(), b.clone()
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        verify_decode_gemv(a, attn, wo, None, None, eps, None, a0)
        verify_decode_gemv(act, a, wgu, None, norm, eps, "swiglu", None)
        verify_decode_gemv(b, act, wd, None, None, eps, None, b0)
        verify_qkv(q, (b, wqkv, bqkv, nqkv, cos, sin, k_cache, v_cache, slots), heads, kv_heads, eps)
