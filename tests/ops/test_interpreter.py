"""lessonlib._interpreter: Triton's interpreter with the helpers' repeated patching skipped gives the same bits as
the interpreter Triton ships, and scans the language a fixed number of times per launch, however many programs."""

import pytest
import torch

from lessonlib import _interpreter, ops, reference, runtime
from lessonlib.testing import poisoned_outputs
from tests.conftest import DEVICE, randn
from tests.ops.test_rope_store_kv import bits

pytestmark = pytest.mark.skipif(runtime.mode() != "interpreter",
                                reason="Triton's interpreter only: on a GPU the kernels are compiled")

def test_installed_in_interpreter_mode():
    assert _interpreter.installed()
    assert _interpreter.install()  # a second install changes nothing


def run_ops(dtype, rows, seed):
    """Three kernels that call jit helpers per program (add_rms_norm, swiglu through tl.sigmoid, rope_store_kv
    through apply_rope's _rotate_heads from another module) on inputs drawn from ``seed``: their outputs, the caches
    poisoned with NaN first."""
    torch.manual_seed(seed)
    x, residual, weight = randn(rows, 96, dtype=dtype), randn(rows, 96, dtype=dtype), randn(96, dtype=dtype)
    gate, up = randn(rows, 80, dtype=dtype), randn(rows, 80, dtype=dtype)
    heads, kv_heads, head_dim = 4, 2, 16
    qkv = randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    cos, sin = reference.rope_cos_sin(torch.randint(0, 4096, (rows,), device=DEVICE), head_dim, dtype=dtype)
    k_cache = torch.full((rows + 3, 1, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    slots = torch.randperm(rows + 3, device=DEVICE)[:rows]
    with poisoned_outputs():
        normed, summed = ops.add_rms_norm(x, residual, weight)
        activated = ops.swiglu(gate, up)
        q = ops.rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads=heads, num_kv_heads=kv_heads)
    return normed, summed, activated, q, k_cache, v_cache


@pytest.mark.parametrize("rows", [1, 13])
def test_the_same_bits_as_the_interpreter_triton_ships(dtype, rows):
    seed = int(torch.randint(0, 2**31, (1,)))  # fresh inputs every run, the same for both ways
    faster = run_ops(dtype, rows, seed)
    with _interpreter.plain_interpreter():
        plain = run_ops(dtype, rows, seed)
    for a, b in zip(faster, plain):
        assert torch.equal(bits(a), bits(b))
    assert not torch.isnan(faster[3]).any()


def test_a_launch_scans_the_language_a_fixed_number_of_times(monkeypatch):
    """Triton's _patch_lang scans with _patch_builtin; per launch that count must not grow with the programs (one
    per row here), as it did when every helper call re-patched."""
    from triton.runtime import interpreter

    scans = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *args: (scans.append(1), original(*args))[1])

    def count(rows):
        x = randn(rows, 64)
        ops.add_rms_norm(x, x.clone(), randn(64))
        ops.swiglu(x, x.clone())
        scans.clear()
        ops.add_rms_norm(x, x.clone(), randn(64))
        ops.swiglu(x, x.clone())
        return len(scans)

    assert 0 < count(2) == count(40)
    with _interpreter.plain_interpreter():
        assert count(40) > count(2)  # Triton's own: a scan per helper call, per program (what the test would catch)
