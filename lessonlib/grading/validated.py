"""The validated runner: a process that runs lessonlib's checkers on the submission's validated answers and on
nothing else of the submission.

Its checks are those whose answer is source text the grader took from the notebook and validated: a kernel
exercise's ``@triton.jit`` source (:mod:`~lessonlib.grading.kernel_source`, Triton language only) and, for the
checkers that must run the student's function in their own process (``torch.compile`` traces it, a CUDA graph
captures it, a checker compares tensors' addresses: :data:`~lessonlib.grading.judge.IN_PROCESS`), the function's
source in the grader's PyTorch subset (:mod:`~lessonlib.grading.torch_source`). For each, in order, it defines the
source in a namespace of its own (``triton.jit`` for a kernel; ``torch``, ``F``, ``math`` and
``lessonlib.reference`` for a function), runs the pristine checker on it, and writes the outcome to its pipe as one
JSON line (index, status, what the checker printed, the error's name and text). The judge reads these lines, checks
their form and reports them as its own.

The judge starts it as a fork of itself, inside the judge's sandbox, before the judge runs any check
(:func:`fork`): a fresh process that has run nothing of the submission and
holds no descriptor but its pipe (a sandbox of its own would cost a second start of torch and Triton per notebook:
the grading cost's bound of issue 43). On a GPU it is a fresh interpreter instead (``python -m
lessonlib.grading.validated``, the checks on its stdin): the judge has asked CUDA whether there is a GPU, and a child
forked after that cannot use CUDA. It decides nothing, and the judge runs no code that came from the
submission.
"""

from __future__ import annotations

import json
import linecache
import os
import subprocess
import sys

from lessonlib.grading.judge import check_outcome  # how the judge runs a checker: one way for both


def define_kernel(name: str, source: str):
    """``source`` (validated) defined as a genuine ``triton.jit`` function in a namespace of its own."""
    import triton
    import triton.language as tl

    filename = f"<submitted kernel {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"triton": triton, "tl": tl, "jit": triton.jit, "__name__": "submitted_kernels"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def define_function(name: str, source: str):
    """``source`` (validated: the PyTorch subset) defined in a namespace holding only the modules it may use."""
    import math

    import torch
    import torch.nn.functional

    from lessonlib import reference

    filename = f"<submitted function {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"torch": torch, "F": torch.nn.functional, "math": math, "reference": reference,
                 "__name__": "submitted_functions"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def run_checks(checks: list[dict], timeout: float, result_fd: int) -> None:
    """Run each check's pristine checker on its validated source, each within ``timeout`` seconds; one outcome line
    per check on ``result_fd``."""
    for entry in checks:
        define = define_kernel if entry["validated"] == "kernel" else define_function
        outcome = check_outcome(entry, lambda: define(entry["solution_id"], entry["source"]), timeout)
        os.write(result_fd, json.dumps(outcome).encode() + b"\n")
    sys.stdout.flush()


def fork(checks: list[dict], timeout: float) -> tuple[int, int]:
    """Start the validated runner: a fork of the judge (:func:`~lessonlib.grading.judge.run_judge`), made before
    the judge runs any check (it has run nothing of the submission; a fork spares a second import of torch and
    Triton, the bulk of a process's start), holding no descriptor but its outcome pipe. Returns (the pipe's read
    end, its pid). The judge is made non-dumpable first: a process of the same user (the fork) can then neither
    trace it nor read its memory. On a GPU, a fresh interpreter given the checks on its stdin (see the module's
    docstring), holding no descriptor but the pipe's write end either."""
    import ctypes

    from lessonlib import runtime

    try:
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass
    read, write = os.pipe()
    sys.stdout.flush()
    if runtime.on_gpu():
        child = subprocess.Popen([sys.executable, "-m", "lessonlib.grading.validated", str(write), repr(timeout)],
                                 stdin=subprocess.PIPE, pass_fds=(write,))
        os.close(write)
        child.stdin.write(json.dumps(checks).encode())
        child.stdin.close()
        return read, child.pid
    pid = os.fork()
    if pid == 0:
        try:
            for fd in map(int, os.listdir("/proc/self/fd")):
                if fd > 2 and fd != write:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            run_checks(checks, timeout, write)
        finally:
            os._exit(0)
    os.close(write)
    return read, pid


if __name__ == "__main__":  # the validated runner as a fresh interpreter (fork's GPU path): FD TIMEOUT, checks on stdin
    from lessonlib import runtime

    runtime.mode()
    run_checks(json.loads(sys.stdin.read()), float(sys.argv[2]), int(sys.argv[1]))
    sys.stdout.flush()
