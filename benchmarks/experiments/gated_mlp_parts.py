"""Experiment (not a recorded benchmark): where does the fused GatedMLP's elementwise saving go?

    python -m benchmarks.experiments.gated_mlp_parts [--out FILE] [--smoke]

In lesson 01's recorded run, eager's silu·mul is about 15% of eager's whole GatedMLP at T=128-8192 and the fused
swiglu kernel does that part in a quarter to two fifths of the time, yet lessonlib's FusedGatedMLP is no faster
than eager at T=8192. FusedGatedMLP changes two things: silu·mul runs as one kernel on the two strided halves of
one (2I, H) GEMM's output, and that one GEMM replaces the two (I, H) GEMMs. The hypothesis: the stacked GEMM, or
swiglu on its strided halves, costs what the fusion saves. The test: each part timed alone at the lesson's sizes
(two GEMMs, the stacked GEMM, silu·mul eager, swiglu on contiguous and on strided inputs, the down GEMM), beside
the two whole MLPs, every output checked against float64 first. Without a GPU it runs at tiny sizes in Triton's
interpreter and only checks (its times are not performance).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


import torch
import torch.nn.functional as F

from lessonlib import ops, reference, runtime
from lessonlib.measure import time_fn, warm_up_gpu
from lessonlib.testing import check_close


def parts(mlp: reference.GatedMLP, fused: ops.FusedGatedMLP, x: torch.Tensor) -> dict:
    """Each part of the two MLPs as a call of no arguments, its inputs made once (outside the timing)."""
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    halves = fused.gate_up_proj(x).chunk(2, dim=-1)  # strided views, as FusedGatedMLP passes them
    hidden = F.silu(gate) * up
    return {
        "two GEMMs (gate, up)": lambda: (mlp.gate_proj(x), mlp.up_proj(x)),
        "one stacked GEMM (gate_up)": lambda: fused.gate_up_proj(x),
        "eager silu·mul (contiguous)": lambda: F.silu(gate) * up,
        "swiglu (contiguous)": lambda: ops.swiglu(gate, up),
        "swiglu (strided halves)": lambda: ops.swiglu(*halves),
        "down GEMM": lambda: mlp.down_proj(hidden),
        "whole eager GatedMLP": lambda: mlp(x),
        "whole FusedGatedMLP": lambda: fused(x),
    }


def check(mlp, fused, x):
    """Both MLPs and swiglu on the strided halves against float64, before anything is timed."""
    truth = reference.GatedMLP(x.shape[-1], mlp.down_proj.in_features, device=x.device, dtype=torch.float64)
    truth.load_state_dict({k: v.double() for k, v in mlp.state_dict().items()})
    low = mlp(x)
    check_close("FusedGatedMLP", fused(x), truth(x.double()), low)
    gate, up = fused.gate_up_proj(x).chunk(2, dim=-1)
    check_close("swiglu on strided halves", ops.swiglu(gate, up), reference.swiglu(gate.double(), up.double()),
                reference.swiglu(gate, up))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    smoke = args.smoke or not runtime.on_gpu()
    hidden, intermediate = (64, 128) if smoke else (4096, 14336)
    dtype = runtime.dtype(cpu=torch.float32)
    warm_up_gpu()
    rows = []
    with torch.no_grad():
        mlp = reference.GatedMLP(hidden, intermediate, device=runtime.device(), dtype=dtype)
        fused = ops.FusedGatedMLP(mlp)
        for tokens in (16,) if smoke else (128, 2048, 8192):
            x = torch.randn(tokens, hidden, device=runtime.device(), dtype=dtype)
            check(mlp, fused, x)
            for name, fn in parts(mlp, fused, x).items():
                us = time_fn(fn).median_us
                rows.append({"T": tokens, "part": name, "us": us})
                print(f"T={tokens:5d} {name:30s} {us:9.1f} us", flush=True)
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name() if runtime.on_gpu() else "cpu", "torch": torch.__version__,
                "shape": {"H": hidden, "I": intermediate, "dtype": str(dtype)}}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
