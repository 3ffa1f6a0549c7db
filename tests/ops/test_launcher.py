"""The cached launch (lessonlib/ops/_launcher.py): its key against Triton's own specialization, its cache logic
with a recording stand-in for Triton's kernel (any machine), the plain path in the interpreter, and on the GPU the
cached path bit for bit against the plain one, for every public op, including the cases a wrong hit would break."""

import os
import sys
from pathlib import Path

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel

from lessonlib import ops, reference, runtime
from lessonlib.ops import _common, _launcher, _plans
from lessonlib.ops.flash_attention import flash_attention_dtypes
from tests.conftest import randn

_swiglu_module = sys.modules["lessonlib.ops.swiglu"]
_add_rms_norm_module = sys.modules["lessonlib.ops.add_rms_norm"]
_ROOT = Path(__file__).resolve().parents[2]
gpu_only = pytest.mark.skipif(not runtime.on_gpu(), reason="the cached launch runs on a GPU only")


@pytest.fixture(autouse=True, scope="module")
def cached_path_turned_on():
    """The cached path is on unless LESSONLIB_FAST_LAUNCH=0: on for this module's tests whatever the environment
    says, decided afresh, and the process's earlier decision put back after them."""
    saved_env, saved = os.environ.get(_launcher.ENV), list(_launcher._decided)
    os.environ[_launcher.ENV] = "1"
    _launcher._decided.clear()
    yield
    _launcher._decided[:] = saved
    if saved_env is None:
        os.environ.pop(_launcher.ENV, None)
    else:
        os.environ[_launcher.ENV] = saved_env


# --- the key ---------------------------------------------------------------------------------------------------

def test_key_separates_what_triton_specializes_apart():
    """Samples at every boundary (ints at 1, multiples of 16, 32/64 bits; tensors at every offset mod 16): two with
    one key are specialized alike by this Triton's own function (here for an sm_90 backend, as on an H200)."""
    backend = triton.compiler.make_backend(GPUTarget("cuda", 90, 32))
    assert _launcher.specialization_problem(backend, runtime.device()) is None


