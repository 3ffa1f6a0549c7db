"""A cached launch: a Triton kernel launched for the host time of its compiled kernel's own launch.

``kernel[grid](*args, **meta)`` does, on every call (Triton 3.6 and 3.9, ``JITFunction.run``): look up the device
and stream, run the binder (bind the arguments, apply defaults, specialize each one), build and look up a cache key
from the specialization and the options, check the globals the kernel read, build the launch metadata for the
launch hooks, and only then call the compiled kernel's launcher (``CompiledKernel.run``, a C function). At decode
sizes that Python is the op's time (issue 27: 9-11 us against about 4 us for the launch itself).

:func:`launch` keeps, per configuration, the ``CompiledKernel`` that the first plain ``kernel[grid]`` call returned,
and calls its launcher directly on every later call with the same configuration, exactly as ``JITFunction.run``
does: ``run(grid_0, grid_1, grid_2, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
*arguments)``, every parameter in signature order (the launcher drops the constexpr ones). A configuration is
what Triton would compile a different kernel for:

* the kernel, the current device, and ``meta`` (constexpr values and options such as ``num_warps``) as Python
  compares them: ``SHIFT=1``, ``1.0`` and ``True`` are one key, as they are in Triton's own in-memory key cache
  (``compute_cache_key``: a dict keyed by the specialization tuple, 3.6 and 3.9), so both paths launch the kernel
  compiled for the first of them (tests/ops/test_launcher.py checks against Triton's binder);
* per tensor argument its dtype and whether its address is a multiple of 16 bytes;
* per int argument whether it is 1 (Triton makes it a constant), a multiple of 16, and whether it fits in 32 or
  64 bits or only in uint64 (the parameter's type; past 64 bits the call is plain: Triton raises); a float is a
  float32 parameter whatever its value.

What the launcher does besides the arguments is fixed per compiled kernel, in Triton 3.6 and 3.9 alike:
``launch_pdl``, ``launch_cooperative_grid`` and ``num_ctas`` (the cluster size) are compile options, so they are in
``meta`` and in the key; the launcher (``CudaLauncher``) reads them from the compiled kernel's metadata, as
``packed_metadata`` holds ``num_warps``, ``num_ctas`` and the shared memory; it allocates any global scratch itself on
every call. The stream and device are looked up on every call as ``JITFunction.run`` does (the driver's
``get_current_stream``: torch's current stream, so a ``torch.cuda.stream`` context or a CUDA graph capture's stream).

A wrong hit would launch a kernel specialized for other inputs (vector loads on a misaligned pointer, an ``n_cols``
compiled in as 1), so the key refines Triton's own rule: :func:`works_here` checks, with this Triton's
``native_specialize_impl`` and the binder's backend, that inputs of one key are specialized alike, before the
first cached launch.

On by default on a GPU (``LESSONLIB_FAST_LAUNCH=0`` turns it off): on the H200, tests/ops/test_launcher.py checked
it bit for bit against the plain launch for every public op, and the whole suite ran with it (benchmarks/decisions/cached-launch.md).

With Triton 3.6 (Colab's and the H200 host's), the compiled kernel's launcher is a Python ``CudaLauncher`` whose
``__call__`` only allocates scratch memory (none for the course's kernels) and calls ``self.launch``, a C function
compiled for the kernel's signature. The cached launch calls that C function itself and passes each CUDA tensor as
its address: for a tensor the C function calls ``data_ptr()`` and the driver's ``cuPointerGetAttribute``, for an int
it takes the address as it is (:func:`_c_launch_of`; Triton 3.9's generic launcher has another form and keeps
``CompiledKernel.run``). A CPU tensor is still passed as the tensor, so Triton's own error is raised for it.

Every launch of a process takes the plain path when: it runs in the interpreter, the environment sets
``LESSONLIB_FAST_LAUNCH=0``, or :func:`why_not` found at the first launch (outside a CUDA graph capture) that this
Triton's launch does not have the form above, that its specialization is not the one the key assumes, that a launch
hook was set, or that the probe kernel launched through :func:`launch` from the cache wrote other values than its
plain launch. One call takes it when: a launch hook is set (a profiler such as proton reads the launch metadata),
the kernel has pre-run hooks, a global it read has changed (Triton raises), it is not a JITFunction (an autotuner),
the grid is not a tuple, an argument is not a tensor, an int (not a bool) or a float (not a numpy float), or a
constexpr is passed positionally. Not watched: Triton settings that change the compile options mid-process
(``knobs.runtime.debug``, ``knobs.compilation.instrumentation_mode``; in 3.9 also ``fpsan_homomorphic_casts`` and
``add_stages_inspection_hook``), and a driver swapped by ``triton.runtime.driver.set_active`` after the first launch;
set them before the first launch, or set ``LESSONLIB_FAST_LAUNCH=0``. ``plain_launches()`` forces the plain
path for a block (tests, benchmarks).

Where a decode-size call's host time goes on the H200's host, part by part (the key, the device and stream lookups,
``CompiledKernel.run`` given tensors, the C function given addresses, the op's validation and allocation, and
eager PyTorch's single ops beside them): benchmarks/experiments/per_call_parts.py and its results file.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from lessonlib import runtime

ENV = "LESSONLIB_FAST_LAUNCH"
_INT32, _INT64, _UINT64_MAX = (-(2**31), 2**31 - 1), (-(2**63), 2**63 - 1), 2**64 - 1
_compiled: dict = {}  # configuration key -> _Entry (at most _MAX_ENTRIES: past that, new configurations stay plain)
_MAX_ENTRIES = 4096
_forced_plain = [False]  # plain_launches() sets it
_runtime_knobs = triton.knobs.runtime  # where launch hooks are set (Triton 3.6 and 3.9)


class _Entry:
    """One configuration's compiled kernel and what its launcher needs besides the call's own arguments."""

    __slots__ = ("kernel", "compiled", "run", "function", "packed_metadata", "tail", "globals_read", "c_launch",
                 "cooperative", "pdl")

    def __init__(self, kernel, compiled, tail, globals_read):
        # the kernel is kept so that its id, in the key, is never reused by another object
        self.kernel, self.compiled, self.tail, self.globals_read = kernel, compiled, tail, globals_read
        self.run, self.function, self.packed_metadata = compiled.run, compiled.function, compiled.packed_metadata
        self.c_launch, self.cooperative, self.pdl = _c_launch_of(compiled.run)


_C_LAUNCH_CALL = ("self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
                  "global_scratch, profile_scratch, *args)")


@lru_cache(maxsize=None)
def _has_c_launch_form(launcher_class) -> bool:
    """Whether a launcher class is Triton 3.6's ``CudaLauncher``: its ``__call__`` allocates scratch memory where the
    kernel needs it and passes everything on to ``self.launch``, a C function compiled for the kernel's signature,
    whose pointer arguments may be tensors or their addresses as ints (``getPointer``: an int is taken as the
    address; a tensor costs a ``data_ptr()`` call and a ``cuPointerGetAttribute`` driver call). Triton 3.9's
    launcher is a generic one with another form: it keeps ``CompiledKernel.run``."""
    try:
        return _C_LAUNCH_CALL in " ".join(inspect.getsource(launcher_class.__call__).split())
    except (TypeError, OSError):  # a launcher without Python source (a stand-in, a C type)
        return False


def _c_launch_of(launcher):
    """``(launcher.launch, cooperative, pdl)`` where the cached launch may call the C function under the compiled
    kernel's Python launcher (3.6's form, and no scratch memory to allocate), else ``(None, None, None)``."""
    if (_has_c_launch_form(type(launcher)) and not getattr(launcher, "global_scratch_size", 1)
            and not getattr(launcher, "profile_scratch_size", 1)):
        return launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl
    return None, None, None


def configuration_key(kernel, device, args, meta):
    """The key of one launch (see the module docstring), or None when an argument is of a kind the key does not
    cover (the call then takes the plain path). The kernel enters by its id: a JITFunction's own hash takes a lock
    and its source hash on every call."""
    return key_and_arguments(kernel, device, args, meta)[0]


def key_and_arguments(kernel, device, args, meta):
    """:func:`configuration_key`, and the arguments as a C launcher of Triton 3.6's form takes them most cheaply:
    each CUDA tensor as its address (read anyway for the key's alignment bit), everything else as given; ``(None,
    None)`` when the key does not cover an argument. Written for speed: it runs on every launch (its time on the
    H200's host is a row of benchmarks/experiments/results/per-call-parts-h200.json)."""
    key, arguments = [id(kernel), device, *meta.items()], []
    append, give, int_class = key.append, arguments.append, _int_classes.get
    for a in args:
        if a.__class__ is int:
            c = int_class(a)
            if c is None:
                c = _int_class(a)
                if c is None:  # past 64 bits: Triton raises (OverflowError); a cached kernel would wrap it
                    return None, None
            append(c)
            give(a)
        elif isinstance(a, torch.Tensor):
            address = a.data_ptr()
            append(a.dtype)
            append(address & 15 == 0)
            give(address if a.is_cuda else a)  # a CPU tensor: Triton's own error ("cpu tensor?"), not a bad address
        elif a.__class__ is float:
            append(float)
            give(a)
        else:
            return None, None
    return tuple(key), arguments


_int_classes: dict[int, int] = {}  # int -> its class below, for the ints met first (sizes, strides)


def _int_class(a: int) -> int | None:
    """1 for 1 (Triton compiles it in as a constant); otherwise bits: a multiple of 16, fits in int32, in int64 (else
    uint64). None outside [-2**63, 2**64): Triton refuses to specialize it, and 3.6's launcher would pass a uint64
    parameter on without an overflow check (``PyArg_ParseTuple``'s "K")."""
    if not _INT64[0] <= a <= _UINT64_MAX:
        return None
    c = 1 if a == 1 else 8 | (a & 15 == 0) | (_INT32[0] <= a <= _INT32[1]) << 1 | (_INT64[0] <= a <= _INT64[1]) << 2
    if len(_int_classes) < 4096:
        _int_classes[a] = c
    return c


def launch(kernel, grid, args, meta):
    """``kernel[grid](*args, **meta)`` on the GPU, through the cached compiled kernel where :func:`works_here`;
    returns Triton's compiled kernel either way."""
    if _forced_plain[0] or not (_decided[0] is None if _decided else works_here()):
        return kernel[grid](*args, **meta)
    driver = _driver()
    device = driver.get_current_device()
    try:
        key, arguments = key_and_arguments(kernel, device, args, meta)
        entry = _compiled.get(key) if key is not None else None
    except TypeError:  # an unhashable meta value: Triton decides what it means
        key = entry = None
    if (entry is None or not _hooks_idle(kernel) or grid.__class__ is not tuple
            or (entry.globals_read and _globals_changed(entry))):
        compiled = kernel[grid](*args, **meta)
        if key is not None and entry is None and compiled is not None:
            _remember(key, kernel, compiled, args, meta)
        return compiled
    n = len(grid)
    if entry.c_launch is not None:  # Triton 3.6: its C launch function, addresses for tensors (_c_launch_of)
        entry.c_launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, driver.get_current_stream(device),
                       entry.function, entry.cooperative, entry.pdl, None, None, entry.packed_metadata, None, None,
                       None, *arguments, *entry.tail)
    else:
        entry.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, driver.get_current_stream(device),
                  entry.function, entry.packed_metadata, None, None, None, *args, *entry.tail)
    return entry.compiled


