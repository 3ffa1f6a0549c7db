"""FusedGatedMLP: the reference GatedMLP with its two fusions applied.

1. gate_proj and up_proj read the same x: stacking their weights makes one (H, 2I) GEMM instead of two, so x is
   read once and one launch replaces two.
2. silu(gate) * up runs as one kernel (``swiglu``) directly on the two strided halves of that GEMM's output.
"""

from __future__ import annotations

import torch
from torch import nn

from lessonlib.ops.swiglu import swiglu
from lessonlib.reference import GatedMLP


class FusedGatedMLP(nn.Module):
    def __init__(self, mlp: GatedMLP):
        super().__init__()
        # (2I, H): gate rows, then up rows
        weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)
        self.gate_up_proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                      device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.gate_up_proj.weight.copy_(weight)
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # two (..., I) views, rows 2I apart: no copy
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(swiglu(gate, up))