def test_a_key_blind_to_alignment_is_caught(monkeypatch):
    """The check above can fail: a key that ignores a pointer's alignment is named."""
    backend = triton.compiler.make_backend(GPUTarget("cuda", 90, 32))
    real = _launcher.configuration_key
    monkeypatch.setattr(_launcher, "configuration_key", lambda kernel, device, args, meta: real(
        kernel, device, [torch.empty(16, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args], meta))
    assert "differently" in _launcher.specialization_problem(backend, runtime.device())


def test_plain_twins_of_tritons_helpers():
    for n in [*range(0, 4100), 2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3]:
        assert _common.next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in (0, 1, 7, 16, 17, 14336, 2**33 + 5):
        for b in (1, 2, 16, 2048):
            assert _common.cdiv(a, b) == triton.cdiv(a, b)


# --- the cache logic, with a recording stand-in for Triton (no GPU needed) -------------------------------------

class _Compiled:
    """Stands in for Triton's CompiledKernel: its launcher records each call."""

    def __init__(self, calls):
        self.calls, self.function, self.packed_metadata = calls, object(), (4, 1, 0)

    def run(self, *launch):
        self.calls.append(("cached", launch))


class _Kernel(triton.runtime.jit.JITFunction):
    """A JITFunction of ``fn`` (Triton's own parameter list, hooks, globals) whose ``kernel[grid](...)`` records
    the call and returns a stand-in compiled kernel instead of compiling."""

    def __init__(self, fn):
        super().__init__(fn)
        self.calls = []
        self.compiled = _Compiled(self.calls)

    def __getitem__(self, grid):
        def plain(*args, **meta):
            self.calls.append(("plain", grid, args, meta))
            return self.compiled
        return plain


class _Driver:
    device, stream = 0, 1234

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return self.stream + device


@pytest.fixture
def cached(monkeypatch):
    """_launcher as on a GPU where the probe passed, with an empty cache and a stand-in driver."""
    monkeypatch.setattr(_launcher, "works_here", lambda: True)
    monkeypatch.setattr(_launcher, "_compiled", {})
    driver = _Driver()
    monkeypatch.setattr(_launcher, "_driver", lambda: driver)
    return driver


def _swiglu_call(n_cols=96, rows=3, dtype=torch.float32, offset=0):
    gate = torch.empty(rows * n_cols + offset, dtype=dtype)[offset:].view(rows, n_cols)
    up, out = torch.empty(rows, n_cols, dtype=dtype), torch.empty(rows, n_cols, dtype=dtype)
    return (gate, up, out, n_cols, n_cols, n_cols, n_cols), {"BLOCK": 128, "num_warps": 4}


def _kinds(kernel):
    return [call[0] for call in kernel.calls]


def test_second_call_of_a_configuration_goes_to_the_compiled_launcher(cached):
    kernel = _Kernel(_swiglu_module._swiglu_kernel.fn)
    args, meta = _swiglu_call()
    assert _launcher.launch(kernel, (3,), args, meta) is kernel.compiled
    assert _launcher.launch(kernel, (5, 2), args, meta) is kernel.compiled
    assert _kinds(kernel) == ["plain", "cached"]
    launch = kernel.calls[1][1]
    # what JITFunction.run passes: the grid as three ints, the stream, the function, the packed metadata, no launch
    # metadata or hooks, then every parameter in signature order (the constexpr BLOCK last)
    assert launch[:9] == (5, 2, 1, 1234, kernel.compiled.function, (4, 1, 0), None, None, None)
    assert launch[9:] == (*args, 128)


def test_defaulted_constexprs_are_passed_in_signature_order(cached):
    kernel = _Kernel(_add_rms_norm_module._add_rms_norm_kernel.fn)  # ... BLOCK, ONE_PASS, PDL=False
    x, r, w, o, ro = (torch.empty(2, 64) for _ in range(5))
    args = (x, r, w[0], o, ro, 64, 64, 64, 1e-6)
    for _ in range(2):
        _launcher.launch(kernel, (2,), args, {"BLOCK": 64, "ONE_PASS": True, "num_warps": 1})
    assert _kinds(kernel) == ["plain", "cached"] and kernel.calls[1][1][9:] == (*args, 64, True, False)


class _RecordingCompiled(_Compiled):
    """A stand-in compiled kernel for Triton's real JITFunction.run: its launch_metadata is Triton's own."""
    name, src = "stand-in", None
    launch_metadata = CompiledKernel.launch_metadata

    def _init_handles(self):
        pass


@pytest.mark.parametrize("op", ["swiglu", "add_rms_norm"])
def test_the_cached_launch_passes_what_tritons_own_launch_passes(cached, monkeypatch, op):
    """Triton's real JITFunction.run (binder, defaults, cache, launch metadata), its compile stubbed to return a
    recording kernel, against the cached launch of the same call: the same grid, stream, function, metadata and
    arguments (constexprs and defaults in signature order), the launch metadata and hooks left out."""
    monkeypatch.setattr(triton.runtime.driver, "_active", _StandInTarget())
    if op == "swiglu":
        kernel = triton.runtime.jit.JITFunction(_swiglu_module._swiglu_kernel.fn)
        args, meta = _swiglu_call()
    else:
        kernel = triton.runtime.jit.JITFunction(_add_rms_norm_module._add_rms_norm_kernel.fn)
        x, w = torch.empty(2, 64), torch.empty(64)
        args, meta = (x, x, w, x, x, 64, 64, 64, 1e-6), {"BLOCK": 64, "ONE_PASS": True, "num_warps": 1}
    calls = []
    compiled = _RecordingCompiled(calls)
    monkeypatch.setattr(kernel, "_do_compile", lambda *a, **k: compiled)
    for _ in range(2):
        _launcher.launch(kernel, (3, 2), args, meta)
    (plain, cached_launch) = (launch for kind, launch in calls)
    assert cached_launch[:6] == plain[:6] == (3, 2, 1, 1234, compiled.function, compiled.packed_metadata)
    assert cached_launch[6:9] == (None, None, None)  # no launch hook set: nothing would read them
    assert len(cached_launch) == len(plain) and all(a is b for a, b in zip(cached_launch[9:], plain[9:]))


class _StandInTarget(_Driver):
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


@pytest.mark.parametrize("change", ["misaligned pointer", "int becomes 1", "int past 32 bits", "int loses 16",
                                    "dtype", "constexpr", "option", "device"])
def test_every_change_triton_specializes_on_takes_the_plain_path(cached, change):
    """Each change would make Triton compile another kernel: the cached one must not be launched for it."""
    kernel = _Kernel(_swiglu_module._swiglu_kernel.fn)
    args, meta = _swiglu_call(n_cols=96)
    _launcher.launch(kernel, (3,), args, meta)
    if change == "misaligned pointer":
        args, meta = _swiglu_call(n_cols=96, offset=1)
    elif change == "dtype":
        args, meta = _swiglu_call(n_cols=96, dtype=torch.float16)
    elif change == "constexpr":
        meta = {**meta, "BLOCK": 256}
    elif change == "option":
        meta = {**meta, "num_warps": 8}
    elif change == "device":
        cached.device = 1
    else:
        n_cols = {"int becomes 1": 1, "int past 32 bits": 2**31 + 96, "int loses 16": 97}[change]
        args = (*args[:3], n_cols, *args[4:])
    _launcher.launch(kernel, (3,), args, meta)
    assert _kinds(kernel) == ["plain", "plain"]
    _launcher.launch(kernel, (3,), args, meta)  # and the new configuration is cached in turn
    assert _kinds(kernel) == ["plain", "plain", "cached"]


class _KeyedCompiled(_RecordingCompiled):
    """The stand-in compiled kernel Triton's stubbed compile returns for one of its cache keys: a launch records it."""

    def __init__(self, key, launches):
        super().__init__(launches)
        self.key = key

    def run(self, *launch):
        self.calls.append(self.key)


@pytest.fixture
def triton_kernel(cached, monkeypatch):
    """_launcher._probe_kernel (x_ptr, out_ptr, n, scale, BLOCK, SHIFT=1) as Triton's own JITFunction, its compile
    stubbed: one stand-in compiled kernel per Triton cache key, and ``launches`` lists the key of each launch."""
    monkeypatch.setattr(triton.runtime.driver, "_active", _StandInTarget())
    kernel = triton.runtime.jit.JITFunction(_launcher._probe_kernel.fn)
    kernel.launches, compiled = [], {}
    monkeypatch.setattr(kernel, "_do_compile", lambda key, *a, **k: compiled.setdefault(
        key, _KeyedCompiled(key, kernel.launches)))
    return kernel


def _launched_as_triton_would(kernel, args, meta):
    """Launch through the cache, then through Triton's own ``kernel[grid]``: the two launched the kernel compiled
    for one key, or both raised the same error."""
    outcomes = []
    for launch in (lambda: _launcher.launch(kernel, (1,), args, meta), lambda: kernel[(1,)](*args, **meta)):
        before, error = len(kernel.launches), None
        try:
            launch()
        except (OverflowError, TypeError) as raised:
            error = type(raised)
        outcomes.append((error, kernel.launches[before:]))
    return outcomes[0] == outcomes[1] and len(outcomes[1][1]) == (error is None), outcomes


_TENSOR = torch.empty(64)


@pytest.mark.parametrize("first, then", [
    ({"n": 2**63}, {"n": 2**64}), ({"n": 2**63 + 16}, {"n": 2**64 + 16}), ({"n": 2**63}, {"n": -(2**63) - 1}),
    ({"n": 1}, {"n": True}), ({"scale": 0.5}, {"scale": True}), ({"SHIFT": 1}, {"SHIFT": True}),
    ({"SHIFT": 1}, {"SHIFT": 1.0}), ({"SHIFT": 0}, {"SHIFT": False}), ({"BLOCK": 16}, {"BLOCK": 16.0}),
    ({"n": 16}, {"n": torch.tensor(16).numpy()[()]}), ({"SHIFT": 2}, {}), ({"SHIFT": 0.0}, {"SHIFT": -0.0}),
    ({"SHIFT": (1, 2)}, {"SHIFT": (1.0, 2)})])
def test_a_cached_launch_runs_the_kernel_tritons_own_launch_would(triton_kernel, first, then):
    """An int past 64 bits (Triton raises; a cached uint64 kernel would wrap it), a bool or numpy int, a constexpr
    changed in a way Python's == cannot see (1, 1.0, True; 0.0, -0.0: Triton's own key cache cannot either), a
    default: what the cache launches is what Triton's real binder picks, or both raise."""
    call = {"n": 1000, "scale": 0.5, "BLOCK": 16}
    for change in (first, then, then):
        values = {**call, **change}
        args, meta = (_TENSOR, _TENSOR, values.pop("n"), values.pop("scale")), values
        same, outcomes = _launched_as_triton_would(triton_kernel, args, meta)
        assert same, (change, outcomes)


def test_a_cached_launch_runs_what_triton_would_in_any_order(triton_kernel):
    """Ints around every boundary and floats, as n and scale, in a fresh random order (so which value of a key
    fills the cache changes from run to run): every launch is the one Triton's own binder picks, or both raise."""
    ints = [v for v in _launcher.specialization_samples("cpu") if isinstance(v, int)]
    values = [("n", v) for v in ints] + [("scale", v) for v in (0.0, -2.5, 1e300, float("nan"), True)]
    for i in torch.randperm(len(values)).tolist():
        call = {"n": 1000, "scale": 0.5, values[i][0]: values[i][1]}
        same, outcomes = _launched_as_triton_would(triton_kernel, (_TENSOR, _TENSOR, call["n"], call["scale"]),
                                                   {"BLOCK": 16})
        assert same, (values[i], outcomes)


@pytest.mark.parametrize("reason", ["launch hook", "pre-run hook", "global changed", "plain_launches", "list grid",
                                    "None argument"])
def test_a_cached_configuration_still_takes_the_plain_path_when(cached, monkeypatch, reason):
    kernel = _Kernel(_swiglu_module._swiglu_kernel.fn)
    args, meta = _swiglu_call()
    grid = (3,)
    where = {"LIMIT": 1}
    kernel.used_global_vals = {("LIMIT", id(where)): (1, where)}
    _launcher.launch(kernel, grid, args, meta)
    if reason == "launch hook":
        monkeypatch.setattr(triton.knobs.runtime.launch_enter_hook, "calls", [lambda metadata: None])
    elif reason == "pre-run hook":
        kernel.pre_run_hooks.append(lambda *a, **k: None)
    elif reason == "global changed":
        where["LIMIT"] = 2  # Triton's plain path raises for this; the cached one must not hide it
    elif reason == "list grid":
        grid = [3]
    elif reason == "None argument":
        args = (*args[:2], None, *args[3:])
    if reason == "plain_launches":
        with _launcher.plain_launches():
            _launcher.launch(kernel, grid, args, meta)
    else:
        _launcher.launch(kernel, grid, args, meta)
    assert _kinds(kernel) == ["plain", "plain"]


def test_an_autotuner_or_other_wrapper_is_never_cached(cached):
    class Wrapper:  # what triton.autotune returns is not a JITFunction: it picks a config on each call
        def __init__(self, kernel):
            self.params, self.kernel = kernel.params, kernel

        def __getitem__(self, grid):
            return self.kernel[grid]

    kernel = _Kernel(_swiglu_module._swiglu_kernel.fn)
    wrapper, (args, meta) = Wrapper(kernel), _swiglu_call()
    for _ in range(2):
        _launcher.launch(wrapper, (3,), args, meta)
    assert _kinds(kernel) == ["plain", "plain"]


def test_kernels_whose_arguments_the_launcher_cannot_place_are_never_cached(cached):
    """A constexpr passed positionally (its value is not in the key) is left to Triton on every call."""
    kernel = _Kernel(_launcher._probe_kernel.fn)  # (x_ptr, out_ptr, n, scale, BLOCK, SHIFT=1)
    x = torch.empty(16)
    for _ in range(2):
        _launcher.launch(kernel, (1,), (x, x, 16, 0.5, 16), {})
    assert _kinds(kernel) == ["plain", "plain"]


def test_the_decision_waits_for_a_launch_outside_cuda_graph_capture(monkeypatch):
    """The probe launches and syncs, which a capture forbids: during one, launches are plain and nothing is decided."""
    monkeypatch.setattr(_launcher, "_decided", [])
    monkeypatch.setattr(_launcher.runtime, "on_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not _launcher.works_here() and _launcher._decided == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    decisions = []
    monkeypatch.setattr(_launcher, "_decide", lambda: decisions.append(1))  # None: the cached path works
    assert _launcher.works_here() and _launcher.works_here() and decisions == [1]


@pytest.mark.parametrize("value", [None, "0"])
def test_a_pretended_gpu_decides_without_asking_cuda(monkeypatch, value):
    """Tests elsewhere pretend a GPU in the interpreter (runtime.on_gpu patched): on by default or turned off,
    deciding must not ask torch.cuda what a CPU build of torch cannot answer (is a stream capturing?)."""
    if value is None:
        monkeypatch.delenv(_launcher.ENV, raising=False)
    else:
        monkeypatch.setenv(_launcher.ENV, value)
    monkeypatch.setattr(_launcher, "_decided", [])
    monkeypatch.setattr(_launcher.runtime, "on_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: pytest.fail("torch.cuda was asked"))
    assert not _launcher.works_here()


def test_why_not_asked_during_a_capture_decides_nothing(monkeypatch):
    """why_not() is public (bench_per_call.py asks it): asked first inside a capture, it must not run the probe."""
    monkeypatch.setattr(_launcher, "_decided", [])
    monkeypatch.setattr(_launcher.runtime, "on_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(_launcher, "_decide", lambda: pytest.fail("the probe ran during a capture"))
    assert _launcher.why_not().startswith("not decided yet") and _launcher._decided == []


def _probe_reference(x, out, n, scale, BLOCK, SHIFT=1):
    """What _launcher._probe_kernel computes, in PyTorch."""
    out[:n] = x[:n] * scale + SHIFT + torch.arange(n, dtype=x.dtype, device=x.device)


class _ProbeKernel(_Kernel):
    """_probe_kernel's JITFunction whose plain launch computes in PyTorch, and whose compiled launcher hands the
    kernel's own arguments (after the nine launch arguments) to ``cached_launch``."""

    def __init__(self, cached_launch):
        super().__init__(_launcher._probe_kernel.fn)
        self.compiled.run = lambda *launch: self.calls.append("cached") or cached_launch(*launch[9:])

    def __getitem__(self, grid):
        def plain(*args, **meta):
            _probe_reference(*args, **{name: value for name, value in meta.items() if name != "num_warps"})
            return self.compiled
        return plain


@pytest.mark.parametrize("launcher", ["right", "drops the default constexpr"])
def test_the_probe_launches_through_launch_itself_and_compares(monkeypatch, launcher):
    """The probe takes the path the ops take (launch(): key, cache, constexprs in signature order), even when asked
    inside plain_launches(), leaves the decision to why_not(), and names a cached launch that computes otherwise."""
    cached_launch = _probe_reference if launcher == "right" else lambda *args: _probe_reference(*args[:5], SHIFT=0)
    kernel = _ProbeKernel(cached_launch)
    monkeypatch.setattr(_launcher, "_probe_kernel", kernel)
    monkeypatch.setattr(_launcher, "_compiled", {})
    monkeypatch.setattr(_launcher, "_decided", [])
    monkeypatch.setattr(_launcher, "_driver", lambda: _Driver())
    with _launcher.plain_launches():
        problem = _launcher._probe_problem()
        assert _launcher._forced_plain == [True]
    assert _launcher._decided == [] and kernel.calls.count("cached") == 1
    assert [e.kernel for e in _launcher._compiled.values()] == [kernel]
    assert (problem is None) == (launcher == "right"), problem


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_the_cached_path_is_on_unless_the_environment_turns_it_off(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(_launcher.ENV, raising=False)
    else:
        monkeypatch.setenv(_launcher.ENV, value)
    monkeypatch.setattr(_launcher.runtime, "on_gpu", lambda: False)  # past the switch, _decide stops here
    assert _launcher._decide().startswith("not on a GPU" if on else f"{_launcher.ENV}=0")


# --- the plain path in the interpreter, and where the public ops dispatch --------------------------------------

@pytest.mark.skipif(runtime.on_gpu(), reason="the interpreter's path")
def test_the_interpreter_always_takes_the_plain_path(monkeypatch):
    assert "not on a GPU" in _launcher.why_not()
    monkeypatch.setattr(_launcher, "launch", lambda *a: pytest.fail("the cached launcher ran in the interpreter"))
    gate, up = randn(3, 37), randn(3, 37)
    assert torch.equal(ops.swiglu(gate, up), _swiglu_module.swiglu_forward(gate, up))


@pytest.mark.parametrize("grad_enabled, wants_custom_op", [(True, True), (False, False)])
def test_the_custom_op_only_where_autograd_records(monkeypatch, grad_enabled, wants_custom_op):
    """Inputs that require grad go through torch.ops.lessonlib.* only with grad enabled (no_grad: the launcher)."""
    used = []
    monkeypatch.setattr(_swiglu_module, "_SWIGLU", lambda *a: used.append("swiglu") or torch.zeros(()))
    monkeypatch.setattr(_add_rms_norm_module, "_ADD_RMS_NORM", lambda *a: used.append("add_rms_norm") or (None, None))
    gate, up = randn(1, 9).requires_grad_(), randn(1, 9)
    x, r, w = randn(1, 9), randn(1, 9), randn(9).requires_grad_()
    with torch.set_grad_enabled(grad_enabled):
        ops.swiglu(gate, up)
        ops.add_rms_norm(x, r, w)
    assert used == (["swiglu", "add_rms_norm"] if wants_custom_op else [])


# --- on the GPU: the cached path is on, bit-identical to the plain one, and never wrongly hit -------------------

@gpu_only
def test_the_cached_path_is_on_here():
    """The probe passed with this Triton (the GPU machine's: 3.6 at the time of writing)."""
    assert _launcher.why_not() is None


def _public_calls(dtype):
    gate, up = randn(5, 2 * 300, dtype=dtype).chunk(2, dim=-1)  # strided rows, odd width
    x, r, w = randn(7, 123, dtype=dtype), randn(7, 123, dtype=dtype), randn(123, dtype=dtype)
    q, k = randn(1, 4, 9, 64, dtype=dtype), randn(1, 2, 9, 64, dtype=dtype)
    cos, sin = reference.rope_cos_sin(torch.arange(9, device=runtime.device()), 64, dtype=dtype)
    weight = randn(33, 123, dtype=dtype)
    weight_int8 = torch.randint(-127, 128, (40, 64), dtype=torch.int8, device=runtime.device())
    scales, m = randn(40, dtype=dtype), randn(3, 64, dtype=dtype)
    gate_bias, up_bias = randn(300, dtype=dtype), randn(300, dtype=dtype)
    calls = {
        "swiglu": lambda: ops.swiglu(gate, up),
        "add_rms_norm": lambda: ops.add_rms_norm(x, r, w),
        "bias_swiglu": lambda: ops.bias_swiglu(gate, up, gate_bias, up_bias),
        "absmax_normalize two_launches": lambda: ops.absmax_normalize(x, "two_launches"),
        "absmax_normalize one_program": lambda: ops.absmax_normalize(x, "one_program"),
        "apply_rope": lambda: ops.apply_rope(q, k, cos, sin),
        "argmax": lambda: ops.argmax(x),
        "gemv": lambda: ops.gemv(x[:2], weight),
        "dequant_matmul": lambda: ops.dequant_matmul(m, weight_int8, scales),
    }
    if dtype in flash_attention_dtypes():
        calls["flash_attention"] = lambda: ops.flash_attention(q, q, q, causal=True)
    return {**calls, **_paged_calls(dtype)}


def _paged_calls(dtype):
    """The KV-cache ops: the in-place writers on fresh copies of one cache (their output is the cache), then
    attention through block tables over it."""
    device = runtime.device()
    k_cache, v_cache = randn(4, 16, 2, 64, dtype=dtype), randn(4, 16, 2, 64, dtype=dtype)  # 4 pages of 16 tokens
    slots = torch.randperm(64, device=device)[:5]
    k, v, qkv = randn(5, 2, 64, dtype=dtype), randn(5, 2, 64, dtype=dtype), randn(5, (4 + 2 * 2) * 64, dtype=dtype)
    cos, sin = reference.rope_cos_sin(torch.arange(5, device=device), 64, dtype=dtype)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    seq_lens, starts = (torch.tensor(v, dtype=torch.int32, device=device) for v in ([20, 9], [0, 3, 5]))
    q_decode, q_prefill = randn(2, 4, 64, dtype=dtype), randn(5, 4, 64, dtype=dtype)

    def store_kv():
        kc, vc = k_cache.clone(), v_cache.clone()
        ops.store_kv(k, v, kc, vc, slots)
        return kc, vc

    def rope_store_kv():
        kc, vc = k_cache.clone(), v_cache.clone()
        return ops.rope_store_kv(qkv, cos, sin, kc, vc, slots, num_heads=4, num_kv_heads=2), kc, vc

    return {
        "store_kv": store_kv, "rope_store_kv": rope_store_kv,
        "paged_attention": lambda: ops.paged_attention(q_decode, k_cache, v_cache, table, seq_lens),
        "paged_prefill_attention": lambda: ops.paged_prefill_attention(q_prefill, k_cache, v_cache, table, seq_lens,
                                                                       starts, 3),
    }


@gpu_only
def test_cached_and_plain_paths_give_identical_outputs(dtype):
    with torch.no_grad():
        for name, call in _public_calls(dtype).items():
            with _launcher.plain_launches():
                plain = call()
            call()  # compiles (if new) and caches the configuration
            cached = call()
            for got, want in zip(cached if isinstance(cached, tuple) else (cached,),
                                 plain if isinstance(plain, tuple) else (plain,)):
                assert torch.equal(got, want), name


@gpu_only
@pytest.mark.parametrize("first, then", [(17, 1), (1, 17), (96, 97), (97, 96)])
def test_no_wrong_hit_when_a_width_becomes_1_or_loses_its_16(first, then):
    """swiglu at one width, then another whose n_cols (and row stride) Triton specializes differently (1 is compiled
    in as a constant, a multiple of 16 is marked divisible), one BLOCK for both so that only the ints differ: the
    second must match the plain path, and a repeat (served from the cache) too."""
    config = {"BLOCK": 128, "num_warps": 4}
    forward = _swiglu_module.swiglu_forward
    forward(randn(2, first), randn(2, first), config=config)
    gate, up = randn(2, then), randn(2, then)
    with _launcher.plain_launches():
        plain = forward(gate, up, config=config)
    assert torch.equal(forward(gate, up, config=config), plain) and torch.equal(forward(gate, up, config=config), plain)


@gpu_only
@pytest.mark.parametrize("offset", [1, 3, 8])
def test_no_wrong_hit_when_a_pointer_loses_its_alignment(offset):
    """An aligned call is cached; then the same shape from a buffer offset by ``offset`` elements (float16: 2 bytes
    each, so 16-byte alignment is lost): a kernel compiled for aligned vector loads would fault or read wrong."""
    width = 4096
    buffer = randn(2 * width + 16, dtype=torch.float16)
    aligned, shifted = buffer[:2 * width].view(2, width), buffer[offset:offset + 2 * width].view(2, width)
    up = randn(2, width, dtype=torch.float16)
    ops.swiglu(aligned, up), ops.swiglu(aligned, up)
    with _launcher.plain_launches():
        plain = ops.swiglu(shifted, up)
    assert torch.equal(ops.swiglu(shifted, up), plain)


@gpu_only
def test_no_wrong_hit_when_the_dtype_changes():
    gate, up = randn(3, 256), randn(3, 256)
    ops.swiglu(gate, up), ops.swiglu(gate, up)
    half_gate, half_up = gate.half(), up.half()
    with _launcher.plain_launches():
        plain = ops.swiglu(half_gate, half_up)
    got = ops.swiglu(half_gate, half_up)
    assert got.dtype == torch.float16 and torch.equal(got, plain)


@gpu_only
def test_repeat_calls_skip_tritons_binder(monkeypatch):
    """After the first call of a configuration, JITFunction.run (the binder and its cache) is not called."""
    kernel = _swiglu_module._swiglu_kernel
    gate, up = randn(1, 4000), randn(1, 4000)
    ops.swiglu(gate, up)
    runs = []
    real_run = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a, **k: runs.append(1) or real_run(*a, **k))
    for _ in range(3):
        ops.swiglu(gate, up)
    assert runs == []


def _cached_swiglu_entry(gate, up):
    """The cache entry of swiglu's configuration for these inputs, filled by two calls."""
    ops.swiglu(gate, up), ops.swiglu(gate, up)
    kernel = _swiglu_module._swiglu_kernel
    entries = [e for key, e in _launcher._compiled.items() if e.kernel is kernel
               and key == _launcher.configuration_key(kernel, torch.cuda.current_device(), *_swiglu_launch(gate, up))]
    assert len(entries) == 1
    return entries[0]


def _swiglu_launch(gate, up):
    """swiglu_forward's launch arguments and meta for 2-D inputs (the output's alignment: a fresh allocation's)."""
    n = gate.shape[-1]
    return ((gate, up, torch.empty_like(gate), n, gate.stride(0), up.stride(0), n), _swiglu_module.config(n))


def _spy_on_launches(monkeypatch, entry, record):
    """Call ``record(launch arguments)`` on each cached launch of ``entry``: through Triton 3.6's C launch function
    where the entry calls it, else through the compiled kernel's launcher (the stream is the fourth argument of both)."""
    which = "c_launch" if entry.c_launch is not None else "run"
    real = getattr(entry, which)
    monkeypatch.setattr(entry, which, lambda *launch: record(launch) or real(*launch))


@gpu_only
def test_the_cached_launch_uses_the_current_stream(monkeypatch):
    """Inside torch.cuda.stream(s), the cached launch is given s, as Triton's own launch would be."""
    gate, up = randn(3, 1000), randn(3, 1000)
    entry, streams = _cached_swiglu_entry(gate, up), []
    _spy_on_launches(monkeypatch, entry, lambda launch: streams.append(launch[3]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.swiglu(gate, up)
    ops.swiglu(gate, up)
    assert streams == [side.cuda_stream, torch.cuda.current_stream().cuda_stream]


@gpu_only
def test_the_cached_launch_is_captured_and_replayed_by_a_cuda_graph(monkeypatch):
    """A configuration cached before a capture is launched from the cache inside it (the engine's decode graphs):
    the graph replays it on new inputs like the plain launch computes them."""
    gate, up = randn(3, 1000), randn(3, 1000)
    entry, launches = _cached_swiglu_entry(gate, up), []
    _spy_on_launches(monkeypatch, entry, lambda launch: launches.append(1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs advises
        ops.swiglu(gate, up)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.swiglu(gate, up)
    assert launches == [1, 1]  # the warm-up's and the capture's: both from the cache
    new_gate, new_up = randn(3, 1000), randn(3, 1000)
    gate.copy_(new_gate), up.copy_(new_up)
    out.fill_(float("nan"))
    graph.replay()
    with _launcher.plain_launches():
        want = ops.swiglu(new_gate, new_up)
    assert torch.equal(out, want)


def test_this_tritons_launch_is_the_one_the_cache_repeats():
    """JITFunction.run's launch call, read from this Triton's source (3.9 on CI; 3.6 on the GPU host, where
    test_the_cached_path_is_on_here checks the whole probe)."""
    assert _launcher._interface_problem() is None


# --- Triton 3.6's C launch function, called past its Python launcher ---------------------------------------------

COLAB_DRIVER = _ROOT / ".triton-colab" / "triton" / "backends" / "nvidia" / "driver.py"


@pytest.mark.skipif(not COLAB_DRIVER.exists(), reason="no .triton-colab/ (make setup installs Colab's Triton there)")
def test_colab_tritons_launcher_has_the_form_the_cached_launch_calls_directly():
    """What _c_launch_of relies on, read from Colab's Triton (3.6, the GPU host's too): CudaLauncher.__call__ hands
    everything to the C function ``self.launch`` in the order the cached launch uses, and that function's
    getPointer takes an int as the address itself (no data_ptr() call, no driver call)."""
    source = COLAB_DRIVER.read_text()
    call = source[source.index("class CudaLauncher"):]
    call = " ".join(call[call.index("def __call__"):call.index("class CudaDriver")].split())
    assert _launcher._C_LAUNCH_CALL in call
    pointer = " ".join(source[source.index("static inline DevicePtrInfo getPointer"):].split())
    assert pointer.index("if (PyLong_Check(obj)) {{ ptr_info.dev_ptr = PyLong_AsUnsignedLongLong(obj); "
                         "return ptr_info; }}") < pointer.index("PyObject_CallMethodNoArgs(obj, data_ptr_str)")


class _Form36Launcher:
    """A launcher with Triton 3.6's CudaLauncher.__call__ (its scratch allocation left out)."""

    def __init__(self, global_scratch_size=0, profile_scratch_size=0):
        self.global_scratch_size, self.profile_scratch_size = global_scratch_size, profile_scratch_size
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.launch = lambda *launch: None

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


@pytest.mark.parametrize("launcher, direct", [(_Form36Launcher(), True), (_Form36Launcher(global_scratch_size=8), False),
                                              (_Form36Launcher(profile_scratch_size=8), False),
                                              (lambda *launch: None, False)])
def test_the_c_function_is_called_directly_only_for_3_6s_form_without_scratch(launcher, direct):
    c_launch, cooperative, pdl = _launcher._c_launch_of(launcher)
    assert (c_launch is launcher.launch and (cooperative, pdl) == (False, True)) if direct else c_launch is None


def test_tensors_are_passed_as_addresses_only_on_the_gpu():
    """key_and_arguments gives the C launcher a CUDA tensor's address; a CPU tensor goes as itself, so that Triton's
    launcher raises for it ("cpu tensor?") instead of launching with a host address. Ints and floats as given."""
    cpu = torch.empty(8)
    tensors = [cpu, randn(8)]  # randn is on the course's device: the GPU there, the CPU in the interpreter
    key, arguments = _launcher.key_and_arguments(None, None, (*tensors, 7, 2.5), {})
    assert key == _launcher.configuration_key(None, None, (*tensors, 7, 2.5), {})
    assert [a if isinstance(a, int) else a is t for a, t in zip(arguments, tensors)] == [
        t.data_ptr() if t.is_cuda else True for t in tensors]
    assert arguments[2:] == [7, 2.5]


@gpu_only
def test_the_cached_launch_calls_the_c_function_where_triton_has_that_form():
    gate, up = randn(3, 1000), randn(3, 1000)
    entry = _cached_swiglu_entry(gate, up)
    assert (entry.c_launch is not None) == _launcher._has_c_launch_form(type(entry.run))


@gpu_only
def test_a_cpu_tensor_given_to_a_cached_configuration_raises_before_launching():
    gate, up = randn(3, 1000), randn(3, 1000)
    _cached_swiglu_entry(gate, up)
    (_, _, out, *sizes), meta = _swiglu_launch(gate, up)
    host_out = torch.empty(out.shape, dtype=out.dtype)  # on the CPU
    with pytest.raises((ValueError, RuntimeError), match="cpu tensor|CPU|cpu"):
        _launcher.launch(_swiglu_module._swiglu_kernel, (3,), (gate, up, host_out, *sizes), meta)
    torch.cuda.synchronize()  # the context is still healthy


# --- an op's plans: a repeated signature skips validation and the key (_plans.Plans) ------------------------

class _Form36Compiled(_Compiled):
    """A stand-in compiled kernel whose launcher has Triton 3.6's form: its C function records each launch."""

    def __init__(self, calls):
        super().__init__(calls)
        self.run = _Form36Launcher()
        self.run.launch = lambda *launch: calls.append(("c", launch))


_OPS = {"swiglu": (_swiglu_module, "_swiglu_kernel"), "add_rms_norm": (_add_rms_norm_module, "_add_rms_norm_kernel")}


@pytest.fixture(params=list(_OPS))
def planned_op(request, cached, monkeypatch):
    """One public op as on a GPU whose Triton has 3.6's launcher: its kernel a recording stand-in, its plans fresh,
    its validation counted. Returns (name, kernel, checks, call) where ``call(*inputs)`` runs the public op."""
    name = request.param
    module, kernel_name = _OPS[name]
    kernel = _Kernel(getattr(module, kernel_name).fn)
    kernel.compiled = _Form36Compiled(kernel.calls)
    monkeypatch.setattr(module, kernel_name, kernel)
    monkeypatch.setattr(module, "_PLANS", _plans.Plans(kernel))
    monkeypatch.setattr(_launcher, "_decided", [])
    monkeypatch.setattr(_common.runtime, "on_gpu", lambda: True)  # _common.launch goes to _launcher.launch
    checks, real_check = [], module._check
    monkeypatch.setattr(module, "_check", lambda *a: checks.append(1) or real_check(*a))
    call = ops.swiglu if name == "swiglu" else lambda x, r, w, eps=1e-6: ops.add_rms_norm(x, r, w, eps)
    return name, kernel, checks, call


def _planned_inputs(name, rows=3, width=96, dtype=torch.float32):
    """On the course's device (validation checks it; the stand-in kernel never reads them)."""
    if name == "swiglu":
        return randn(rows, width, dtype=dtype), randn(rows, width, dtype=dtype)
    return randn(rows, width, dtype=dtype), randn(rows, width, dtype=dtype), randn(width, dtype=dtype)


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def test_a_repeated_signature_skips_validation_and_launches_what_the_cache_would(planned_op):
    """The first call validates, launches plainly and keeps a plan; the second is not validated and goes to the C
    function with exactly the launch the cached path gives it (tensors as addresses, the fresh outputs' own)."""
    name, kernel, checks, call = planned_op
    inputs = _planned_inputs(name)
    call(*inputs)
    assert _kinds(kernel) == ["plain"] and len(checks) == 1
    planned = _outputs(call(*inputs))
    assert _kinds(kernel) == ["plain", "c"] and len(checks) == 1
    sys.modules[kernel.fn.__module__]._PLANS.clear()  # the same call through _launcher.launch's cached path
    cached = _outputs(call(*inputs))
    assert _kinds(kernel) == ["plain", "c", "c"] and len(checks) == 2
    (_, by_plan), (_, by_cache) = kernel.calls[1:]
    by_cache = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in by_cache)  # CPU tensors: as given
    n_in = len(inputs)
    assert by_plan[:13 + n_in] == by_cache[:13 + n_in]
    assert by_plan[13 + n_in + len(planned):] == by_cache[13 + n_in + len(cached):]
    assert by_plan[13 + n_in:13 + n_in + len(planned)] == tuple(t.data_ptr() for t in planned)
    assert by_cache[13 + n_in:13 + n_in + len(cached)] == tuple(t.data_ptr() for t in cached)


@pytest.mark.parametrize("change", ["dtype", "rows", "strides", "class", "misaligned", "device", "plain_launches",
                                    "launch hook", "three dimensions"])
def test_a_call_unlike_the_plans_takes_the_full_path(planned_op, monkeypatch, change):
    """Each change of what validation or the launch reads: the op validates again (and launches what the cached path
    decides: a misaligned pointer is another configuration, launched plainly)."""
    name, kernel, checks, call = planned_op
    inputs = _planned_inputs(name)
    call(*inputs), call(*inputs)
    assert len(checks) == 1
    if change == "dtype":
        inputs = _planned_inputs(name, dtype=torch.float16)
    elif change == "rows":
        inputs = _planned_inputs(name, rows=4)
    elif change == "strides":  # the same shape, rows 192 apart
        inputs = (randn(3, 192)[:, :96], *inputs[1:])
    elif change == "class":
        inputs = (torch.nn.Parameter(inputs[0], requires_grad=False), *inputs[1:])
    elif change == "misaligned":  # the same shape and strides, the address 8 bytes on: aligned to 8, not to 16
        inputs = (randn(3 * 96 + 2)[2:].view(3, 96), *inputs[1:])
    elif change == "device":
        _launcher._driver().device = 1  # the cached fixture's stand-in driver, this test's own
    elif change == "launch hook":
        monkeypatch.setattr(triton.knobs.runtime.launch_enter_hook, "calls", [lambda metadata: None])
    elif change == "three dimensions":  # reshaped to rows on the full path: no plan, whatever the shape
        inputs = (inputs[0].view(1, 3, 96), inputs[1].view(1, 3, 96), *inputs[2:])
        call(*inputs)
    if change == "plain_launches":
        with _launcher.plain_launches():
            call(*inputs)
    else:
        call(*inputs)
    assert len(checks) == (3 if change == "three dimensions" else 2)
    if change == "misaligned":
        assert _kinds(kernel)[-1] == "plain"


@pytest.mark.parametrize("bad", ["mixed dtypes", "last dimension strided", "not a tensor", "shapes differ"])
def test_bad_input_after_a_plan_still_raises(planned_op, bad):
    """A plan is found only for inputs shaped like validated ones: bad input still gets its clear error."""
    name, kernel, checks, call = planned_op
    inputs = _planned_inputs(name)
    call(*inputs), call(*inputs)
    if bad == "mixed dtypes":
        inputs = (inputs[0], inputs[1].half(), *inputs[2:])
    elif bad == "last dimension strided":
        inputs = (randn(96, 3).t(), *inputs[1:])
    elif bad == "not a tensor":
        inputs = (inputs[0].tolist(), *inputs[1:])
    else:
        inputs = (inputs[0], randn(3, 95), *inputs[2:])
    launches = len(kernel.calls)
    with pytest.raises((TypeError, ValueError)):
        call(*inputs)
    assert len(kernel.calls) == launches


@pytest.mark.parametrize("planned_op", ["add_rms_norm"], indirect=True)
def test_an_eps_that_is_not_a_float_is_never_planned(planned_op):
    """A tensor's value can change in place between calls: a plan keyed on the tensor would keep the old eps."""
    name, kernel, checks, call = planned_op
    inputs = _planned_inputs(name)
    eps = torch.tensor(1e-6)
    call(*inputs, eps), call(*inputs, eps)
    assert len(checks) == 2


@gpu_only
@pytest.mark.parametrize("op", ["swiglu", "add_rms_norm"])
def test_a_planned_call_equals_the_plain_launch(monkeypatch, op, dtype):
    """On the GPU: the third call of a signature takes the plan (no validation) and writes what the plain launch
    writes, on strided rows and odd widths too."""
    module = _swiglu_module if op == "swiglu" else _add_rms_norm_module
    if op == "swiglu":  # odd width, rows 608 apart (a plan needs every address aligned to 16 bytes)
        rows = randn(5, 608, dtype=dtype)
        inputs = rows[:, :301], rows[:, 304:605]
        call = ops.swiglu
    else:
        inputs = (randn(7, 2 * 123, dtype=dtype)[:, :123], randn(7, 123, dtype=dtype), randn(123, dtype=dtype))
        call = ops.add_rms_norm
    with torch.no_grad():
        with _launcher.plain_launches():
            plain = _outputs(call(*inputs))
        call(*inputs), call(*inputs)
        checks, real_check = [], module._check
        monkeypatch.setattr(module, "_check", lambda *a: checks.append(1) or real_check(*a))
        planned = _outputs(call(*inputs))
    assert checks == [] and all(torch.equal(got, want) for got, want in zip(planned, plain))
