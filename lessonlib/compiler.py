"""Looking inside torch.compile for lesson 04: the code Inductor generates, the kernels in it, graph breaks,
recompilations, and Inductor's log channels (read from a subprocess, since TORCH_LOGS is read at import)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from dataclasses import dataclass

import torch

from lessonlib import runtime

runtime.mode()  # torch.compile imports triton: the mode must be chosen first (see lessonlib.runtime)

FUSED_KERNEL = re.compile(r"^(\w+) = async_compile\.(?:cpp_pybinding|cpp|triton)\(", re.M)
# A call site, "extern_kernels.mm(..." or "buf4 = torch.ops.lessonlib.swiglu.default(...", not comments or asserts.
LIBRARY_CALL = re.compile(r"^\s*(?:\w+\s*=\s*)?(extern_kernels\.\w+|torch\.ops\.(?!inductor\b)\w+\.\w+)(?:\.default)?\(", re.M)


@dataclass
class GeneratedCode:
    code: str  # Inductor's output code (Python with C++ or Triton kernels inside)
    fused_kernels: list[str]  # kernels Inductor wrote: one per fused group of ops
    library_calls: list[str]  # calls it left to libraries (GEMMs) or to registered custom ops, in call order

    @property
    def launches(self) -> int:
        """Kernels one call runs: Inductor's own plus the library and custom-op calls."""
        return len(self.fused_kernels) + len(self.library_calls)


def generated_code(fn, *args) -> tuple[object, GeneratedCode]:
    """Compile ``fn`` (a function or module, already wrapped in torch.compile or not), run it on ``args`` and return
    (its output, the code Inductor generated for it). Uses Inductor's own helper, run_and_get_code."""
    from torch._inductor.utils import run_and_get_code

    compiled = fn if hasattr(fn, "_torchdynamo_orig_callable") else torch.compile(fn)
    out, codes = run_and_get_code(compiled, *args)
    code = "\n".join(codes)
    return out, GeneratedCode(code, FUSED_KERNEL.findall(code), _calls_in_call_function(code))


def _calls_in_call_function(code: str) -> list[str]:
    """Library calls inside the generated ``call`` function (the one that runs per invocation)."""
    body = code.split("def call(", 1)[1] if "def call(" in code else code
    body = body.split("\ndef ", 1)[0]
    return [m.group(1) for m in LIBRARY_CALL.finditer(body)]


@dataclass
class GraphBreak:
    reason: str
    where: str


def graph_breaks(fn, *args) -> list[GraphBreak]:
    """Where and why Dynamo splits ``fn`` into several graphs (``torch._dynamo.explain``). Dynamo's own warning
    about a call it cannot trace says the same as the break's reason, at length: it is silenced here."""
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Dynamo does not know how to trace", category=UserWarning)
        report = torch._dynamo.explain(fn)(*args)
    breaks = []
    for item in report.break_reasons:
        frame = item.user_stack[-1] if item.user_stack else None
        where = f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.line.strip() if frame.line else ''}" if frame else "?"
        breaks.append(GraphBreak(item.reason.strip().splitlines()[0], where))
    return breaks


def count_compilations(fn, inputs, **compile_kwargs) -> int:
    """Compile ``fn`` once and call it on each of ``inputs`` (tuples of arguments); return how many graphs Dynamo
    compiled in total (1 = no recompilation)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, **compile_kwargs)
    for args in inputs:
        compiled(*args)
    return int(counters["stats"]["unique_graphs"])


def torch_logs(snippet: str, channels: str, timeout: float = 600) -> list[str]:
    """Run ``snippet`` in a fresh Python with TORCH_LOGS=``channels`` and return what those logs printed. (The
    variable is read when torch is imported, so it cannot be switched on inside a running notebook.)"""
    env = {**os.environ, "TORCH_LOGS": channels, "LESSONLIB_MODE": runtime.mode()}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(snippet)], capture_output=True, text=True,
                            env=env, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"the snippet failed:\n{result.stderr[-3000:]}")
    return [line for line in result.stderr.splitlines() if line.strip()]


def wrapped_code(code: str) -> str:
    """Generated code to print: each line over ``runtime.PRINT_WIDTH`` broken between words, its continuation
    indented four more than the line (JupyterLab at 1280x800 would break it anywhere, inside a number too)."""
    lines = []
    for line in code.split("\n"):
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        lines += textwrap.wrap(line, runtime.PRINT_WIDTH, subsequent_indent=indent, break_long_words=False,
                               break_on_hyphens=False, drop_whitespace=True) or [line]
    return "\n".join(lines)


# Lesson 04 prints this draw and lesson 05's table of claims quotes it: one seed, so the two show one figure.
ROUNDING_SEED = 0


@dataclass(frozen=True)
class RoundingOrder:
    dtype: torch.dtype
    differ: float  # the share of elements where eager and fused differ
    apart_units: float  # the largest eager-fused difference, in units (below)
    eager_units: float  # eager's largest error against float64: two roundings
    fused_units: float  # the fused kernel's: one rounding


def rounding_order(dtype: torch.dtype, shape=(128, 512),
                   seed: int = ROUNDING_SEED) -> RoundingOrder:
    """silu(gate) * up in ``dtype``: eager (two kernels, two roundings) against lessonlib's fused
    swiglu (one), on inputs drawn on the CPU from ``seed`` (the same numbers on every device),
    against float64 on the same rounded inputs. A unit is the dtype's epsilon times the exact value;
    subnormal results are left out, since relative units mean nothing there."""
    from lessonlib import ops, reference

    generator = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(shape, generator=generator).to(runtime.device(), dtype)
                for _ in range(2))
    exact = reference.swiglu(gate.double(), up.double())
    normal = exact.abs() >= torch.finfo(dtype).tiny
    unit = torch.finfo(dtype).eps * exact.abs()
    eager, fused = reference.swiglu(gate, up), ops.swiglu(gate, up)

    def units(a, b):
        return ((a.double() - b.double()).abs() / unit)[normal].max().item()

    return RoundingOrder(dtype, (eager != fused).double().mean().item(), units(eager, fused),
                         units(eager, exact), units(fused, exact))
