"""The one place that decides where the course's kernels run.

Three modes:

* ``"gpu"``: CUDA is available, kernels are compiled by Triton and run on the GPU.
* ``"interpreter"``: no GPU; Triton's interpreter runs the *same* kernels on CPU tensors, element by element in
  NumPy. Correct, but slow: problem sizes shrink and times are never performance.
* ``"compile"`` (only when asked for, ``LESSONLIB_MODE=compile``): kernels are defined for Triton's GPU compiler but
  nothing can launch, on a machine with or without a GPU. :func:`gpu_profile` is the profile named by
  ``LESSONLIB_GPU_PROFILE``, so the launchers' configuration functions answer "what would run on a T4?", and
  ``tools/compile_targets.py`` compiles each kernel with that answer for the profile's architecture (``GPUTarget``):
  the CI test ``tests/ops/test_compile_targets.py`` checks the compiled kernels' shared memory that way, with no GPU.

Triton reads ``TRITON_INTERPRET`` when a kernel is *defined* (when ``@triton.jit`` runs). That includes Triton's
own library functions such as ``tl.sigmoid``, which are defined when ``triton.language`` is first imported. So the
mode is decided here, before triton.language is imported and before any of lessonlib's kernels are defined:
``lessonlib.ops`` calls :func:`mode` first thing. Importing ``lessonlib`` imports no Triton and never locks a mode;
if something imported Triton in the other mode first, :func:`mode` says so instead of letting kernels fail later.

In interpreter mode :func:`mode` also installs :mod:`lessonlib._interpreter`: Triton's interpreter without its
re-patching of triton.language at every helper call (the same results, two to three times faster in kernels that
call helpers).

Override with the environment variable ``LESSONLIB_MODE=interpreter`` (e.g. to run the interpreter on a GPU
machine). ``TRITON_INTERPRET=1`` set by the user is honoured as well.
"""

from __future__ import annotations

import atexit
import os
import sys
import textwrap
from pathlib import Path
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

MODES = ("gpu", "interpreter", "compile")
PRINT_WIDTH = 100  # the widest line to print: JupyterLab's output at 1280 px holds 107, then breaks lines anywhere