def _remember(key, kernel, compiled, args, meta) -> None:
    """Keep a configuration's compiled kernel when every parameter after the positional ones is a constexpr given
    in ``meta`` or by its default, and no positional one is a constexpr or specialized otherwise than by default
    (annotations, do_not_specialize): then ``args`` plus the constexpr values are the launcher's arguments."""
    if not isinstance(kernel, triton.runtime.jit.JITFunction):  # an autotuner, heuristics: Triton decides each call
        return
    params = kernel.params
    given, rest = params[:len(args)], params[len(args):]
    if any(p.is_constexpr or p.do_not_specialize or p.do_not_specialize_on_alignment or p.annotation for p in given):
        return
    if any(not p.is_constexpr or (p.name not in meta and not p.has_default) for p in rest):
        return
    tail = tuple(meta[p.name] if p.name in meta else p.default for p in rest)
    globals_read = tuple((name, value, where) for (name, _), (value, where) in kernel.used_global_vals.items())
    if len(_compiled) < _MAX_ENTRIES:  # a meta value unequal to itself (a NaN) would add an entry per call
        _compiled[key] = _Entry(kernel, compiled, tail, globals_read)


def _hooks_idle(kernel) -> bool:
    """No launch hook and no pre-run hook: nothing would read what the plain path builds for them."""
    enter, leave = _runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook
    return (not kernel.pre_run_hooks and (enter is None or not getattr(enter, "calls", True))
            and (leave is None or not getattr(leave, "calls", True)))


