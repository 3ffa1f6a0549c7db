"""lessonlib: the helper package of the course "Fast Attention Kernels & Operator Fusion".

* ``lessonlib.runtime``: where kernels run (GPU, or Triton's interpreter on CPU) and problem sizes for each.
* ``lessonlib.reference``: plain-PyTorch definitions (no Triton).
* ``lessonlib.ops``: the same functions as fused Triton kernels.
* ``lessonlib.measure``, ``lessonlib.traffic``, ``lessonlib.results``: timing, launch counts, the bytes-and-FLOPs
  model, recorded GPU runs.
* ``lessonlib.plots``, ``lessonlib.widgets``: figures and interactive views for the notebooks.
* ``lessonlib.exercises``: checkers for the exercises.

Importing ``lessonlib`` defines no kernel, so it never locks the wrong runtime mode.
"""

import inspect
import sys

from lessonlib.runtime import describe, device, gpu_only, mode, pick

__all__ = ["describe", "device", "gpu_only", "mode", "pick", "source"]


def source(obj) -> str:
    """The whole source file that defines ``obj`` (a kernel file reads top to bottom: kernel, then launcher).
    Notebooks print this rather than copying library code."""
    module = sys.modules[obj.__module__] if not inspect.ismodule(obj) else obj
    return inspect.getsource(module)
__version__ = "0.1.0"
