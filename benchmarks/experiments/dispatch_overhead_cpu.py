"""Host time of one call at T=1 with the GPU launch itself stubbed out: what the public op adds over its launcher,
what the custom-op dispatcher would add, and what Triton's plain ``kernel[grid]`` path costs against the cached
launch (ops/_launcher.py). Runs on CPU (no GPU needed): the Python path is the same.

    LESSONLIB_MODE=interpreter python -m benchmarks.experiments.dispatch_overhead_cpu

For the launch rows, Triton's real ``JITFunction.run`` runs (binder, cache key, global check, launch metadata)
against a stand-in driver (device 0, stream 0, an sm_90 target) and a stand-in compiled kernel whose C launcher
does nothing: everything but the driver call is Triton's own code, with this machine's Triton (3.9 here; the GPU
host runs 3.6, whose JITFunction.run has the same steps).

Microseconds per call, best of interleaved rounds (a shared, loaded machine adds noise, never removes time):
  launcher            swiglu_forward / add_rms_norm_forward: validation, allocation, (stubbed) launch. Before
                      issue 12 this was the whole of lessonlib.ops.swiglu / add_rms_norm.
  public op           lessonlib.ops.swiglu / add_rms_norm: the fast path taken when no input requires grad
  wrapper's test      the public op's own work: torch.compiler.is_compiling() and torch.is_grad_enabled()
  custom op           torch.ops.lessonlib.swiglu / add_rms_norm: the dispatcher path (autograd, torch.compile)
  plain launch        Triton's kernel[grid](...) up to the C launcher (the stand-ins above)
  cached launch       ops._launcher.launch of a configuration seen before, up to the same C launcher
  public op, cached   the public op with the cached launch: what a decode step pays before the driver call
"""

import sys
import timeit


import torch

from lessonlib import ops, runtime
from lessonlib.ops import _launcher

import triton  #  (after lessonlib.ops: the runtime mode is decided first)
from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel


class StandInDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class StandInCompiled:
    """A compiled kernel whose launcher does nothing; launch_metadata is Triton's own (minus loading a module)."""
    name, function, src, packed_metadata = "stand-in", None, None, (4, 1, 0)
    launch_metadata = CompiledKernel.launch_metadata

    def _init_handles(self):
        pass

    def run(self, *launch):
        pass


def stand_in_kernel(kernel, grid, args, meta):
    """A JITFunction of ``kernel``'s Python function whose Triton cache already holds a stand-in for this call."""
    jit = triton.runtime.jit.JITFunction(kernel.fn)
    kernel_cache, key_cache, _, _, binder = jit.device_caches[0]
    meta = {**meta, "debug": jit.debug or triton.knobs.runtime.debug,  # what JITFunction.run adds, in its order
            "instrumentation_mode": triton.knobs.compilation.instrumentation_mode}
    if hasattr(triton.knobs.compilation, "fpsan_homomorphic_casts"):  # Triton 3.9's JITFunction.run adds it
        meta["fpsan_homomorphic_casts"] = triton.knobs.compilation.fpsan_homomorphic_casts
    _, specialization, options = binder(*args, **meta)
    kernel_cache[triton.runtime.jit.compute_cache_key(key_cache, specialization, options)] = StandInCompiled()
    return jit


triton.runtime.driver.set_active(StandInDriver())
_launcher.works_here = lambda: True
stand_ins = {}


def cached_launch(kernel, grid, *args, **meta):
    jit = stand_ins.get(kernel) or stand_ins.setdefault(kernel, stand_in_kernel(kernel, grid, args, meta))
    return _launcher.launch(jit, grid, args, meta)


def plain_launch(kernel, grid, *args, **meta):
    with _launcher.plain_launches():
        return cached_launch(kernel, grid, *args, **meta)


sw, rn = sys.modules["lessonlib.ops.swiglu"], sys.modules["lessonlib.ops.add_rms_norm"]  # the modules, not the ops
device, dtype = runtime.device(), torch.float16
gate, up = torch.randn(1, 14336, dtype=dtype, device=device), torch.randn(1, 14336, dtype=dtype, device=device)
x, res, w = (torch.randn(1, 4096, dtype=dtype, device=device), torch.randn(1, 4096, dtype=dtype, device=device),
             torch.randn(4096, dtype=dtype, device=device))
out, res_out = torch.empty_like(x), torch.empty_like(x)
swiglu_launch = (sw._swiglu_kernel, (7,), gate, up, torch.empty_like(gate), 14336, 14336, 14336, 14336)
rms_launch = (rn._add_rms_norm_kernel, (1,), x, res, w, out, res_out, 4096, 4096, 4096, 1e-6)
rms_meta = dict(BLOCK=4096, ONE_PASS=True, num_warps=2)


def stubbed(fn):
    def call():
        sw.launch = rn.launch = lambda *args, **kwargs: None
        return fn()
    return call


def cached(fn):
    def call():
        sw.launch = rn.launch = cached_launch
        return fn()
    return call


calls = {
    "swiglu launcher": stubbed(lambda: sw.swiglu_forward(gate, up)),
    "swiglu public op": stubbed(lambda: ops.swiglu(gate, up)),
    "swiglu wrapper's test": lambda: torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
        getattr(gate, "requires_grad", False) or getattr(up, "requires_grad", False))),
    "swiglu custom op": stubbed(lambda: torch.ops.lessonlib.swiglu(gate, up)),
    "swiglu plain launch": lambda: plain_launch(*swiglu_launch, BLOCK=2048, num_warps=8),
    "swiglu cached launch": lambda: cached_launch(*swiglu_launch, BLOCK=2048, num_warps=8),
    "swiglu public op, cached": cached(lambda: ops.swiglu(gate, up)),
    "add_rms_norm launcher": stubbed(lambda: rn.add_rms_norm_forward(x, res, w)),
    "add_rms_norm public op": stubbed(lambda: ops.add_rms_norm(x, res, w)),
    "add_rms_norm custom op": stubbed(lambda: torch.ops.lessonlib.add_rms_norm(x, res, w, 1e-6)),
    "add_rms_norm plain launch": lambda: plain_launch(*rms_launch, **rms_meta),
    "add_rms_norm cached launch": lambda: cached_launch(*rms_launch, **rms_meta),
    "add_rms_norm public op, cached": cached(lambda: ops.add_rms_norm(x, res, w)),
}
for fn in calls.values():
    fn(), fn()  # the first call of each configuration takes the plain path and fills the cache
best = {name: float("inf") for name in calls}
for _ in range(15):
    for name, fn in calls.items():
        best[name] = min(best[name], timeit.timeit(fn, number=200) / 200 * 1e6)
for name, us in best.items():
    print(f"{name:32s} {us:8.2f} us")
