"""Experiment (not a recorded benchmark): do the batch-1 step's projections read their weights as fast as a GEMV can?

    python benchmarks/experiments/decode_gemv_streaming.py [--out FILE]

decode_step_profile.py found the fused batch-1 step's largest projections reading their weights well under the copy
bandwidth (gate_up 3.4 TB/s on the Llama-3.2-1B shape, 2.2 on Qwen2.5-0.5B's; down 3.4 and 1.7), while the output
head, one long ops.gemv, reads 4.5. ops.decode_gemv gives each program one tile of rows and the grid one program per
tile: the loads in flight are those of the programs resident at once, and where K is wider than the tile a program
loads each K slice only after summing the one before. Timed here, each projection alone:

- ``ops.decode_gemv`` as the fused layer calls it (gate_up with SwiGLU, down adding into the residual stream);
- this file's kernel, a plain product over the same rows per program, one tile a program: the control (it should
  stream as the fused call does);
- the same kernel with a few programs per SM, each walking its tiles in turn and loading its next step's weights (the
  next K slice, or its next rows) before summing the ones it has: two steps' weights in flight per program;
- each of these with ``eviction_policy="evict_first"`` on the weights (read once: let them leave the caches first).

Each is a chain of launches, each of its own copy of the weights (together larger than the L2), captured in one CUDA
graph with programmatic dependent launch between them as in the engine's step: µs per launch against the weights'
bytes at the copy bandwidth. Every variant of this file's kernel is first checked against float64 products (a wrong
one is recorded, not timed). GPU only for the timing; tests/test_benchmarks.py runs the kernel in the interpreter.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import gpu_experiment  # noqa: E402

from lessonlib import ops  # noqa: E402  (before triton: it chooses the interpreter on a CPU)
from lessonlib.measure import time_graph  # noqa: E402
from lessonlib.ops._common import cdiv, gdc_launch_dependents, gdc_wait, pdl_options  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

decode_gemv = importlib.import_module("lessonlib.ops.decode_gemv")
# (rows N, K, how the fused layer calls it): the two largest projections of each shape
SHAPES = {"Llama-3.2-1B gate_up": (16384, 2048, "swiglu"), "Llama-3.2-1B down": (2048, 8192, "residual"),
          "Qwen2.5-0.5B gate_up": (9728, 896, "swiglu"), "Qwen2.5-0.5B down": (896, 4864, "residual")}
CHAIN_BYTES = 512 << 20  # each chain's weights together: ten times the H200's L2
PROGRAMS_PER_SM = (1, 2, 4)


@triton.jit
def _weights(w_ptr, pid, programs, step, steps, k_steps, N, K, stride_wn, ns, ks, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, EVICTION: tl.constexpr):
    """The weights of one step of a program: row tile ``pid + (step // k_steps) * programs``, K slice
    ``step % k_steps``; zeros past N, past K, and past the program's last step."""
    rows = (pid + (step // k_steps) * programs) * BLOCK_N + ns
    k0 = (step % k_steps) * BLOCK_K
    mask = (rows < tl.where(step < steps, N, 0))[:, None] & (k0 + ks < K)[None, :]  # (a scalar's & misleads the
    # interpreter: its mask turns to integers)
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + k0 + ks[None, :], mask=mask, other=0.0,
                   eviction_policy=EVICTION)


@triton.jit
def _streaming_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVICTION: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False):
    """y = W x for one row x. Program p of P takes row tiles p, p + P, ...; its steps run over (row tile, K slice).
    The first step's weights load before the wait; with PREFETCH each later step's load before the step before is
    summed, without it at the start of its own step (as ops.decode_gemv does)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    k_steps = tl.cdiv(K, BLOCK_K)
    steps = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, programs) * k_steps
    ns, ks = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    w = _weights(w_ptr, pid, programs, 0, steps, k_steps, N, K, stride_wn, ns, ks, BLOCK_N, BLOCK_K, EVICTION)
    if PDL:  # the weights depend on nothing a step writes; x may be the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for step in range(steps):
        if PREFETCH:
            following = _weights(w_ptr, pid, programs, step + 1, steps, k_steps, N, K, stride_wn, ns, ks, BLOCK_N,
                                 BLOCK_K, EVICTION)
        else:
            if step > 0:
                w = _weights(w_ptr, pid, programs, step, steps, k_steps, N, K, stride_wn, ns, ks, BLOCK_N, BLOCK_K,
                             EVICTION)
            following = w
        k0 = (step % k_steps) * BLOCK_K
        x = tl.load(x_ptr + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        rows = (pid + (step // k_steps) * programs) * BLOCK_N + ns
        last = step % k_steps == k_steps - 1
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rows < tl.where(last, N, 0))
        acc = tl.where(last, 0.0, acc)
        w = following


def streaming_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, programs: int | None, block_n: int,
                   block_k: int, warps: int, eviction: str = "", prefetch: bool = True) -> torch.Tensor:
    """out = w @ x (x: (K,), w: (N, K), rows contiguous; out: (N,)) on ``programs`` programs (None: one a tile)."""
    n, k = w.shape
    tiles = cdiv(n, block_n)
    grid = (tiles if programs is None else min(programs, tiles),)
    _streaming_gemv_kernel[grid](x, w, out, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, EVICTION=eviction,
                                 PREFETCH=prefetch, num_warps=warps, **pdl_options())
    return out


def relative_error(got: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> float:
    """‖got - t‖ / ‖t‖, t = w x in float64 rounded to got's dtype. A float32 sum and float64 round apart by at
    most one unit in an element: at most 2^-7 in bf16 (its spacing), ~1e-7 in float32; a kernel that read another
    tile's weights, or wrote nothing, is off by O(1)."""
    truth = (w.double() @ x.double()).to(got.dtype).float()
    return ((got.float() - truth).norm() / truth.norm()).item()


def engine_tile(n: int, k: int, how: str) -> tuple[int, int, int]:
    """(rows per program, BLOCK_K, warps) of the fused layer's call: decode_gemv's tile (a SwiGLU pair is two
    rows)."""
    epilogue = decode_gemv.SWIGLU if how == "swiglu" else decode_gemv.RESIDUAL
    meta = decode_gemv.config(n // 2 if how == "swiglu" else n, k, epilogue)
    rows = meta["BLOCK_N"] * (2 if how == "swiglu" else 1)
    return rows, meta["BLOCK_K"], meta["num_warps"]


def variants(n: int, k: int, how: str, sms: int) -> dict:
    """{name: (programs or None, rows per tile, BLOCK_K, warps, eviction, prefetch)} for this file's kernel: the
    control (decode_gemv's schedule), its next K slice loaded first (where K takes more than one), then programs
    walking their tiles."""
    rows, block_k, warps = engine_tile(n, k, how)
    found = {}
    for eviction in ("", "evict_first"):
        suffix = ", evict_first" if eviction else ""
        found[f"one tile a program{suffix}"] = (None, rows, block_k, warps, eviction, False)
        if k > block_k:
            found[f"one tile a program, next K slice loaded first{suffix}"] = (None, rows, block_k, warps, eviction,
                                                                               True)
        for per_sm in PROGRAMS_PER_SM:
            found[f"{per_sm} programs per SM, next step loaded first{suffix}"] = (
                per_sm * sms, rows, block_k, warps, eviction, True)
    return found


def run_shape(label: str, n: int, k: int, how: str, sms: int, bandwidth: float) -> list[dict]:
    """The fused layer's call and every variant, on a chain of launches of one shape: checked, then timed."""
    dtype = torch.bfloat16
    copies = max(4, cdiv(CHAIN_BYTES, n * k * 2))
    w = torch.randn(copies, n, k, device="cuda", dtype=dtype) / k ** 0.5
    x = torch.randn(k, device="cuda", dtype=dtype)
    out = torch.empty(copies, n, device="cuda", dtype=dtype)
    stream = torch.randn(1, n, device="cuda", dtype=dtype)
    limit_us = n * k * 2 / bandwidth * 1e6
    base = {"shape": label, "rows": n, "k": k, "launches": copies, "limit_us_per_launch": round(limit_us, 2)}

    def fused_call():
        for c in range(copies):
            if how == "swiglu":
                ops.decode_gemv(x[None, :], w[c], activation="swiglu")
            else:
                ops.decode_gemv(x[None, :], w[c], residual=stream)

    rows = [dict(base, impl="ops.decode_gemv (the fused layer's call)", **timed(fused_call, copies, limit_us))]
    for name, (programs, block_n, block_k, warps, eviction, prefetch) in variants(n, k, how, sms).items():
        def chain(launch=(programs, block_n, block_k, warps, eviction, prefetch)):
            for c in range(copies):
                streaming_gemv(x, w[c], out[c], *launch)
        row = dict(base, impl=name, programs=programs, block_n=block_n, block_k=block_k, warps=warps)
        with torch.inference_mode():
            out.fill_(float("nan"))
            chain()
            error = max(relative_error(out[c], w[c], x) for c in (0, copies - 1))
        row["relative_error"] = round(error, 6)
        if not error <= 2 ** -7:
            rows.append(dict(row, wrong=True))
            print(f"{label} {name}: WRONG, relative error {error:.3g}", flush=True)
            continue
        rows.append(dict(row, **timed(chain, copies, limit_us)))
    for row in rows:
        if "us_per_launch" in row:
            print(f"{label:22s} {row['impl']:52s} {row['us_per_launch']:7.2f} us a launch "
                  f"({row['fraction_of_limit']:.3f} of {limit_us:.2f})", flush=True)
    return rows


def timed(chain, copies: int, limit_us: float) -> dict:
    with torch.inference_mode():
        us = time_graph(chain).median_us / copies
    return {"us_per_launch": round(us, 2), "fraction_of_limit": round(limit_us / us, 3)}


def main():
    args, bandwidth = gpu_experiment.start(__doc__.split("\n\n")[0], "decode_gemv_streaming.py times on a GPU "
                                           "(tests/test_benchmarks.py runs its kernel in the interpreter)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for label, (n, k, how) in SHAPES.items():
        rows += run_shape(label, n, k, how, sms, bandwidth)
        torch.cuda.empty_cache()
    gpu_experiment.write_results(args.out, "python benchmarks/experiments/decode_gemv_streaming.py", bandwidth, rows,
                                 multiprocessors=sms)


if __name__ == "__main__":
    main()
