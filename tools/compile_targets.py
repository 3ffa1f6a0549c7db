"""Compile every kernel of lessonlib.ops for a GPU architecture, on a machine with no such GPU (or none at all), with
the configuration its launcher would pick there, and report the shared memory each compiled kernel asks for.

    LESSONLIB_MODE=compile LESSONLIB_GPU_PROFILE=t4 python tools/compile_targets.py            # a table
    LESSONLIB_MODE=compile LESSONLIB_GPU_PROFILE=t4 python tools/compile_targets.py --json     # one JSON line per kernel
    ... --registers   # also run the Triton wheel's ptxas -v: registers and spill stores per thread

How: Triton compiles for the target its *active driver* reports. A stand-in driver that reports
``GPUTarget("cuda", arch, 32)`` and launches nothing makes ``JITFunction.warmup(...)`` compile the whole pipeline
(Triton IR, LLVM IR, PTX, and a cubin from the wheel's ptxas) for that architecture. ``compiled.metadata.shared``
is the dynamic shared memory the launch will ask for; the driver compares it with the GPU's opt-in limit when the
kernel is loaded (``OutOfResources: shared memory``). tests/ops/test_compile_targets.py runs this in CI.

Runs in ``LESSONLIB_MODE=compile`` (see lessonlib.runtime): the kernels must be defined for the compiler, not the
interpreter, and ``runtime.gpu_profile()`` must be the profile whose choices are checked.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lessonlib import runtime  # noqa: E402
from compile_cases import Case, cases, planted_case  # noqa: E402  (this folder: the kernels and their configurations)


def stand_in_driver(arch: int):
    """A Triton driver that reports ``sm_<arch>`` as the current target and has no device: enough for
    ``JITFunction.warmup`` to compile (warmup never launches). Its device id is the arch, so that each target gets its
    own entry in the kernel's per-device cache."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class StandInDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return False  # never picked by Triton itself

        def map_python_to_cpp_type(self, ty):
            raise RuntimeError("stand-in driver: compile only, nothing launches")

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("stand-in driver: compile only, nothing launches")

        def get_current_device(self):
            return arch

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

    return StandInDriver()


def compile_for(kernel, arch: int, args: tuple, meta: dict):
    """``kernel`` compiled for sm_<arch> with these arguments (torch dtypes stand for tensors of that dtype, ints and
    floats as at a launch) and constexprs/options ``meta``. Returns Triton's CompiledKernel."""
    import triton

    triton.runtime.driver.set_active(stand_in_driver(arch))
    try:
        return kernel.warmup(*args, grid=(1,), **meta)
    finally:
        triton.runtime.driver.reset_active() if _has_real_driver() else None


def _has_real_driver() -> bool:
    return torch.cuda.is_available()


def ptxas_usage(compiled, arch: int) -> dict:
    """Registers per thread and spill stores (bytes) of a compiled kernel, from the Triton wheel's own ptxas -v."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(arch).path  # triton 3.9: a separate ptxas for sm_90 and newer
    except TypeError:
        ptxas = get_ptxas().path  # triton 3.6: one ptxas
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        run = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{'a' if arch >= 90 else ''}", str(ptx),
                              "-o", str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True)
    text = run.stdout + run.stderr
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_bytes": int(spills.group(1)) if spills else None}


def compile_case(case: Case, profile: runtime.GPUProfile, registers: bool = False) -> dict:
    """Compile one case for the profile's architecture; a JSON-able record of what was asked and what came out."""
    import triton

    start = time.perf_counter()
    compiled = compile_for(case.kernel, profile.arch, case.args, case.meta)
    record = {
        "triton": triton.__version__, "arch": profile.arch, "profile": profile.name, "op": case.op, "kernel": case.name, "label": case.label,
        "dtype": str(case.dtype).removeprefix("torch."),
        "config": case.config,
        "shared": compiled.metadata.shared, "limit": profile.shared_memory_per_block, "estimate": case.estimate,
        "seconds": round(time.perf_counter() - start, 1), "planted": case.planted,
    }
    if registers:
        record.update(ptxas_usage(compiled, profile.arch))
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON line per compiled kernel")
    parser.add_argument("--registers", action="store_true", help="also registers and spills (the wheel's ptxas -v)")
    parser.add_argument("--thorough", action="store_true", help="every dtype for every case")
    parser.add_argument("--only", default="", help="compile only kernels whose name contains this")
    parser.add_argument("--plant", action="store_true", help="also compile the H200's D=128 forward tiles here")
    args = parser.parse_args(argv)
    if runtime.mode() != "compile":
        parser.error("run with LESSONLIB_MODE=compile and LESSONLIB_GPU_PROFILE=<profile> (see lessonlib.runtime)")
    profile = runtime.gpu_profile()
    for case in cases(thorough=args.thorough) + ([planted_case(profile)] if args.plant else []):
        if args.only not in case.name:
            continue
        record = compile_case(case, profile, registers=args.registers)
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            config = " ".join(f"{k}={v}" for k, v in record["config"].items())
            extra = f" regs={record['registers']} spill={record['spill_bytes']}B" if args.registers else ""
            print(f"sm_{record['arch']} {record['kernel']:<34} {record['dtype']:<9} {record['label']:<22} {config:<60} "
                  f"shared={record['shared']:>6} estimate={record['estimate']} limit={record['limit']}{extra}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
