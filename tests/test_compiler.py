"""lessonlib.compiler: what notebook 04 reads out of torch.compile, checked on small cases."""

import torch

from lessonlib import compiler, ops, reference  # noqa: F401  (ops registers torch.ops.lessonlib.*)


def test_generated_code_of_the_gated_mlp_fuses_silu_and_mul():
    mlp, x = reference.GatedMLP(32, 64), torch.randn(8, 32)
    with torch.no_grad():
        out, generated = compiler.generated_code(mlp, x)
        torch.testing.assert_close(out, mlp(x))
    assert len(generated.fused_kernels) == 1 and "silu" in generated.fused_kernels[0]
    assert generated.library_calls == ["extern_kernels.mm"] * 3
    assert generated.launches == 4


def test_graph_breaks_are_found_with_their_reason():
    def to_python_scalar(x):
        y = x * 2
        return y / y.abs().max().item()

    def clean(x):
        y = x * 2
        return y / y.abs().max()

    found = compiler.graph_breaks(to_python_scalar, torch.randn(8))
    assert len(found) == 1 and "item" in found[0].reason and "max().item()" in found[0].where
    assert compiler.graph_breaks(clean, torch.randn(8)) == []


def test_recompilations_are_counted():
    inputs = [(torch.randn(n),) for n in (8, 16, 24)]
    assert compiler.count_compilations(torch.sin, inputs, dynamic=False) == 3
    assert compiler.count_compilations(torch.sin, inputs, dynamic=True) == 1


def test_torch_logs_come_from_a_fresh_process():
    lines = compiler.torch_logs("import torch\nf = torch.compile(torch.sin)\nf(torch.randn(8))\nf(torch.randn(16))",
                                "recompiles")
    assert any("size mismatch" in line for line in lines), lines