@lru_cache(maxsize=None)
def mode() -> str:
    """Return ``"gpu"``, ``"interpreter"`` or ``"compile"``, deciding once per process (and setting
    TRITON_INTERPRET)."""
    requested = os.environ.get("LESSONLIB_MODE", "").strip().lower()
    if requested and requested not in MODES:
        raise ValueError(f"LESSONLIB_MODE={requested!r}: expected one of {MODES}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and requested not in ("gpu", "compile"):
        requested = "interpreter"
    if requested == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("LESSONLIB_MODE=gpu but torch sees no CUDA device")
    chosen = requested or ("gpu" if torch.cuda.is_available() else "interpreter")
    if chosen == "interpreter":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        if os.environ.get("LESSONLIB_PEAK_MEMORY_LOG"):
            _record_peak_memory(os.environ["LESSONLIB_PEAK_MEMORY_LOG"])
    _check_triton_language(chosen)
    if chosen == "interpreter":
        from lessonlib import _interpreter

        _interpreter.install()  # helpers no longer re-patch triton.language per call: the same results, faster
    return chosen


def _record_peak_memory(path: str) -> None:
    """Keep ``path`` holding this process's peak GPU memory (``torch.cuda.max_memory_allocated``) as one JSON line:
    rewritten after every notebook cell (a kernel that nbval shuts down runs no exit handler), and at exit. How
    tools/gpu_check.sh records each notebook's peak, natively and under LESSONLIB_GPU_PROFILE."""
    import json

    def write(*_):
        profile = gpu_profile()
        line = {"peak_bytes": torch.cuda.max_memory_allocated(), "profile": os.environ.get("LESSONLIB_GPU_PROFILE") or "native",
                "gpu": profile.describe(), "budget_bytes": profile.memory_budget}
        Path(path).write_text(json.dumps(line) + "\n")

    atexit.register(write)
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        shell.events.register("post_run_cell", write)


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


def pick(*, cpu, gpu, small_gpu=None):
    """A problem size for the current mode: small on CPU so the interpreter finishes in seconds, real on a GPU, and
    ``small_gpu`` (when given) on a card of 24 GB or less (a T4 or L4), so a notebook stays in its memory budget.

    >>> tokens = pick(cpu=64, gpu=8192)
    >>> B, H, N = pick(cpu=(1, 2, 64), gpu=(2, 32, 4096), small_gpu=(1, 16, 4096))
    """
    if not on_gpu():
        return cpu
    if small_gpu is not None and gpu_profile().small:
        return small_gpu
    return gpu


# ---------------------------------------------------------------------------------------------------------------
# The GPU profile: what the student's GPU can do, decided once. Every kernel configuration, dtype choice, problem
# size and SDPA guard reads it, so that `LESSONLIB_GPU_PROFILE=t4` on a big GPU makes the whole course behave as it
# would on a Colab T4.


@dataclass(frozen=True)
class GPUProfile:
    """The limits of one GPU that the course's choices depend on.

    ``shared_memory_per_block`` is the opt-in maximum a kernel may ask for (what Triton checks at load time), not
    the 48 KB default. ``memory_bytes`` is the card's memory as the driver reports it; :attr:`memory_budget` is what
    a notebook may use of it.
    """

    name: str
    capability: tuple[int, int]  # (major, minor): (7, 5) is sm_75
    multiprocessors: int
    shared_memory_per_block: int  # bytes, opt-in limit
    memory_bytes: int
    emulated_on: str | None = None  # the real GPU's name when LESSONLIB_GPU_PROFILE emulates this one
    share: float = 1.0  # the part of the card this process plans for (LESSONLIB_GPU_SHARE), 1 when it has it alone

    @property
    def arch(self) -> int:
        """75 for sm_75: the number Triton's ``GPUTarget`` and ``nvcc -arch`` use."""
        return 10 * self.capability[0] + self.capability[1]

    @property
    def has_bfloat16(self) -> bool:
        """bfloat16 arithmetic and tensor-core products: sm_80 (Ampere) and newer. A T4 (sm_75) has none."""
        return self.capability >= (8, 0)

    @property
    def triton_tensor_cores(self) -> bool:
        """Whether Triton's ``tl.dot`` uses tensor cores here. On sm_75 Triton 3.x lowers it to plain FMA."""
        return self.capability >= (8, 0)

    @property
    def has_tma(self) -> bool:
        """The tensor memory accelerator (bulk tensor copies): Hopper, sm_90, and newer."""
        return self.capability >= (9, 0)

    @property
    def has_wgmma(self) -> bool:
        """Hopper's warpgroup matrix multiply, which Triton's ``tl.dot`` uses on sm_90 only: the kernels' operands
        then stream through shared memory with one more buffer in flight. Blackwell's workstation and consumer
        parts (sm_120, a G4) have none: there ``tl.dot`` is Ampere's ``mma``."""
        return self.capability == (9, 0)

    def stands_in_for(self, other: "GPUProfile") -> bool:
        """Whether this GPU can emulate ``other`` (``LESSONLIB_GPU_PROFILE``): it has every feature the course uses
        that ``other`` has (bfloat16, tensor cores from ``tl.dot``, TMA), and at least its memory and shared memory
        per block. Compared by feature, not by compute capability: an H200 (sm_90) stands in for a G4 (sm_120),
        which has nothing the course uses that Hopper lacks; a T4 stands in for nothing newer."""
        features = ("has_bfloat16", "triton_tensor_cores", "has_tma")
        return (all(getattr(self, f) or not getattr(other, f) for f in features)
                and self.memory_bytes >= other.memory_bytes
                and self.shared_memory_per_block >= other.shared_memory_per_block)

    @property
    def memory_budget(self) -> int:
        """Bytes of GPU memory a notebook may use: three quarters of the card (12 GB of a 16 GB T4), leaving room
        for the CUDA context, cuBLAS workspaces and the caching allocator's slack; times :attr:`share` where several
        processes share the card (``LESSONLIB_GPU_SHARE``: the test suite's notebook runs beside its workers)."""
        return int(0.75 * self.share * self.memory_bytes)

    @property
    def small(self) -> bool:
        """A card of 24 GB or less (T4, L4): notebooks pick their smaller GPU sizes."""
        return self.memory_bytes <= 24 * 2**30

    def sdpa_backends(self) -> tuple[str, ...]:
        """SDPA backends PyTorch has kernels for on this GPU: FlashAttention-2 and cuDNN need sm_80 or newer; the
        memory-efficient backend and the math fallback run everywhere (efficient: no bfloat16 below sm_80)."""
        modern = ("FLASH_ATTENTION", "CUDNN_ATTENTION") if self.capability >= (8, 0) else ()
        return (*modern, "EFFICIENT_ATTENTION", "MATH")

    def describe(self) -> str:
        gib = self.memory_bytes / 2**30
        text = (f"{self.name} (sm_{self.arch}, {self.multiprocessors} SMs, {self.shared_memory_per_block // 1024} KB "
                f"shared memory per block, {gib:.0f} GiB, bfloat16 {'yes' if self.has_bfloat16 else 'no'})")
        if self.emulated_on:
            text += f", emulated on {self.emulated_on}"
        if self.share < 1:
            text += f", planning for {self.share:.0%} of its memory (LESSONLIB_GPU_SHARE)"
        return text


# The GPUs students meet (Colab's T4, L4, A100 and G4; the H100 and the H200 the course was measured on), and an sm_86
# card (A10, like an RTX 3090 or a cloud notebook's A10G) so that every architecture a student may have is covered.
# Shared memory is the opt-in per-block limit of each architecture (CUDA programming guide, compute capabilities
# table: 99 KB on sm_86, sm_89 and sm_120, 163 KB on sm_80, 227 KB on sm_90); memory is what the driver reports on
# Colab (T4 15 GiB usable of 16 GB; A100 the 40 GB part; A10 24 GB, about 22.5 GiB reported). The G4 is Colab's RTX
# PRO 6000 Blackwell (Server Edition; GB202, sm_120): 188 SMs (NVIDIA's specifications: 24,064 CUDA cores, 128 per
# SM), 96 GiB of GDDR7 of which the driver keeps some (ECC and reserved memory: 95 GiB assumed here, not yet read off a
# G4), 101,376 B (99 KB) of shared memory per block (opt-in), bfloat16, and no wgmma (see GPUProfile.has_wgmma).
PROFILES: dict[str, GPUProfile] = {
    "t4": GPUProfile("Tesla T4", (7, 5), 40, 64 * 1024, 15 * 2**30),
    "a10": GPUProfile("NVIDIA A10", (8, 6), 72, 99 * 1024, int(22.5 * 2**30)),
    "l4": GPUProfile("NVIDIA L4", (8, 9), 58, 99 * 1024, int(22.5 * 2**30)),
    "a100": GPUProfile("NVIDIA A100-SXM4-40GB", (8, 0), 108, 163 * 1024, 40 * 2**30),
    "h100": GPUProfile("NVIDIA H100 80GB HBM3", (9, 0), 132, 227 * 1024, 80 * 2**30),
    "h200": GPUProfile("NVIDIA H200", (9, 0), 132, 227 * 1024, 141 * 2**30),
    "g4": GPUProfile("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 188, 99 * 1024, 95 * 2**30),
}


@lru_cache(maxsize=None)
def gpu_profile() -> GPUProfile | None:
    """This machine's GPU profile, or None in the interpreter. ``LESSONLIB_GPU_PROFILE=t4`` (``a10``, ``l4``,
    ``a100``, ``h100``, ``h200``, ``g4``) emulates that GPU on one that stands in for it
    (:meth:`GPUProfile.stands_in_for`): its dtype policy, shared-memory budget for kernel configurations, memory
    budget (enforced with ``torch.cuda.set_per_process_memory_fraction``), problem sizes and absent SDPA backends. Kernels still compile for the real GPU, so its speed is not emulated.

    ``LESSONLIB_GPU_SHARE=0.5`` (a number in (0, 1]) makes the process plan for that part of the card's memory
    (:attr:`GPUProfile.memory_budget`), for runs that share one GPU: the problem sizes a notebook picks by the budget
    shrink; nothing else changes (nothing is enforced).

    In ``"compile"`` mode (no launches) it is the profile named by ``LESSONLIB_GPU_PROFILE``, as is, with no
    device to compare it with."""
    if mode() == "compile":
        wanted = os.environ.get("LESSONLIB_GPU_PROFILE", "").strip().lower()
        if wanted not in PROFILES:
            raise ValueError(f"LESSONLIB_MODE=compile needs LESSONLIB_GPU_PROFILE, one of {sorted(PROFILES)}; got {wanted!r}")
        return PROFILES[wanted]
    if not on_gpu():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    native = GPUProfile(
        name=props.name,
        capability=(props.major, props.minor),
        multiprocessors=props.multi_processor_count,
        shared_memory_per_block=getattr(props, "shared_memory_per_block_optin", 0) or _optin_shared_memory(props),
        memory_bytes=props.total_memory,
    )
    native = replace(native, share=_gpu_share())
    wanted = os.environ.get("LESSONLIB_GPU_PROFILE", "").strip().lower()
    if not wanted or wanted == "native":
        return native
    if wanted not in PROFILES:
        raise ValueError(f"LESSONLIB_GPU_PROFILE={wanted!r}: expected one of {sorted(PROFILES)} (or 'native')")
    emulated = PROFILES[wanted]
    if not native.stands_in_for(emulated):
        raise ValueError(f"LESSONLIB_GPU_PROFILE={wanted!r}: {native.name} cannot emulate a {emulated.name} (it must "
                         "have its features, bfloat16, tensor cores, TMA, and at least its memory and shared memory)")
    # Hold the process to the emulated card's memory: allocations past it fail as they would there.
    torch.cuda.set_per_process_memory_fraction(emulated.memory_bytes / native.memory_bytes)
    return replace(emulated, emulated_on=native.name, share=native.share)


def _gpu_share() -> float:
    text = os.environ.get("LESSONLIB_GPU_SHARE", "").strip()
    if not text:
        return 1.0
    try:
        share = float(text)
    except ValueError:
        share = float("nan")
    if not 0 < share <= 1:
        raise ValueError(f"LESSONLIB_GPU_SHARE={text!r}: expected a number in (0, 1], the part of the GPU's memory "
                         "this process plans for")
    return share


def _optin_shared_memory(props) -> int:
    # Older torch builds do not expose the opt-in limit: the architecture's value (CUDA programming guide).
    by_capability = {(7, 0): 96, (7, 5): 64, (8, 0): 163, (8, 6): 99, (8, 7): 163, (8, 9): 99, (9, 0): 227,
                     (10, 0): 227, (12, 0): 99}
    return by_capability.get((props.major, props.minor), 48) * 1024


def dtype_supported(dtype: torch.dtype) -> bool:
    """``dtype in supported_dtypes()``, without building the tuple and comparing dtypes one by one: validation runs
    on every op call."""
    if dtype is torch.float32 or dtype is torch.float16:
        return True
    profile = gpu_profile()
    return dtype is torch.bfloat16 and profile is not None and profile.has_bfloat16


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """Floating dtypes the kernels accept here (flash_attention takes fewer on a GPU: see
    ``ops.flash_attention.flash_attention_dtypes``). Triton's interpreter has no bfloat16 (its bf16 ``tl.dot`` returns
    garbage), and GPUs below sm_80 (a T4) have no bfloat16 arithmetic: Triton refuses to compile it there."""
    profile = gpu_profile()
    if profile is not None and profile.has_bfloat16:
        return (torch.float32, torch.float16, torch.bfloat16)
    return (torch.float32, torch.float16)


def dtype(cpu: torch.dtype = torch.float16) -> torch.dtype:
    """The course's low-precision dtype here: bfloat16 on a GPU that has it, float16 on one that does not (sm_75),
    ``cpu`` in the interpreter. Every notebook, benchmark and checker picks its dtype through this.

    >>> dtype = runtime.dtype()             # bfloat16 on an A100/H100, float16 on a T4 and on the CPU
    >>> dtype = runtime.dtype(torch.float32)  # float32 on the CPU
    """
    profile = gpu_profile()
    if profile is None:
        return cpu
    return torch.bfloat16 if profile.has_bfloat16 else torch.float16


def why_not_bfloat16() -> str:
    """One sentence for an error message: why bfloat16 is refused here."""
    profile = gpu_profile()
    if profile is None:
        return "bfloat16 runs on the GPU only: Triton's interpreter has no bfloat16"
    return (f"the {profile.name} (sm_{profile.arch}) has no bfloat16: it needs sm_80 or newer (Triton says "
            "\"Feature '.bf16' requires .target sm_80 or higher\"); use float16")


class MemoryBudgetError(ValueError):
    """A problem size that would not fit the GPU's memory budget, refused before anything is allocated."""


def check_fits(nbytes: int, what: str) -> None:
    """Raise :class:`MemoryBudgetError` if ``nbytes`` exceeds this GPU's memory budget (no check on the CPU)."""
    profile = gpu_profile()
    if profile is not None and nbytes > profile.memory_budget:
        raise MemoryBudgetError(f"{what} needs {nbytes / 2**30:.1f} GiB, over the {profile.memory_budget / 2**30:.1f} "
                                f"GiB budget of this {profile.name}: choose a smaller size")


def describe() -> str:
    """For a notebook's first cell: where kernels run, and with which versions, in lines of at most PRINT_WIDTH."""
    gpu = on_gpu()  # decide the mode before triton is imported
    import triton

    where = ("compile only (nothing launches), for a " if mode() == "compile" else "GPU: " if gpu else
             "Triton interpreter on CPU (no GPU: small sizes, times are not performance)")
    where += gpu_profile().describe() if gpu or mode() == "compile" else ""
    return textwrap.fill(f"Mode: {where}, torch {torch.__version__}, triton {triton.__version__}", PRINT_WIDTH,
                         subsequent_indent="    ")


def gpu_only(what: str, instead: str = "The recorded H200 results are shown instead.") -> bool:
    """True on a GPU; on CPU print why a GPU-only step is skipped (and what the notebook shows ``instead``, in lines
    of at most PRINT_WIDTH) and return False.

    >>> if gpu_only("live timing of swiglu"):
    ...     ...  # measure
    """
    if on_gpu():
        return True
    print(textwrap.fill(f"[GPU only] {what}: skipped here (no GPU, Triton interpreter). {instead}".rstrip(), PRINT_WIDTH))
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
