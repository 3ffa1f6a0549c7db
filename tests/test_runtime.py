"""The mode must be decided before Triton is imported; each case runs in a fresh interpreter."""

import os
import subprocess
import sys

import pytest


def run(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LESSONLIB_MODE")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**environ, **env}, timeout=300)


def test_importing_lessonlib_imports_no_triton():
    result = run("import sys, lessonlib; assert 'triton' not in sys.modules, 'triton imported'; print('ok')")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_describe_then_kernels_work_in_the_interpreter():
    code = (
        "import lessonlib; print(lessonlib.describe()); import torch; from lessonlib import ops; "
        "g, u = torch.randn(3, 5), torch.randn(3, 5); "
        "torch.testing.assert_close(ops.swiglu(g, u), torch.nn.functional.silu(g) * u)"
    )
    result = run(code, LESSONLIB_MODE="interpreter")
    assert result.returncode == 0, result.stderr
    assert "Triton interpreter on CPU" in result.stdout


def test_triton_imported_in_the_other_mode_is_a_clear_error():
    result = run("import triton.language; import lessonlib; lessonlib.mode()", LESSONLIB_MODE="interpreter")
    assert result.returncode != 0
    assert "import lessonlib before triton" in result.stderr


def test_unknown_mode_is_rejected():
    result = run("import lessonlib; lessonlib.mode()", LESSONLIB_MODE="tpu")
    assert result.returncode != 0
    assert "LESSONLIB_MODE='tpu'" in result.stderr


@pytest.mark.parametrize("mode, expected", [("interpreter", "64")])
def test_pick_follows_the_mode(mode, expected):
    result = run("import lessonlib; print(lessonlib.pick(cpu=64, gpu=8192))", LESSONLIB_MODE=mode)
    assert result.stdout.strip() == expected, result.stderr
