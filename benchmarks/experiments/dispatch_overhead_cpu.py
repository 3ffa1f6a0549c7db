"""Host time of one call at T=1 with the kernel launch stubbed out: what the public op adds over its launcher, and
what going through the custom-op dispatcher would add. Runs on CPU (no GPU needed): the Python path is the same.

    LESSONLIB_MODE=interpreter python benchmarks/experiments/dispatch_overhead_cpu.py

Microseconds per call, best of interleaved rounds (a shared, loaded machine adds noise, never removes time):
  launcher            swiglu_forward / add_rms_norm_forward: validation, allocation, (stubbed) launch. Before
                      issue 12 this was the whole of lessonlib.ops.swiglu / add_rms_norm.
  public op           lessonlib.ops.swiglu / add_rms_norm: the fast path taken when no input requires grad
  wrapper's test      the public op's own work: requires_grad of each input and torch.compiler.is_compiling()
  custom op           torch.ops.lessonlib.swiglu / add_rms_norm: the dispatcher path (autograd, torch.compile)
"""

import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lessonlib import ops, runtime  # noqa: E402

sw, rn = sys.modules["lessonlib.ops.swiglu"], sys.modules["lessonlib.ops.add_rms_norm"]  # the modules, not the ops
sw.launch = rn.launch = lambda *args, **kwargs: None  # host time of the Python path only
device = runtime.device()
dtype = torch.float16
gate, up = torch.randn(1, 14336, dtype=dtype, device=device), torch.randn(1, 14336, dtype=dtype, device=device)
x, res, w = (torch.randn(1, 4096, dtype=dtype, device=device), torch.randn(1, 4096, dtype=dtype, device=device),
             torch.randn(4096, dtype=dtype, device=device))
calls = {
    "swiglu launcher": lambda: sw.swiglu_forward(gate, up),
    "swiglu public op": lambda: ops.swiglu(gate, up),
    "swiglu wrapper's test": lambda: (getattr(gate, "requires_grad", False) or getattr(up, "requires_grad", False)
                                      or torch.compiler.is_compiling()),
    "swiglu custom op": lambda: torch.ops.lessonlib.swiglu(gate, up),
    "add_rms_norm launcher": lambda: rn.add_rms_norm_forward(x, res, w),
    "add_rms_norm public op": lambda: ops.add_rms_norm(x, res, w),
    "add_rms_norm custom op": lambda: torch.ops.lessonlib.add_rms_norm(x, res, w, 1e-6),
}
best = {name: float("inf") for name in calls}
for _ in range(15):
    for name, fn in calls.items():
        best[name] = min(best[name], timeit.timeit(fn, number=200) / 200 * 1e6)
for name, us in best.items():
    print(f"{name:26s} {us:8.2f} us")