def _globals_changed(entry) -> bool:
    # The plain path raises when a global the kernel read at compile time has changed since: let it.
    missing = object()
    return any(where.get(name, missing) != value for name, value, where in entry.globals_read)


@lru_cache(maxsize=None)
def _driver():
    return triton.runtime.driver.active


@contextlib.contextmanager
def plain_launches():
    """Within: every launch takes the plain ``kernel[grid]`` path (tests and benchmarks compare both paths)."""
    before, _forced_plain[0] = _forced_plain[0], True
    try:
        yield
    finally:
        _forced_plain[0] = before


def works_here() -> bool:
    """Whether launches take the cached path in this process (decided once, at the first launch outside a CUDA
    graph capture: the probe launches and syncs, which a capture forbids; until then launches are plain)."""
    if _decided:
        return _decided[0] is None
    return why_not() is None


def _real_gpu() -> bool:
    """On a GPU, and a real one: tests pretend one in the interpreter (``runtime.on_gpu`` patched), where a CPU build
    of torch cannot answer ``torch.cuda``'s questions (``is_available`` it can)."""
    return runtime.on_gpu() and torch.cuda.is_available()


def _switched_on() -> bool:
    """The environment's switch: on unless ``LESSONLIB_FAST_LAUNCH=0``."""
    return os.environ.get(ENV, "1").strip() != "0"


