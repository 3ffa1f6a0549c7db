"""What every launcher in lessonlib.ops shares: input validation before any launch, and the launch itself."""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from lessonlib import runtime
from lessonlib.ops import _launcher

try:  # grid dependency control (programmatic dependent launch): Triton 3.4 and newer
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: pdl() is False, and kernels never reach these names
    gdc_launch_dependents = gdc_wait = None


def check_tensors(op: str, **tensors: torch.Tensor) -> torch.Tensor:
    """Validate the tensors of one op call; return the first one (whose dtype and device the rest share).

    Raises TypeError for non-tensors and unsupported or mixed dtypes, ValueError for mixed devices, the wrong
    device for the current mode, and a last dimension that is not contiguous (the kernels read rows as one
    contiguous run of elements; the other dimensions may have any stride). The passing path is kept short: at
    decode sizes a launcher's Python time *is* the op's time (a contiguous tensor skips the stride test; the dtype
    and device are compared with the first tensor's, and only the first's dtype is looked up).
    """
    first = None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if first is None:
            first_name, first, dtype, device = name, t, t.dtype, t.device
            if not runtime.dtype_supported(dtype):
                _raise_for(op, first_name, first, name, t, runtime.supported_dtypes())
        elif t.dtype is not dtype or t.device != device:
            _raise_for(op, first_name, first, name, t, runtime.supported_dtypes())
        if not t.is_contiguous() and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
            _raise_for(op, first_name, first, name, t, runtime.supported_dtypes())
    if not (first.is_cuda if _kernels_on_cuda() else first.is_cpu):  # runtime.device()'s type, read cheaply
        where = "the GPU (mode 'gpu')" if runtime.on_gpu() else "the CPU (mode 'interpreter': no GPU)"
        raise ValueError(f"{op}: tensors are on {first.device}, but kernels run on {where}")
    return first


@lru_cache(maxsize=None)
def _kernels_on_cuda() -> bool:
    """Whether ``runtime.device()`` (decided once per process) is a CUDA device."""
    return runtime.device().type == "cuda"


def _raise_for(op, first_name, first, name, t, supported):
    if t.dtype not in supported:
        hint = f" ({runtime.why_not_bfloat16()})" if t.dtype == torch.bfloat16 else ""
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported here: {', '.join(map(str, supported))}{hint}")
    if t.dtype != first.dtype:
        raise TypeError(f"{op}: mixed dtypes: {first_name} is {first.dtype} but {name} is {t.dtype}")
    if t.device != first.device:
        raise ValueError(f"{op}: tensors on different devices: {first_name} on {first.device}, {name} on {t.device}")
    raise ValueError(f"{op}: {name} must be contiguous in its last dimension (stride {t.stride(-1)}); call .contiguous()")


def launch(kernel, grid, *args, **meta):
    """kernel[grid](*args, **meta), returning what Triton returns (on the GPU the compiled kernel: its n_regs and
    n_spills). On the GPU a configuration launched before goes straight to its compiled kernel's launcher
    (``_launcher.launch``: Triton's binder skipped; ``LESSONLIB_FAST_LAUNCH=0`` turns that off).
    In interpreter mode the launch is also named in torch.profiler traces, so launch counts work on CPU; on the GPU
    Triton's kernels show up in the profiler by themselves, at no extra cost."""
    if runtime.on_gpu():
        return _launcher.launch(kernel, grid, args, meta)
    if runtime.mode() == "compile":
        raise RuntimeError(f"{kernel.fn.__name__}: LESSONLIB_MODE=compile defines kernels for the compiler only; "
                           "nothing launches (tools/compile_targets.py compiles them)")
    with torch.profiler.record_function(f"triton::{kernel.fn.__name__}"):
        return kernel[grid](*args, **meta)


def tuned(op: str, default: dict, override: dict | None) -> dict:
    """A launcher's ``config`` knob: ``default`` (its heuristic) with a sweep's ``override`` of some of its keys.
    An unknown key or a BLOCK that is not a power of 2 fails before any launch."""
    if not override:
        return default
    unknown = set(override) - set(default)
    if unknown:
        raise ValueError(f"{op}: config keys {sorted(unknown)} unknown; it takes {sorted(default)}")
    meta = {**default, **override}
    if "BLOCK" in meta and meta["BLOCK"] != next_power_of_2(meta["BLOCK"]):
        raise ValueError(f"{op}: config BLOCK must be a power of 2, got {meta['BLOCK']}")
    return meta


