import pytest
import torch

from lessonlib import runtime

runtime.mode()  # decide GPU vs interpreter before any test module defines or imports a kernel

DTYPES = runtime.supported_dtypes()
DEVICE = runtime.device()


def randn(*shape, dtype=torch.float32, scale=1.0):
    """Fresh random input on the kernels' device (no fixed seed: every run draws new inputs)."""
    return (torch.randn(*shape, dtype=torch.float32, device=DEVICE) * scale).to(dtype)


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request):
    return request.param
