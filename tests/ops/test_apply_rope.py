import pytest
import torch

from lessonlib import ops, reference
from lessonlib.testing import check_close, check_gradients, poisoned_outputs, to_float64
from tests.conftest import DEVICE, randn


def tables(batch, seq_len, head_dim, dtype, per_batch):
    positions = torch.randint(0, 4096, (batch, seq_len) if per_batch else (seq_len,), device=DEVICE)
    return reference.rope_cos_sin(positions, head_dim, dtype=dtype)


def check_rope(q, k, cos, sin):
    with poisoned_outputs():
        q_rot, k_rot = ops.apply_rope(q, k, cos, sin)
    truth = reference.apply_rope(*to_float64(q, k, cos, sin))
    low = reference.apply_rope(q, k, cos, sin)
    check_close("apply_rope q", q_rot, truth[0], low[0])
    check_close("apply_rope k", k_rot, truth[1], low[1])


@pytest.mark.parametrize(
    "batch, heads, kv_heads, seq_len, head_dim, per_batch",
    [(1, 1, 1, 1, 2, False), (2, 4, 4, 7, 64, False), (2, 8, 2, 5, 128, True), (1, 12, 1, 3, 6, True),
     (3, 5, 5, 17, 80, False), (1, 32, 8, 2, 128, True)],
)
def test_apply_rope_matches_reference(batch, heads, kv_heads, seq_len, head_dim, per_batch, dtype):
    q = randn(batch, heads, seq_len, head_dim, dtype=dtype)
    k = randn(batch, kv_heads, seq_len, head_dim, dtype=dtype)
    cos, sin = tables(batch, seq_len, head_dim, dtype, per_batch)
    check_rope(q, k, cos, sin)


def test_apply_rope_on_transposed_layout(dtype):
    # (B, T, H, D) projections viewed as (B, H, T, D), as attention code usually does: no copy needed.
    q = randn(2, 6, 4, 32, dtype=dtype).transpose(1, 2)
    k = randn(2, 6, 2, 32, dtype=dtype).transpose(1, 2)
    cos, sin = tables(1, 6, 32, dtype, per_batch=True)  # (1, T, D) broadcasts over the batch
    check_rope(q, k, cos, sin)


@pytest.mark.parametrize(
    "shapes, error, message",
    [
        (((1, 2, 3, 7), (1, 2, 3, 7), (3, 7)), ValueError, "head_dim must be even"),
        (((1, 2, 3, 8), (1, 2, 4, 8), (3, 8)), ValueError, "must match q"),
        (((1, 2, 3, 8), (2, 2, 3, 8), (3, 8)), ValueError, "must match q"),
        (((1, 2, 3, 8), (1, 2, 3, 8), (4, 8)), ValueError, "cos must be"),
        (((2, 2, 3, 8), (2, 2, 3, 8), (3, 3, 8)), ValueError, "cos must be"),
        (((2, 3, 8), (2, 3, 8), (3, 8)), ValueError, "4-D"),
    ],
)
def test_apply_rope_rejects_bad_shapes(shapes, error, message):
    q_shape, k_shape, table_shape = shapes
    with pytest.raises(error, match=message):
        ops.apply_rope(randn(*q_shape), randn(*k_shape), randn(*table_shape), randn(*table_shape))


def test_apply_rope_rejects_mixed_dtypes_and_layouts():
    q, k, cos = randn(1, 2, 3, 8), randn(1, 2, 3, 8), randn(3, 8)
    with pytest.raises(TypeError, match="mixed dtypes"):
        ops.apply_rope(q, k, cos.half(), cos.half())
    with pytest.raises(ValueError, match="contiguous"):
        ops.apply_rope(randn(1, 2, 8, 3).transpose(-1, -2), k, cos, cos)


@pytest.mark.parametrize("batch, heads, kv_heads, seq_len, head_dim, per_batch",
                         [(1, 1, 1, 1, 2, False), (2, 3, 1, 7, 6, True), (1, 4, 2, 5, 64, False)])
def test_apply_rope_gradients_match_float64_autograd(batch, heads, kv_heads, seq_len, head_dim, per_batch, dtype):
    q = randn(batch, heads, seq_len, head_dim, dtype=dtype)
    k = randn(batch, kv_heads, seq_len, head_dim, dtype=dtype)
    cos, sin = tables(batch, seq_len, head_dim, dtype, per_batch)
    check_gradients("apply_rope", ops.apply_rope, reference.apply_rope, (q, k, cos, sin), ("q", "k", None, None))


def test_apply_rope_backward_is_the_transpose_for_any_tables():
    # Not only for rotation tables: perturbed cos/sin make the transpose differ from a rotation by minus the angle.
    q, k = randn(1, 2, 3, 8), randn(1, 1, 3, 8)
    cos, sin = randn(3, 8), randn(3, 8)
    check_gradients("apply_rope", ops.apply_rope, reference.apply_rope, (q, k, cos, sin), ("q", "k", None, None))


def test_apply_rope_refuses_tables_that_require_grad():
    q, k = randn(1, 2, 3, 8), randn(1, 1, 3, 8)
    cos, sin = tables(1, 3, 8, torch.float32, False)
    with pytest.raises(RuntimeError, match="no gradient flows to cos"):
        ops.apply_rope(q, k, cos.requires_grad_(), sin)
