"""The custom-op registrations: correct schemas and fake implementations (torch.library.opcheck), and a compiled
function calling them with fullgraph=True: no graph break, the same results."""

import torch

from lessonlib import ops, reference
from lessonlib.kv_cache import PagedKVCache
from lessonlib.testing import check_close, to_float64
from tests.conftest import DEVICE, randn


def test_opcheck_every_registered_op(dtype):
    x, residual, weight = randn(5, 48, dtype=dtype), randn(5, 48, dtype=dtype), randn(48, dtype=dtype)
    gate, up = randn(3, 7, 40, dtype=dtype), randn(3, 7, 40, dtype=dtype)
    cache = PagedKVCache(num_blocks=6, block_size=16, num_kv_heads=2, head_dim=32, dtype=dtype, device=DEVICE)
    for seq, n in (("a", 20), ("b", 1)):
        cache.add_sequence(seq)
        cache.append(seq, randn(n, 2, 32, dtype=dtype), randn(n, 2, 32, dtype=dtype))
    q = randn(2, 4, 32, dtype=dtype)
    cases = [(torch.ops.lessonlib.swiglu, (gate, up)), (torch.ops.lessonlib.add_rms_norm, (x, residual, weight, 1e-6)),
             (torch.ops.lessonlib.paged_attention,
              (q, cache.k_cache, cache.v_cache, cache.block_table(["a", "b"]), cache.seq_lens(["a", "b"]), 32 ** -0.5))]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_compiled_block_calls_the_kernels_without_a_graph_break():
    def block(x, residual, weight, gate, up):
        normed, residual = torch.ops.lessonlib.add_rms_norm(x, residual, weight, 1e-6)
        return torch.ops.lessonlib.swiglu(gate * 2.0, up), normed, residual

    dtype = torch.float16
    args = (randn(8, 64, dtype=dtype), randn(8, 64, dtype=dtype), randn(64, dtype=dtype), randn(8, 96, dtype=dtype),
            randn(8, 96, dtype=dtype))
    assert torch._dynamo.explain(block)(*args).graph_break_count == 0
    compiled = torch.compile(block, fullgraph=True)
    act, normed, residual = compiled(*args)
    x, res, weight, gate, up = args
    check_close("compiled swiglu", act, reference.swiglu(*to_float64(gate * 2.0, up)), reference.swiglu(gate * 2.0, up))
    want_normed, want_residual = reference.add_rms_norm(*to_float64(x, res, weight))
    low_normed, low_residual = reference.add_rms_norm(x, res, weight)
    check_close("compiled add_rms_norm", normed, want_normed, low_normed)
    check_close("compiled residual", residual, want_residual, low_residual)
