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


# --- The GPU profile, on GPUs this machine does not have: torch's device properties are stood in for. ---

from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

from lessonlib import runtime  # noqa: E402

H200 = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                       shared_memory_per_block_optin=232448, total_memory=150_000_000_000)
T4 = SimpleNamespace(name="Tesla T4", major=7, minor=5, multi_processor_count=40,
                     shared_memory_per_block_optin=65536, total_memory=15_828_320_256)


@pytest.fixture
def on_gpu(monkeypatch):
    """Pretend to be on a GPU whose properties the test sets; the memory fraction asked for is recorded."""
    fractions = []
    state = SimpleNamespace(props=H200, fractions=fractions)
    monkeypatch.setattr(runtime, "on_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: state.props)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: fractions.append(f))
    monkeypatch.delenv("LESSONLIB_GPU_PROFILE", raising=False)
    monkeypatch.delenv("LESSONLIB_GPU_SHARE", raising=False)
    runtime.gpu_profile.cache_clear()
    yield state
    runtime.gpu_profile.cache_clear()


def test_native_profile_reads_the_device(on_gpu):
    profile = runtime.gpu_profile()
    assert (profile.arch, profile.multiprocessors, profile.shared_memory_per_block) == (90, 132, 232448)
    assert profile.has_bfloat16 and profile.triton_tensor_cores and profile.has_tma and not profile.small
    assert runtime.dtype() is torch.bfloat16 and torch.bfloat16 in runtime.supported_dtypes()
    assert runtime.pick(cpu=1, gpu=2, small_gpu=3) == 2
    assert on_gpu.fractions == []  # nothing emulated: the whole card


def test_a_t4_has_no_bfloat16_and_small_sizes(on_gpu):
    on_gpu.props = T4
    profile = runtime.gpu_profile()
    assert profile.arch == 75 and not profile.has_bfloat16 and not profile.triton_tensor_cores
    assert runtime.dtype() is torch.float16
    assert torch.bfloat16 not in runtime.supported_dtypes()
    assert "sm_80" in runtime.why_not_bfloat16()
    assert runtime.pick(cpu=1, gpu=2, small_gpu=3) == 3
    assert runtime.pick(cpu=1, gpu=2) == 2
    assert profile.sdpa_backends() == ("EFFICIENT_ATTENTION", "MATH")
    assert profile.memory_budget < 12 * 10**9


@pytest.mark.parametrize("key", ["t4", "l4", "a100", "g4"])
def test_emulation_takes_the_profile_and_caps_memory(on_gpu, monkeypatch, key):
    monkeypatch.setenv("LESSONLIB_GPU_PROFILE", key)
    profile = runtime.gpu_profile()
    expected = runtime.PROFILES[key]
    assert (profile.capability, profile.shared_memory_per_block) == (expected.capability, expected.shared_memory_per_block)
    assert profile.emulated_on == "NVIDIA H200" and "emulated on NVIDIA H200" in profile.describe()
    assert on_gpu.fractions == [pytest.approx(expected.memory_bytes / H200.total_memory)]


@pytest.mark.parametrize("key", ["native", "t4"])
def test_a_share_of_the_gpu_scales_the_memory_budget_and_nothing_else(on_gpu, monkeypatch, key):
    """LESSONLIB_GPU_SHARE=0.4: the process plans for 40% of the card (the budget notebooks size their problems by),
    natively and under a profile; the emulated card's memory cap, the sizes' tier and the dtype policy stay."""
    monkeypatch.setenv("LESSONLIB_GPU_PROFILE", key)
    whole = runtime.gpu_profile()
    runtime.gpu_profile.cache_clear()
    monkeypatch.setenv("LESSONLIB_GPU_SHARE", "0.4")
    shared = runtime.gpu_profile()
    assert whole.memory_budget == int(0.75 * whole.memory_bytes)
    assert shared.memory_budget == int(0.75 * 0.4 * whole.memory_bytes)
    assert (shared.memory_bytes, shared.small, shared.capability) == (whole.memory_bytes, whole.small, whole.capability)
    capped = [] if key == "native" else [pytest.approx(whole.memory_bytes / H200.total_memory)] * 2
    assert on_gpu.fractions == capped  # the emulated card's cap, the same with a share as without
    assert "planning for 40% of its memory" in shared.describe() and "planning" not in whole.describe()
    for bad in ("0", "1.5", "-0.2", "half", "nan"):
        runtime.gpu_profile.cache_clear()
        monkeypatch.setenv("LESSONLIB_GPU_SHARE", bad)
        with pytest.raises(ValueError, match="LESSONLIB_GPU_SHARE"):
            runtime.gpu_profile()


def test_emulating_a_bigger_or_unknown_gpu_is_refused(on_gpu, monkeypatch):
    on_gpu.props = T4
    for key in ("a100", "g4"):  # no bfloat16 on a T4
        monkeypatch.setenv("LESSONLIB_GPU_PROFILE", key)
        with pytest.raises(ValueError, match="cannot emulate"):
            runtime.gpu_profile()
        runtime.gpu_profile.cache_clear()
    monkeypatch.setenv("LESSONLIB_GPU_PROFILE", "v100")
    with pytest.raises(ValueError, match="expected one of"):
        runtime.gpu_profile()


def test_an_emulator_needs_every_feature_and_the_memory_not_a_higher_compute_capability():
    """An H200 (sm_90) stands in for a G4 (sm_120): by feature, not by number. Nothing stands in for a GPU with a
    feature it lacks, or with more memory or shared memory per block."""
    h200, g4, a100, t4 = (runtime.PROFILES[k] for k in ("h200", "g4", "a100", "t4"))
    assert h200.stands_in_for(g4) and h200.stands_in_for(t4) and a100.stands_in_for(t4)
    assert not g4.has_wgmma and h200.has_wgmma and g4.has_bfloat16 and g4.triton_tensor_cores
    assert not t4.stands_in_for(a100)  # bfloat16
    assert not a100.stands_in_for(g4)  # TMA, and 40 of 95 GiB
    assert not g4.stands_in_for(h200)  # 99 of 227 KB of shared memory per block, 95 of 141 GiB


def test_a_size_over_the_budget_is_refused_before_allocation(on_gpu):
    on_gpu.props = T4
    runtime.check_fits(2**30, "one GiB")
    with pytest.raises(runtime.MemoryBudgetError, match="over the .* GiB budget of this Tesla T4"):
        runtime.check_fits(17 * 2**30, "a float64 reference at B2 H32 N4096")


def test_interpreter_has_no_profile():
    assert runtime.on_gpu() or runtime.gpu_profile() is None


def test_bad_input_on_a_t4_is_refused_before_any_launch(on_gpu, monkeypatch):
    """bfloat16, a forced SDPA backend the GPU lacks: each a clear error naming the reason (nothing launches: the
    tensors here are CPU tensors, so a launch would fail differently)."""
    from lessonlib import ops, sdpa

    on_gpu.props = T4
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"no bfloat16: it needs sm_80"):
        ops.swiglu(x, x)
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"No available kernel.*Tesla T4, sm_75: FLASH_ATTENTION"):
        sdpa.scaled_dot_product_attention(q, q, q, backends=("FLASH_ATTENTION", "CUDNN_ATTENTION"))
    ok, message = sdpa.try_backend("CUDNN_ATTENTION", q, q, q)
    assert not ok and "cuDNN's fused attention needs sm_80" in message
    assert sdpa.available_backends() == ("EFFICIENT_ATTENTION", "MATH")


@pytest.mark.parametrize("profile", [None, "t4", "h200"])
def test_dtype_supported_is_membership_in_supported_dtypes(monkeypatch, profile):
    monkeypatch.setattr(runtime, "gpu_profile", lambda: runtime.PROFILES[profile] if profile else None)
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.float8_e4m3fn):
        assert runtime.dtype_supported(dtype) == (dtype in runtime.supported_dtypes()), dtype


def test_source_shows_the_named_definitions_alone_and_names_a_missing_one():
    import lessonlib
    from lessonlib import ops

    whole = lessonlib.source(ops.swiglu)
    kernel = lessonlib.source(ops.swiglu, "_swiglu_kernel")
    assert kernel.startswith("@triton.jit\ndef _swiglu_kernel(") and kernel in whole
    assert "def swiglu_forward" not in kernel and len(kernel.splitlines()) < len(whole.splitlines()) // 4
    both = lessonlib.source(ops.swiglu, "swiglu_forward", "_swiglu_kernel")
    assert both.index("def swiglu_forward") < both.index("def _swiglu_kernel")  # the order asked
    with pytest.raises(ValueError, match="no top-level nope"):
        lessonlib.source(ops.swiglu, "nope")
