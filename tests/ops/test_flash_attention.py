import weakref

import pytest
import torch

from lessonlib import ops, reference, runtime
from lessonlib.ops.flash_attention import forward_config, flash_attention_dtypes
from lessonlib.testing import attention_allowance, check_attention, check_close, poisoned_outputs, to_float64
from tests.conftest import DEVICE, randn

FA_DTYPES = flash_attention_dtypes()


@pytest.fixture(params=FA_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def fa_dtype(request):
    return request.param


def inputs(batch, heads, kv_heads, n_q, n_kv, head_dim, dtype):
    return (randn(batch, heads, n_q, head_dim, dtype=dtype), randn(batch, kv_heads, n_kv, head_dim, dtype=dtype),
            randn(batch, kv_heads, n_kv, head_dim, dtype=dtype))


def check_forward_and_backward(q, k, v, causal):
    """Output and all three gradients against float64 autograd through the textbook reference (the rule and its
    reasoning: lessonlib.testing.check_attention), then the log-sum-exp the backward relies on."""
    check_attention(ops.flash_attention, q, k, v, causal)
    with poisoned_outputs():
        _, lse = ops.flash_attention(q, k, v, causal=causal, return_lse=True)
    _, truth_lse = reference.flash_attention_tiled(*to_float64(q, k, v), causal=causal)
    finite = torch.isfinite(truth_lse)  # -inf where a query sees no key
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite].double(), truth_lse[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_q, n_kv", [(1, 1), (17, 17), (64, 64), (130, 257), (257, 130), (1, 257)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_any_lengths(n_q, n_kv, causal, fa_dtype):
    check_forward_and_backward(*inputs(1, 2, 1, n_q, n_kv, 32, fa_dtype), causal)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (8, 1)], ids=["MHA", "GQA4", "MQA8"])
def test_grouped_query_heads(heads, kv_heads, fa_dtype):
    check_forward_and_backward(*inputs(2, heads, kv_heads, 33, 47, 16, fa_dtype), causal=True)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_every_head_dim(head_dim, fa_dtype):
    check_forward_and_backward(*inputs(1, 2, 2, 20, 36, head_dim, fa_dtype), causal=True)


def test_causal_fewer_queries_than_keys_continues_a_prefix(fa_dtype):
    """Nq < Nkv: the queries are the last Nq positions (a chunk after a cached prefix)."""
    check_forward_and_backward(*inputs(2, 4, 2, 9, 70, 32, fa_dtype), causal=True)


def test_causal_more_queries_than_keys_leaves_early_queries_empty(fa_dtype):
    q, k, v = inputs(1, 2, 1, 40, 7, 32, fa_dtype)
    check_forward_and_backward(q, k, v, causal=True)
    out = ops.flash_attention(q, k, v, causal=True)
    assert torch.all(out[:, :, :33] == 0), "queries that see no key must get 0"


def test_strided_inputs(fa_dtype):
    """(B, N, H, D) projections viewed as (B, H, N, D): no copy needed, only the last dimension must be contiguous."""
    qkv = randn(2, 37, 3 * 4, 32, dtype=fa_dtype)
    q, k, v = qkv.transpose(1, 2).split(4, dim=1)
    assert not q.is_contiguous()
    check_forward_and_backward(q, k, v, causal=False)


def test_causal_tiles_above_the_diagonal_are_never_read(fa_dtype):
    """NaN in every key/value the first query tile must not see: if the kernel loaded those tiles at all (even to
    mask them), 0 * NaN would reach the tile's output."""
    block_m = forward_config(32)["BLOCK_M"]
    q, k, v = inputs(1, 2, 2, 2 * block_m, 2 * block_m, 32, fa_dtype)
    k[:, :, block_m:], v[:, :, block_m:] = float("nan"), float("nan")
    out = ops.flash_attention(q, k, v, causal=True)
    assert torch.isfinite(out[:, :, :block_m]).all(), "the first query tile read key tiles above the diagonal"
    truth = reference.attention(*to_float64(q[:, :, :block_m], k[:, :, :block_m], v[:, :, :block_m]), causal=True)
    check_close("flash_attention (first tile)", out[:, :, :block_m], truth,
                reference.attention(q[:, :, :block_m], k[:, :, :block_m], v[:, :, :block_m], causal=True),
                allowance=attention_allowance(q[:, :, :block_m], k[:, :, :block_m], v[:, :, :block_m]))


def test_tiled_reference_equals_textbook_attention():
    for causal in (False, True):
        q, k, v = to_float64(*inputs(2, 4, 2, 45, 70, 16, torch.float32))
        out, _ = reference.flash_attention_tiled(q, k, v, causal=causal, block_m=16, block_n=32)
        torch.testing.assert_close(out, reference.attention(q, k, v, causal=causal), rtol=1e-12, atol=1e-12)


