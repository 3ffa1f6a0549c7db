"""The one place that decides where the course's kernels run.

Two modes:

* ``"gpu"``: CUDA is available, kernels are compiled by Triton and run on the GPU.
* ``"interpreter"``: no GPU; Triton's interpreter runs the *same* kernels on CPU tensors, element by element in
  NumPy. Correct, but slow: problem sizes shrink and times are never performance.

Triton reads ``TRITON_INTERPRET`` when a kernel is *defined* (when ``@triton.jit`` runs), not when triton is
imported. So the mode is decided here, before any of lessonlib's kernels are defined: ``lessonlib.ops`` calls
:func:`mode` first thing. Importing ``lessonlib`` itself defines no kernel and therefore never locks a mode.

Override with the environment variable ``LESSONLIB_MODE=interpreter`` (e.g. to run the interpreter on a GPU
machine). ``TRITON_INTERPRET=1`` set by the user is honoured as well.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

MODES = ("gpu", "interpreter")


@lru_cache(maxsize=None)
def mode() -> str:
    """Return ``"gpu"`` or ``"interpreter"``, deciding once per process (and setting TRITON_INTERPRET)."""
    requested = os.environ.get("LESSONLIB_MODE", "").strip().lower()
    if requested and requested not in MODES:
        raise ValueError(f"LESSONLIB_MODE={requested!r}: expected one of {MODES}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and requested != "gpu":
        requested = "interpreter"
    if requested == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("LESSONLIB_MODE=gpu but torch sees no CUDA device")
    chosen = requested or ("gpu" if torch.cuda.is_available() else "interpreter")
    if chosen == "interpreter":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    return chosen


def on_gpu() -> bool:
    return mode() == "gpu"


@lru_cache(maxsize=None)
def device() -> torch.device:
    """Where lessonlib's kernels expect their tensors: the current CUDA device, or the CPU for the interpreter."""
    return torch.device("cuda") if on_gpu() else torch.device("cpu")


def pick(*, cpu, gpu):
    """A problem size for the current mode: small on CPU so the interpreter finishes in seconds, real on GPU.

    >>> tokens = pick(cpu=64, gpu=8192)
    """
    return gpu if on_gpu() else cpu


@lru_cache(maxsize=None)
def supported_dtypes() -> tuple[torch.dtype, ...]:
    """Floating dtypes the kernels accept here. Triton's interpreter has no bfloat16 (its bf16 ``tl.dot`` returns
    garbage), so the course keeps bf16 to the GPU everywhere."""
    if on_gpu():
        return (torch.float32, torch.float16, torch.bfloat16)
    return (torch.float32, torch.float16)


def describe() -> str:
    """One line for a notebook's first cell: where kernels run, and with which versions."""
    import triton

    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    if on_gpu():
        return f"Mode: GPU ({torch.cuda.get_device_name()}), {versions}"
    return f"Mode: Triton interpreter on CPU (no GPU: small sizes, times are not performance), {versions}"
