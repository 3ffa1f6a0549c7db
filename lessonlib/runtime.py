"""The one place that decides where the course's kernels run.

Two modes:

* ``"gpu"``: CUDA is available, kernels are compiled by Triton and run on the GPU.
* ``"interpreter"``: no GPU; Triton's interpreter runs the *same* kernels on CPU tensors, element by element in
  NumPy. Correct, but slow: problem sizes shrink and times are never performance.

Triton reads ``TRITON_INTERPRET`` when a kernel is *defined* (when ``@triton.jit`` runs). That includes Triton's
own library functions such as ``tl.sigmoid``, which are defined when ``triton.language`` is first imported. So the
mode is decided here, before triton.language is imported and before any of lessonlib's kernels are defined:
``lessonlib.ops`` calls :func:`mode` first thing. Importing ``lessonlib`` imports no Triton and never locks a mode;
if something imported Triton in the other mode first, :func:`mode` says so instead of letting kernels fail later.

Override with the environment variable ``LESSONLIB_MODE=interpreter`` (e.g. to run the interpreter on a GPU
machine). ``TRITON_INTERPRET=1`` set by the user is honoured as well.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
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
    _check_triton_language(chosen)
    return chosen


def _check_triton_language(chosen: str) -> None:
    language = sys.modules.get("triton.language")
    if language is None:
        return  # imported later, in the mode just set
    interpreted = type(language.sigmoid).__name__ == "InterpretedFunction"
    if interpreted != (chosen == "interpreter"):
        raise RuntimeError(
            f"lessonlib chose mode {chosen!r}, but triton.language was already imported "
            f"{'with' if interpreted else 'without'} TRITON_INTERPRET set, so Triton's own functions (tl.sigmoid...) "
            "are locked in the other mode. Restart the kernel and import lessonlib before triton "
            "(run the notebook's set-up cell first)."
        )


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
    gpu = on_gpu()  # decide the mode before triton is imported
    import triton

    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    if gpu:
        return f"Mode: GPU ({torch.cuda.get_device_name()}), {versions}"
    return f"Mode: Triton interpreter on CPU (no GPU: small sizes, times are not performance), {versions}"


def gpu_only(what: str, instead: str = "The recorded H200 results are shown instead.") -> bool:
    """True on a GPU; on CPU print why a GPU-only step is skipped (and what the notebook shows ``instead``) and
    return False.

    >>> if gpu_only("live timing of swiglu"):
    ...     ...  # measure
    """
    if on_gpu():
        return True
    print(f"[GPU only] {what}: skipped here (no GPU, Triton interpreter). {instead}".rstrip())
    return False


def scratch_dir() -> Path:
    """The course's own folder for things it builds and caches (the tiny model, compiler caches): ``scratch/`` in
    the repository checkout, or ``$LESSONLIB_SCRATCH``; outside a checkout (a pip install), ``./scratch``."""
    if os.environ.get("LESSONLIB_SCRATCH"):
        root = Path(os.environ["LESSONLIB_SCRATCH"])
    else:
        checkout = Path(__file__).resolve().parents[1]
        root = (checkout if (checkout / "pyproject.toml").exists() and (checkout / "notebooks").is_dir() else Path.cwd()) / "scratch"
    root.mkdir(parents=True, exist_ok=True)
    return root


def point_caches() -> dict[str, str]:
    """Point vLLM's, Inductor's and Triton's caches into :func:`scratch_dir` unless the user set them; return them.
    Call it before importing vllm or compiling anything (those read the variables once)."""
    caches = {"VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
    for variable, folder in caches.items():
        os.environ.setdefault(variable, str(scratch_dir() / "cache" / folder))
    return {variable: os.environ[variable] for variable in caches}