_decided: list = []  # [None] or [the reason the plain path is taken], once decided


def why_not() -> str | None:
    """None when the cached path is used here; otherwise the reason every launch takes the plain path. Asked
    during a CUDA graph capture before the decision, it answers so and decides nothing (the probe must not run)."""
    if not _decided:
        if _switched_on() and _real_gpu() and torch.cuda.is_current_stream_capturing():
            return "not decided yet: asked during a CUDA graph capture, where the probe cannot launch and sync"
        _decided.append(_decide())
    return _decided[0]


def _decide() -> str | None:
    if not _switched_on():
        return f"{ENV}=0 in the environment: every launch takes Triton's plain kernel[grid] path"
    if not _real_gpu():
        return "not on a GPU (Triton's interpreter launches kernels its own way)"
    try:
        backend = triton.compiler.make_backend(_driver().get_current_target())
        return _interface_problem() or specialization_problem(backend, runtime.device()) or _probe_problem()
    except Exception as error:  # any surprise in another Triton: the plain path, and the reason kept
        return f"the probe failed: {type(error).__name__}: {error}"


def _interface_problem() -> str | None:
    """The launch this module repeats is the one Triton's own ``JITFunction.run`` makes (3.6 to 3.9 at least)."""
    source = " ".join(inspect.getsource(triton.runtime.jit.JITFunction.run).split())
    expected = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, "
                "launch_metadata, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, "
                "*bound_args.values())")
    if expected not in source:
        return f"triton {triton.__version__}: JITFunction.run launches differently from what this module repeats"
    return None


def specialization_samples(device) -> list:
    """Arguments around every boundary of Triton's specialization: ints at 1, multiples of 16 and the 32- and
    64-bit limits; tensors of two dtypes at every address offset mod 16; floats."""
    ints = [v + d for v in (0, 16, 2**31, -(2**31), 2**32, 2**63, -(2**63), 2**64 - 16, 2**64, -(2**64))
            for d in (-17, -16, -1, 0, 1, 15, 16)]
    base = torch.empty(64, dtype=torch.float32, device=device)
    tensors = [base.view(dtype)[offset:] for dtype in (torch.float16, torch.float32) for offset in range(9)]
    return ints + tensors + [0.0, 1.0, -2.5, 1e-6, 3e38, 1e300, float("inf"), True, False, None]


def specialization_problem(backend, device) -> str | None:
    """None when inputs with one key are specialized alike by this Triton (``native_specialize_impl``, the
    function its binder calls, with ``backend``, the binder's), over :func:`specialization_samples` on ``device``,
    and every input this Triton refuses to specialize has no key; otherwise the inputs one key would wrongly serve."""
    from triton._C.libtriton import native_specialize_impl

    seen = {}
    for a in specialization_samples(device):
        key = configuration_key(None, None, (a,), {})
        if key is None:  # the plain path: Triton specializes it, or raises, on every call
            continue
        try:
            spec = native_specialize_impl(backend, a, False, True, True)
        except (OverflowError, TypeError) as error:
            return f"triton {triton.__version__} refuses {a!r} ({error}), but one key would launch it"
        if seen.setdefault(key, (spec, a))[0] != spec:
            return (f"triton {triton.__version__} specializes {seen[key][1]!r} and {a!r} differently; "
                    "one key covers both")
    return None


@triton.jit
def _probe_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 1):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * scale + SHIFT + offsets, mask=mask)


def _probe_problem() -> str | None:
    """The probe kernel launched plainly, then twice through :func:`launch` itself, as an op launches (the first call
    remembers the configuration, the second launches from the cache; a constexpr given in meta, one by its default,
    an option): the two outputs must be bit for bit the same."""
    if not _hooks_idle(_probe_kernel):
        return "a launch hook was set at the first launch: the probe could not take the cached path"
    x = torch.randn(1000, device=runtime.device())
    plain, cached = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    grid, meta = (triton.cdiv(x.numel(), 256),), {"BLOCK": 256, "num_warps": 4}
    _probe_kernel[grid](x, plain, x.numel(), 0.5, **meta)
    args = (x, cached, x.numel(), 0.5)
    forced_plain, _forced_plain[0] = _forced_plain[0], False
    _decided.append(None)  # for the probe's own launches only: why_not() appends the real decision after it
    try:
        launch(_probe_kernel, grid, args, meta)
        if configuration_key(_probe_kernel, _driver().get_current_device(), args, meta) not in _compiled:
            return "the probe's configuration was not cached"
        cached.fill_(float("nan"))
        launch(_probe_kernel, grid, args, meta)
    finally:
        _decided.clear()
        _forced_plain[0] = forced_plain
    if not torch.equal(plain, cached):
        return f"triton {triton.__version__}: the probe's cached launch wrote other values than its plain launch"
    return None
