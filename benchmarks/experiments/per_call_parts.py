"""Where one decode-size call's host time goes on the GPU's host: each part of ``ops.swiglu`` and
``ops.add_rms_norm`` timed alone, beside eager PyTorch's single ops (issue 27's per-call row).

    python -m benchmarks.experiments.per_call_parts --out benchmarks/experiments/results/per-call-parts-h200.json

bench_per_call.py times whole calls; this splits them. Each row: ``CALLS`` back-to-back calls of one callable
between two syncs, ``time.perf_counter``, median of ``ROUNDS`` rounds (rows interleaved, forward then reversed
order), microseconds per call. The parts, at swiglu's T=1, I=14336 and add_rms_norm's T=1, H=4096, bf16:

  python call                 a Python function that returns: the host's speed, for scale
  torch.empty_like            the op's output allocation (the caching allocator's hit)
  tensor.data_ptr()           one attribute call
  check_tensors               the op's validation
  configuration_key           the cached launch's key (ops/_launcher.py)
  device + stream lookup      Triton's driver calls the launch makes every time
  launcher, tensors           the compiled kernel's launcher (CompiledKernel.run) as the cached launch calls it
  launcher, pointers as ints  the same with each tensor passed as its data_ptr(): Triton 3.6's C launcher then
                              skips the data_ptr method call and cuPointerGetAttribute per tensor
  C launch, ints              3.6's C function itself (CudaLauncher.launch), past the Python __call__
  _launcher.launch            the whole cached launch from the op's arguments
  signature                   the op's signature of its inputs (``_signature``: what a plan is found by)
  plan launch                 ``_plans.Plans.launch``: a plan's launch given the tensors' addresses
  the op                      ops.swiglu / ops.add_rms_norm on their default path (a repeated signature: its plan)
  eager single op             torch.mul / torch.add: one allocation and one kernel through PyTorch's dispatcher
  eager                       bench_per_call.py's peer (F.silu(g) * u; x + r then F.rms_norm)

Before the first row, 3 s of back-to-back calls bring the host's clocks up (without them, the first case's
rows ran about 1.5x slower in two of three runs). The experiment checks nothing of its own: each callable's output is the op's, checked against float64 by
bench_per_call.py. The C-launch rows exist only where Triton's launcher has 3.6's form (else they are skipped and
say why).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


import torch
import torch.nn.functional as F

from lessonlib import ops, runtime
from lessonlib.measure import warm_up_gpu
from lessonlib.ops import _launcher
from lessonlib.ops._common import check_tensors, pdl_options
from lessonlib.ops.add_rms_norm import _add_rms_norm_kernel, config as add_rms_norm_config
from lessonlib.ops.swiglu import _swiglu_kernel, config as swiglu_config
from lessonlib.results import environment

import triton  #  (after lessonlib: the runtime mode is decided first)

CALLS, ROUNDS = 2000, 5


def per_call_us(rows: dict, calls: int, rounds: int) -> dict[str, dict]:
    samples = {name: [] for name in rows}
    for fn in rows.values():
        fn(), fn()
    for _ in range(rounds):
        for order in (list(rows), list(reversed(rows))):
            for name in order:
                fn = rows[name]
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
                samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: {"us": round(statistics.median(s), 3), "min_us": round(min(s), 3), "max_us": round(max(s), 3)}
            for name, s in samples.items()}


def parts(kernel, grid, args, meta, op_call, eager_rows, tensors, module, inputs):
    """The rows for one op: ``args`` are the kernel's arguments in signature order, ``meta`` its constexprs;
    ``module`` the op's module, ``inputs`` the op's own arguments (for its signature and plan)."""
    driver = _launcher._driver()
    device = driver.get_current_device()
    _launcher.launch(kernel, grid, args, meta), _launcher.launch(kernel, grid, args, meta)
    key = _launcher.configuration_key(kernel, device, args, meta)
    entry = _launcher._compiled[key]
    ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    stream = driver.get_current_stream(device)
    g = (grid[0], 1, 1)
    first = tensors[0]

    def noop():
        return None

    rows = {
        "python call": noop,
        "torch.empty_like": lambda: torch.empty_like(first, memory_format=torch.contiguous_format),
        "tensor.data_ptr()": first.data_ptr,
        "check_tensors": lambda: check_tensors("op", **{f"t{i}": t for i, t in enumerate(tensors)}),
        "configuration_key": lambda: _launcher.configuration_key(kernel, device, args, meta),
        "device + stream lookup": lambda: driver.get_current_stream(driver.get_current_device()),
        "launcher, tensors": lambda: entry.run(*g, stream, entry.function, entry.packed_metadata, None, None, None,
                                               *args, *entry.tail),
        "launcher, pointers as ints": lambda: entry.run(*g, stream, entry.function, entry.packed_metadata, None,
                                                        None, None, *ints, *entry.tail),
        "_launcher.launch": lambda: _launcher.launch(kernel, grid, args, meta),
        "the op": op_call,
        "signature": lambda: module._signature(*inputs),
        **eager_rows,
    }
    # the launcher's own decision (ops/_launcher.py's _c_launch_of): 3.6's form and no scratch memory
    why = None if entry.c_launch is not None else (
        f"triton {triton.__version__}: the launcher is not 3.6's form, or the kernel needs scratch memory")
    if why is None:
        c, coop, pdl = entry.c_launch, entry.cooperative, entry.pdl
        rows["C launch, tensors"] = lambda: c(*g, stream, entry.function, coop, pdl, None, None,
                                              entry.packed_metadata, None, None, None, *args, *entry.tail)
        rows["C launch, ints"] = lambda: c(*g, stream, entry.function, coop, pdl, None, None, entry.packed_metadata,
                                           None, None, None, *ints, *entry.tail)
        op_call(), op_call()
        plan = module._PLANS.get(module._signature(*inputs))
        if plan is not None:
            addresses = tuple(a.data_ptr() for a in args if isinstance(a, torch.Tensor))
            rows["plan launch"] = lambda: module._PLANS.launch(plan, *addresses)
    return rows, why


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    if not runtime.on_gpu():
        sys.exit("per_call_parts.py times host time around GPU launches: it needs a GPU")
    warm_up_gpu()
    if _launcher.why_not() is not None:
        sys.exit(f"the cached launch is off: {_launcher.why_not()}")
    dtype, dev = runtime.dtype(), runtime.device()
    results = {}
    with torch.inference_mode():
        gate, up = (torch.randn(1, 14336, device=dev, dtype=dtype) for _ in range(2))
        spin = time.perf_counter() + 3  # the host's clocks up first: the first rows timed ran slower without this
        while time.perf_counter() < spin:
            ops.swiglu(gate, up), F.silu(gate) * up
        torch.cuda.synchronize()
        out, meta = torch.empty_like(gate), swiglu_config(14336)
        rows, why = parts(_swiglu_kernel, (-(-14336 // meta["BLOCK"]),), (gate, up, out, 14336, 14336, 14336, 14336),
                          meta, lambda: ops.swiglu(gate, up),
                          {"eager single op (torch.mul)": lambda: torch.mul(gate, up),
                           "eager (F.silu(g) * u)": lambda: F.silu(gate) * up}, (gate, up),
                          sys.modules["lessonlib.ops.swiglu"], (gate, up))
        results["swiglu T=1 I=14336"] = {"rows": per_call_us(rows, CALLS, ROUNDS), "c_launch": why or "3.6's form"}
        x, r, w = (torch.randn(*s, device=dev, dtype=dtype) for s in ((1, 4096), (1, 4096), (4096,)))
        o, ro = torch.empty_like(x), torch.empty_like(x)
        meta = {**add_rms_norm_config(4096), **pdl_options()}
        rows, why = parts(_add_rms_norm_kernel, (1,), (x, r, w, o, ro, 4096, 4096, 4096, 1e-6), meta,
                          lambda: ops.add_rms_norm(x, r, w, 1e-6),
                          {"eager single op (torch.add)": lambda: torch.add(x, r),
                           "eager (x + r, F.rms_norm)": lambda: F.rms_norm(x + r, (4096,), w, 1e-6)}, (x, r, w),
                          sys.modules["lessonlib.ops.add_rms_norm"], (x, r, w, 1e-6))
        results["add_rms_norm T=1 H=4096"] = {"rows": per_call_us(rows, CALLS, ROUNDS), "c_launch": why or "3.6's form"}
    for case, result in results.items():
        print(case, "| C launch:", result["c_launch"])
        for name, t in result["rows"].items():
            print(f"  {name:32s} {t['us']:8.3f} us  ({t['min_us']:.3f}-{t['max_us']:.3f})")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": "python -m benchmarks.experiments.per_call_parts", "environment": environment(),
            "timing": f"{CALLS} back-to-back calls between syncs, time.perf_counter; median of {ROUNDS} rounds "
                      "(rows interleaved, forward then reversed)", "results": results}, indent=1))


if __name__ == "__main__":
    main()
