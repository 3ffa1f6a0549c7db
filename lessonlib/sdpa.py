"""PyTorch's scaled_dot_product_attention (SDPA) and its backends, for lesson 02: run it on chosen backends, and see
what each backend says when it cannot take the inputs (the real error, with PyTorch's own reasons)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lessonlib import runtime

BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
GQA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "MATH")  # the ones that take enable_gqa=True
WHY_ABSENT = {
    "FLASH_ATTENTION": "FlashAttention-2's CUDA kernels are built for sm_80 and newer",
    "CUDNN_ATTENTION": "cuDNN's fused attention needs sm_80 or newer",
}


def available_backends() -> tuple[str, ...]:
    """The backends this GPU has kernels for (all four on the CPU list: PyTorch itself says which refuse there)."""
    profile = runtime.gpu_profile()
    return BACKENDS if profile is None else profile.sdpa_backends()


def _refuse_absent(backends: tuple[str, ...]) -> None:
    """On a GPU profile without these backends (a T4, or LESSONLIB_GPU_PROFILE=t4 on a bigger GPU), raise the error
    PyTorch raises on that GPU, before anything runs. Emulation needs it; on a real T4 PyTorch would say the same."""
    missing = [b for b in backends if b not in available_backends()]
    if missing and len(missing) == len(backends):
        profile = runtime.gpu_profile()
        reasons = "; ".join(f"{b}: {WHY_ABSENT.get(b, 'absent')}" for b in missing)
        raise RuntimeError(f"No available kernel. Aborting execution. (on {profile.name}, sm_{profile.arch}: {reasons})")


def scaled_dot_product_attention(q, k, v, causal: bool = False, backends: tuple[str, ...] | None = None,
                                 set_priority: bool = False, dropout_p: float = 0.0):
    """PyTorch's ``F.scaled_dot_product_attention`` on q (B, H, Nq, D), k, v (B, Hkv, Nkv, D), restricted to
    ``backends`` (names of SDPBackend, tried in that order when ``set_priority``); None lets PyTorch choose. GQA
    through ``enable_gqa``. ``dropout_p``: dropout on the attention probabilities (the flash and memory-efficient
    CUDA kernels draw the mask inside the kernel from a seed; MATH materialises it). (The plain-PyTorch attention
    that tests check against is ``reference.attention``.)"""
    gqa = q.shape[1] != k.shape[1]
    if backends is None:
        backends = available_backends() if runtime.gpu_profile() is not None and runtime.gpu_profile().emulated_on else None
    if backends is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, enable_gqa=gqa)
    _refuse_absent(tuple(backends))
    backends = [b for b in backends if b in available_backends()]
    if gqa and not any(b in GQA_BACKENDS for b in backends):
        # The memory-efficient kernel refuses enable_gqa ("No available kernel", torch 2.11 on the H200): give it K
        # and V repeated per query head, which is what GQA means.
        group = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
    with sdpa_kernel([getattr(SDPBackend, b) for b in backends], set_priority=set_priority):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, enable_gqa=gqa)


def try_backend(backend: str, q, k, v, causal: bool = False) -> tuple[bool, str]:
    """Force one backend. Returns (True, "") when it ran, else (False, the error and the reasons PyTorch warned)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            scaled_dot_product_attention(q, k, v, causal, backends=(backend,))
            return True, ""
        except RuntimeError as error:
            reasons = [str(w.message).strip() for w in caught if "not used because" in str(w.message) or
                       "requires" in str(w.message) or "support" in str(w.message)]
            return False, "\n".join([f"RuntimeError: {error}", *(f"  warning: {r}" for r in reasons)])
