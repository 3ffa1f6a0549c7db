import torch

from lessonlib import ops, reference
from lessonlib.testing import check_close, gated_mlp_magnitude, to_float64
from tests.conftest import DEVICE, randn


def test_fused_gated_mlp_matches_reference(dtype):
    mlp = reference.GatedMLP(48, 80, device=DEVICE, dtype=dtype)
    x = randn(3, 5, 48, dtype=dtype)
    with torch.no_grad():
        fused = ops.FusedGatedMLP(mlp)(x)
        low = mlp(x)
        truth = reference.GatedMLP(48, 80, device=DEVICE, dtype=torch.float64)
        truth.load_state_dict({k: v.double() for k, v in mlp.state_dict().items()})
        (x64,) = to_float64(x)
        check_close("FusedGatedMLP", fused, truth(x64), low, gated_mlp_magnitude(truth, x64))
