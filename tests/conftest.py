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


def with_random_biases(path):
    """Draw every Linear bias of the checkpoint in ``path`` afresh (in place; returns ``path``). transformers
    initialises biases to zero, so a tiny checkpoint as built tests no bias at all: an engine that dropped q/k/v's
    bias, added it after RoPE or loaded q's into k would pass. A real Qwen2's q and k biases are large: they are
    drawn of the size of the products' outputs."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    biases = [key for key in tensors if key.endswith(".bias")]
    assert biases, f"{path.name} has no bias to draw"
    tensors.update((key, 2 * torch.randn_like(tensors[key])) for key in biases)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path