def test_additive_mask_in_the_textbook_reference():
    q, k, v = to_float64(*inputs(1, 2, 2, 5, 9, 16, torch.float32))
    causal = torch.zeros(5, 9, dtype=torch.float64, device=q.device).masked_fill(
        ~reference.causal_mask(5, 9, q.device), float("-inf"))
    torch.testing.assert_close(reference.attention(q, k, v, mask=causal), reference.attention(q, k, v, causal=True))


@pytest.mark.parametrize("case, error, match", [
    ("head_dim 48", ValueError, "head_dim must be one of"),
    ("heads 6 over 4", ValueError, "not a multiple"),
    ("batch mismatch", ValueError, "batch sizes differ"),
    ("head_dim mismatch", ValueError, "head_dim differs"),
    ("k, v shapes differ", ValueError, "same shape"),
    ("dtype mismatch", TypeError, "mixed dtypes"),
    ("rank 3", ValueError, r"must be \(B, H, N, D\)"),
    ("unsupported dtype", TypeError, "not supported|supported here"),
    ("mixed devices", ValueError, "different devices"),
])
def test_bad_input_is_refused_before_launch(case, error, match):
    dtype = FA_DTYPES[0]
    q, k, v = inputs(2, 4, 2, 8, 8, 32, dtype)
    if case == "head_dim 48":
        q, k, v = inputs(2, 4, 2, 8, 8, 48, dtype)
    elif case == "heads 6 over 4":
        q, k, v = inputs(2, 6, 4, 8, 8, 32, dtype)
    elif case == "batch mismatch":
        k, v = k[:1], v[:1]
    elif case == "head_dim mismatch":
        k, v = inputs(2, 4, 2, 8, 8, 64, dtype)[1:]
    elif case == "k, v shapes differ":
        v = v[:, :, :5]
    elif case == "dtype mismatch":
        k = k.to(torch.float32 if dtype != torch.float32 else torch.float16)  # a T4 has one flash dtype only
    elif case == "rank 3":
        q = q[0]
    elif case == "unsupported dtype":
        wrong = torch.float32 if runtime.on_gpu() else torch.float64
        q, k, v = (t.to(wrong) for t in (q, k, v))
    elif case == "mixed devices":
        k = torch.empty(k.shape, dtype=k.dtype, device="meta")
    with pytest.raises(error, match=match):
        ops.flash_attention(q, k, v)


@pytest.mark.parametrize("n_q, n_kv", [(64, 64), (40, 70), (40, 7), (33, 47), (1, 100), (130, 130)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tile_plan_skips_exactly_the_invisible_tiles(n_q, n_kv, causal):
    """Skipped tiles hold no visible (query, key) pair; unmasked tiles hold only visible pairs and a whole key tile
    (rows past Nq are padding, never stored); a tile holding any visible pair is computed."""
    from lessonlib.ops.flash_attention import tile_plan

    block_m, block_n = 16, 32
    plan = tile_plan(n_q, n_kv, block_m, block_n, causal)
    visible = reference.causal_mask(n_q, n_kv) if causal else torch.ones(n_q, n_kv, dtype=torch.bool)
    for i in range(plan.shape[0]):
        for j in range(plan.shape[1]):
            tile = visible[i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n]
            full = tile.all() and tile.shape[1] == block_n
            assert (plan[i, j] == 0) == (not tile.any()), (i, j, plan)
            if plan[i, j] == 1:
                assert full, (i, j, plan)


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the bytes of every tensor the ops under it create, while it lives: the peak of what a function holds
    at once beyond its inputs (views share their base's storage and are not counted twice)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t._base is None and t.untyped_storage().data_ptr() not in self.live:
                key = t.untyped_storage().data_ptr()
                self.live[key] = t.untyped_storage().nbytes()
                self.now += self.live[key]
                self.peak = max(self.peak, self.now)
                weakref.finalize(t, self._free, key)
        return out

    def _free(self, key):
        self.now -= self.live.pop(key, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_score_bytes_is_the_textbook_references_peak(dtype, causal):
    """Lesson 02 sizes its naive-attention timings by reference.attention_score_bytes (runtime.check_fits): it must
    be what the reference holds at once, counted tensor by tensor here, not the scores in the inputs' dtype (a sixth
    of it in 16 bits: on the H200 that planned 52 GB for N=16,384 and held 100)."""
    q, k, v = (randn(1, 4, n, 32, dtype=dtype) for n in (96, 160, 160))
    with _LiveBytes() as counted:
        out = reference.attention(q, k, v, causal=causal)
    scores = reference.attention_score_bytes(1, 4, 96, 160, dtype)
    nbytes = lambda t: t.numel() * t.element_size()
    # Beyond the scores: the output, contiguous copies of K and V that matmul may make (the CPU's bmm does), and P
    # cast back to 16 bits while its float32 copy lives.
    extra = nbytes(out) + nbytes(k) + nbytes(v) + (scores // 6 if dtype.itemsize < 4 else 0)
    assert scores <= counted.peak <= scores + extra, (counted.peak, scores)
