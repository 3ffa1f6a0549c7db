"""Experiment (not a recorded benchmark): why is torch.compile's RoPE faster than lessonlib's at T=8192?

    python -m benchmarks.experiments.rope_layout [--out FILE]

lessonlib's apply_rope runs one program per (batch row, token), which rotates every head of that token. In the
(B, H, T, D) layout that lesson 01 times, a token's heads lie T * D elements apart (2 MB at T=8192, D=128 in bf16):
each program reads 40 rows of 256 bytes from 40 places far apart. torch.compile's kernel walks the tensors in memory
order instead. The hypothesis: the gap is the access pattern, not the arithmetic. The test: the same calls on
token-major tensors ((B, T, H, D) in memory, passed as the same (B, H, T, D) view), where a token's heads are
contiguous, against torch.compile in both layouts and a copy of the same bytes. Every output checked against
float64 before timing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


import torch

from lessonlib import ops, reference, runtime
from lessonlib.measure import time_copy, time_fn, warm_up_gpu
from lessonlib.testing import check_close, to_float64


def tensors(layout, batch, heads, kv_heads, tokens, dim, dtype):
    def make(h):
        if layout == "head-major":
            return torch.randn(batch, h, tokens, dim, device=runtime.device(), dtype=dtype)
        return torch.randn(batch, tokens, h, dim, device=runtime.device(), dtype=dtype).transpose(1, 2)
    cos, sin = reference.rope_cos_sin(torch.arange(tokens, device=runtime.device()), dim, 10000.0, dtype=dtype)
    return make(heads), make(kv_heads), cos, sin


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    smoke = args.smoke or not runtime.on_gpu()
    batch, heads, kv_heads, dim = 1, 32, 8, 128
    tokens = 16 if smoke else 8192
    dtype = runtime.dtype(cpu=torch.float32)
    warm_up_gpu()
    compiled = torch.compile(reference.apply_rope) if runtime.on_gpu() else None
    nbytes = 2 * batch * (heads + kv_heads) * tokens * dim * dtype.itemsize  # q, k read and written
    rows = []
    for layout in ("head-major", "token-major"):
        q, k, cos, sin = tensors(layout, batch, heads, kv_heads, tokens, dim, dtype)
        truth = reference.apply_rope(*to_float64(q, k, cos, sin))
        low = reference.apply_rope(q, k, cos, sin)
        peers = {"lessonlib": lambda: ops.apply_rope(q, k, cos, sin)}
        if compiled is not None:
            peers["torch.compile"] = lambda: compiled(q, k, cos, sin)
        for name, fn in peers.items():
            for got, want, lo in zip(fn(), truth, low):
                check_close(f"apply_rope {name} {layout}", got, want, lo)
            us = time_fn(fn).median_us
            rows.append({"layout": layout, "impl": name, "us": us, "gbps": nbytes / us / 1e3})
            print(f"{layout:12} {name:14} {us:8.1f} us {nbytes / us / 1e3:8.0f} GB/s", flush=True)
    us = time_copy(nbytes).median_us
    rows.append({"layout": "-", "impl": "copy (same bytes)", "us": us, "gbps": nbytes / us / 1e3})
    print(f"copy of the same bytes       {us:8.1f} us {nbytes / us / 1e3:8.0f} GB/s")
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name() if runtime.on_gpu() else "cpu", "torch": torch.__version__,
                "shape": {"B": batch, "H": heads, "Hkv": kv_heads, "T": tokens, "D": dim, "dtype": str(dtype)}}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