def num_warps_for(block: int) -> int:
    """Warps for a program handling `block` elements of a row: enough threads that each keeps a few 16-byte
    vectors in flight. benchmarks/bench_fusion.py sweeps the alternatives on the GPU."""
    return max(1, min(16, block // 256))


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for 0 <= n <= 2**64, as plain Python: Triton's is a ``constexpr_function``, whose
    call costs about 2 us of host time (Triton 3.6 and 3.9), a tenth of a decode-size op."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` as plain Python (Triton's is a ``constexpr_function``: see :func:`next_power_of_2`)."""
    return -(-a // b)


def first_that_fits(op: str, candidates, shared_memory, profile) -> dict:
    """The first of ``candidates`` (best first) whose shared memory, as estimated by ``shared_memory(candidate)``,
    fits ``profile``'s opt-in limit per block. Each op's estimate is checked against the compiled kernels, for every
    architecture the course supports, by tests/ops/test_compile_targets.py (compiled <= estimate)."""
    for candidate in candidates:
        if shared_memory(candidate) <= profile.shared_memory_per_block:
            return candidate
    raise ValueError(f"{op}: no configuration fits the {profile.shared_memory_per_block // 1024} KB of shared memory "
                       f"per block of the {profile.name} (smallest needs {shared_memory(candidates[-1]) // 1024} KB)")


def refuse_gradient(op: str, why: str, **tensors: torch.Tensor) -> None:
    """Raise for an op without a backward when autograd would record it: a tensor it returns would carry no
    gradient, and training would go on with that part of the model silently frozen. Under ``torch.no_grad()`` or
    ``torch.inference_mode()`` (where serving code runs) nothing is recorded and the call goes through."""
    if torch.is_grad_enabled():
        for name, t in tensors.items():
            if getattr(t, "requires_grad", False):
                raise RuntimeError(f"{op}: no gradient flows to {name} ({why}), but {name} requires grad; call it "
                                   f"under torch.no_grad() or torch.inference_mode(), or pass {name}.detach()")


@lru_cache(maxsize=None)
def pdl() -> bool:
    """Whether kernels use programmatic dependent launch (PDL): on Hopper (sm_90) and newer, with a Triton that has
    grid dependency control, unless ``LESSONLIB_PDL=0``. A kernel launched with ``launch_pdl=True`` may start
    once every program of the kernel before it has called ``gdc_launch_dependents()`` (or ended). ``gdc_wait()``
    returns when that kernel has ended and its writes are visible, and it ended only after its own wait: so after
    the wait every earlier kernel has ended. The rule for such a kernel: before ``gdc_wait()`` read nothing an earlier
    kernel may write, and write nothing an earlier kernel may read. ops.gemv loads only its weights and bias before
    its wait (nothing in a decode step writes them), ops.decode_gemv only its weights; every other kernel waits first
    (:func:`pdl_wait_then_trigger`). Elsewhere (the interpreter, a T4, an emulated T4) the kernels take the plain
    path: their ``PDL`` constexpr is False and the calls are compiled out."""
    if os.environ.get("LESSONLIB_PDL", "1").strip() == "0" or runtime.mode() != "gpu":
        return False
    return pdl_supported(runtime.gpu_profile())


def pdl_supported(profile: runtime.GPUProfile | None) -> bool:
    """Whether kernels built for this GPU can use programmatic dependent launch: Hopper (sm_90) or newer, and a
    Triton with grid dependency control. :func:`pdl` adds whether this process launches kernels on it at all."""
    return gdc_wait is not None and profile is not None and profile.capability >= (9, 0)


def pdl_options() -> dict:
    """What a launcher adds to a launch of a kernel that calls :func:`pdl_wait_then_trigger` first: ``PDL=True`` and
    ``launch_pdl=True`` where :func:`pdl` holds, nothing elsewhere (the kernel's ``PDL`` constexpr defaults to
    False)."""
    return {"PDL": True, "launch_pdl": True} if pdl() else {}


@triton.jit
def pdl_wait_then_trigger(PDL: tl.constexpr):
    """First thing in a kernel launched with ``pdl_options()``: wait until the previous kernel has ended and its
    writes are visible (``gdc_wait``), then let the next kernel start its launch (``gdc_launch_dependents``). The
    kernel itself reads and writes nothing before this, so it behaves as a plain launch would; only its launch
    overlaps the previous kernel's end."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
