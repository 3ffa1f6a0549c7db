import pytest
import torch

from lessonlib import ops, reference, runtime
from lessonlib.ops.rope_store_kv import apply_rope_then_store_kv as separate
from lessonlib.testing import check_close, poisoned_outputs, to_float64
from tests.conftest import DEVICE, randn

BITS = {2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns: NaN poison compares equal to itself, and -0.0 differs from 0.0."""
    return t.view(BITS[t.element_size()])


def inputs(tokens, heads, kv_heads, head_dim, dtype, block_size=4, pad=3):
    """qkv with rows `pad` elements longer than their width (a strided view, as a sliced projection gives), angles
    of random positions, NaN-poisoned caches with room for about twice the tokens, slots spread over the pool's
    blocks in random order."""
    width = (heads + 2 * kv_heads) * head_dim
    qkv = randn(tokens, width + pad, dtype=dtype)[:, :width]
    cos, sin = reference.rope_cos_sin(torch.randint(0, 4096, (tokens,), device=DEVICE), head_dim, dtype=dtype)
    num_blocks = 2 * -(-tokens // block_size) + 1
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    return qkv, cos, sin, k_cache, k_cache.clone(), slots


def apply_rope_then_store_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads):
    return separate(qkv, cos, sin, k_cache, v_cache, slots, num_heads=heads, num_kv_heads=kv_heads)


TOKENS, HEADS, HEAD_DIMS = (1, 7, 33), ((4, 2), (32, 8), (5, 1)), (16, 64, 128)
# A Latin square instead of all 27 combinations: every pair of (tokens, heads, head_dim) values meets once, at a
# third of the interpreter's time (CI runs on two cores).
SHAPES = [(t, *HEADS[j], HEAD_DIMS[(i + j) % 3]) for i, t in enumerate(TOKENS) for j in range(3)]


@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", SHAPES)
def test_rope_store_kv_matches_float64_and_the_separate_kernels_bit_for_bit(tokens, heads, kv_heads, head_dim, dtype):
    qkv, cos, sin, k_cache, v_cache, slots = inputs(tokens, heads, kv_heads, head_dim, dtype)
    poison_k, poison_v = bits(k_cache).clone(), bits(v_cache).clone()
    k_separate, v_separate = k_cache.clone(), v_cache.clone()
    with poisoned_outputs():
        q = ops.rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads=heads, num_kv_heads=kv_heads)
    assert q.shape == (tokens, heads, head_dim) and q.is_contiguous() and q.dtype == dtype

    # The same bits as apply_rope then store_kv: the engine's outputs do not change with the fusion.
    q_separate = apply_rope_then_store_kv(qkv, cos, sin, k_separate, v_separate, slots, heads, kv_heads)
    assert torch.equal(bits(q), bits(q_separate.contiguous()))
    assert torch.equal(bits(k_cache), bits(k_separate)) and torch.equal(bits(v_cache), bits(v_separate))

    # Every slot but the tokens' still holds its poison, bit for bit.
    others = torch.ones(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool, device=DEVICE)
    others[slots] = False
    for cache, poison in ((k_cache, poison_k), (v_cache, poison_v)):
        rows = (lambda t: t.view(-1, kv_heads, head_dim)[others])
        assert torch.equal(rows(bits(cache)), rows(poison))

    # Within tolerance of float64 (the reference in the same dtype sets the rounding error allowed).
    k64, v64 = torch.zeros_like(k_cache, dtype=torch.float64), torch.zeros_like(v_cache, dtype=torch.float64)
    truth_q = reference.rope_store_kv(*to_float64(qkv, cos, sin), k64, v64, slots, num_heads=heads,
                                      num_kv_heads=kv_heads)
    k_low, v_low = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    low_q = reference.rope_store_kv(qkv, cos, sin, k_low, v_low, slots, num_heads=heads, num_kv_heads=kv_heads)
    check_close("rope_store_kv q", q, truth_q, low_q)
    flat = (lambda cache: cache.view(-1, kv_heads, head_dim)[slots])
    check_close("rope_store_kv k in the cache", flat(k_cache), flat(k64), flat(k_low))
    assert torch.equal(bits(flat(v_cache)), bits(flat(v_low)))  # v is copied, not computed


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_rope_store_kv_without_validation_and_with_int32_slots(slot_dtype):
    qkv, cos, sin, k_cache, v_cache, slots = inputs(9, 4, 2, 16, torch.float32, block_size=8)
    k_separate, v_separate = k_cache.clone(), v_cache.clone()
    q = ops.rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots.to(slot_dtype), num_heads=4, num_kv_heads=2,
                          validate=False)
    q_separate = apply_rope_then_store_kv(qkv, cos, sin, k_separate, v_separate, slots, 4, 2)
    assert torch.equal(q, q_separate) and torch.equal(bits(k_cache), bits(k_separate))
    assert torch.equal(bits(v_cache), bits(v_separate))


def test_rope_store_kv_with_no_tokens_launches_nothing():
    qkv, cos, sin, k_cache, v_cache, slots = inputs(0, 4, 2, 16, torch.float32)
    q = ops.rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads=4, num_kv_heads=2)
    assert q.shape == (0, 4, 16) and torch.isnan(k_cache).all() and torch.isnan(v_cache).all()


def _valid(**change):
    qkv, cos, sin, k_cache, v_cache, slots = inputs(3, 4, 2, 8, torch.float32)  # 3 blocks of 4 slots: 12 slots
    args = dict(qkv=qkv, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, slots=slots, num_heads=4, num_kv_heads=2)
    return {**args, **{name: f(args) if callable(f) else f for name, f in change.items()}}


BAD = [
    ({"qkv": lambda a: randn(3, 63)}, ValueError, r"qkv must be \(T, \(num_heads \+ 2 \* num_kv_heads\)"),
    ({"num_heads": 5}, ValueError, "qkv must be"),
    ({"num_kv_heads": 1}, ValueError, "caches must be"),
    ({"qkv": lambda a: randn(64, 3).T}, ValueError, "contiguous in its last dimension"),
    ({"cos": lambda a: a["cos"][:2]}, ValueError, r"cos must be \(T, head_dim\) = \(3, 8\)"),
    ({"sin": lambda a: a["sin"][:, :4]}, ValueError, "sin must be"),
    ({"v_cache": lambda a: a["v_cache"][:2]}, ValueError, "caches must be"),
    ({"k_cache": lambda a: a["k_cache"].transpose(0, 1)}, ValueError, "caches must be|contiguous"),
    ({"qkv": lambda a: randn(3, 54), "cos": lambda a: randn(3, 7), "sin": lambda a: randn(3, 7),
      "k_cache": lambda a: a["k_cache"][..., :7].contiguous(), "v_cache": lambda a: a["v_cache"][..., :7].contiguous()},
     ValueError, "head_dim must be even"),
    ({"cos": lambda a: a["cos"].half(), "sin": lambda a: a["sin"].half()}, TypeError, "mixed dtypes"),
    ({"slots": lambda a: a["slots"].float()}, TypeError, "slots must be an integer tensor of shape"),
    ({"slots": lambda a: a["slots"][:2]}, TypeError, r"slots must be an integer tensor of shape \(3,\)"),
    ({"slots": lambda a: torch.tensor([0, 5, 12], device=DEVICE)}, ValueError, r"slots must lie in \[0, 12\)"),
    ({"slots": lambda a: torch.tensor([0, -1, 5], device=DEVICE)}, ValueError, r"slots must lie in \[0, 12\)"),
    ({"slots": lambda a: torch.tensor([7, 2, 7], device=DEVICE)}, ValueError, "two tokens map to the same slot"),
]


@pytest.mark.parametrize("change, error, message", BAD, ids=[m.split("\\")[0][:24] for _, _, m in BAD])
def test_rope_store_kv_rejects_bad_input_before_any_launch(change, error, message, monkeypatch):
    import sys

    def no_launch(*args, **kwargs):
        raise AssertionError("rope_store_kv launched a kernel on bad input")

    monkeypatch.setattr(sys.modules["lessonlib.ops.rope_store_kv"], "launch", no_launch)
    args = _valid(**change)
    with pytest.raises(error, match=message):
        ops.rope_store_kv(**args)


def test_rope_store_kv_refuses_inputs_that_require_grad_outside_no_grad():
    args = _valid(qkv=lambda a: a["qkv"].clone().requires_grad_())
    with pytest.raises(RuntimeError, match="rope_store_kv: no gradient flows to qkv"):
        ops.rope_store_kv(**args)
    assert torch.isnan(args["k_cache"]).all()  # refused before the launch
    with torch.no_grad():
        ops.rope_store_kv(**args)
    assert not torch.isnan(args["k_cache"].view(-1, 2, 8)[args["slots"]]).any()


@pytest.mark.skipif(not runtime.on_gpu(), reason="CUDA graphs need a GPU")
def test_rope_store_kv_without_validation_replays_from_a_cuda_graph():
    # validate=False reads nothing on the host: the call captures, and a replay sees new inputs and new slots.
    qkv, cos, sin, k_cache, v_cache, slots = inputs(8, 32, 8, 128, torch.float16, block_size=16)
    k_separate, v_separate = k_cache.clone(), v_cache.clone()
    call = lambda: ops.rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads=32, num_kv_heads=8,
                                     validate=False)
    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = call()
    qkv.copy_(torch.randn_like(qkv))
    slots.copy_(torch.randperm(k_cache.shape[0] * k_cache.shape[1], device=DEVICE)[:8])
    graph.replay()
    torch.cuda.synchronize()
    q_separate = apply_rope_then_store_kv(qkv, cos, sin, k_separate, v_separate, slots, 32, 8)
    assert torch.equal(q, q_separate)
    flat = (lambda cache: cache.view(-1, 8, 128)[slots])
    assert torch.equal(flat(k_cache), flat(k_separate)) and torch.equal(flat(v_cache), flat(v_separate))
