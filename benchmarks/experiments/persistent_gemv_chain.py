"""Experiment (not a recorded benchmark): would one persistent kernel with grid barriers beat a kernel per GEMV?

    python benchmarks/experiments/persistent_gemv_chain.py [--out FILE]

Issue 27 asks for a persistent decode kernel "if the numbers ask for it": at batch 1 each of a layer's kernels costs a
few microseconds more than its bytes (decode_step_profile.py). A persistent kernel keeps one program per SM alive
for the whole chain and replaces each kernel boundary with a grid barrier (every program adds one to a counter in
global memory, then spins until the counter reaches the round's total). Before spinning, a program loads its first
weight tile of the next GEMV, which nothing in the chain writes (PDL's trick, across a barrier). A program owns
whole rows (its tile spans K), as decode_gemv's GPU tiles do at these widths.

Timed here on a chain of ``ROUNDS`` dependent square GEMVs, y_{r+1} = W_r y_r (each W_r its own matrix, the whole
chain larger than the L2, bf16), the hidden sizes of Llama-3.2-1B (2048: 8 MB per matrix, o_proj's) and
Qwen2.5-0.5B (896: 1.6 MB):

- ``ops.decode_gemv`` once per GEMV (with PDL where the GPU has it), the chain captured in one CUDA graph;
- one persistent kernel, grid = the SM count, a barrier between GEMVs, each program walking its rows' tiles in
  turn (BLOCK_N rows a tile);
- the same with more programs per SM and BLOCK_N such that each program owns one tile a round: the whole next matrix
  is loaded into registers while the barrier waits (run only where the compiled kernel's registers and shared
  memory let every program be resident at once: otherwise the barrier would wait forever);
- the barriers alone (``WORK=False``): the barrier's own cost.

Every variant is first checked round by round (:func:`worst_round_error`); a wrong one is recorded, not timed. GPU
only: the spin of the barrier would never end in the interpreter, which runs programs one at a time.

The committed results (session 21's first call) came from this script before the per-round check and the
one-tile-a-round variants: the check then compared the last vector with a float32 chain (2e-2), and the variants
were the first three and the barriers.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import gpu_experiment  # noqa: E402

from lessonlib import ops  # noqa: E402  (before triton: it chooses the interpreter on a CPU)
from lessonlib.measure import time_graph  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROUNDS = 64
HIDDEN = {"Llama-3.2-1B (2048)": 2048, "Qwen2.5-0.5B (896)": 896}


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Every program of the grid reaches this point before any goes on: each adds one to the counter (release:
    its stores are visible first), then spins until the counter holds ``target`` (acquire)."""
    tl.debug_barrier()  # every thread of this program has stored its part
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _persistent_chain_kernel(w_ptr, y_ptr, counter_ptr, rounds, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             WORK: tl.constexpr):
    """Round r: y[r + 1] = W_r @ y[r], rows in BLOCK_N blocks dealt out to the programs in turn, a grid barrier
    between rounds; before the barrier each program loads its first tile of W_{r+1}. W: (rounds, K, K) contiguous;
    y: (rounds + 1, K), y[0] the input. WORK=False: the barriers alone."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    ks = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_N)
    k_ok = ks < K
    turns = tl.cdiv(tl.cdiv(K, BLOCK_N), programs)  # blocks per program, the last turn partly empty
    n = pid * BLOCK_N + rows
    first = tl.load(w_ptr + n[:, None] * K + ks[None, :], mask=(n[:, None] < K) & k_ok[None, :], other=0.0)
    for r in range(rounds):
        if WORK:
            v = tl.load(y_ptr + r * K + ks, mask=k_ok, other=0.0, cache_modifier=".cg").to(tl.float32)  # from L2
            w_round = w_ptr + r * K * K  # int64 on a GPU past 2**31 elements: not at these sizes
            for turn in range(turns):
                n = (pid + turn * programs) * BLOCK_N + rows
                if turn == 0:
                    w = first
                else:
                    w = tl.load(w_round + n[:, None] * K + ks[None, :], mask=(n[:, None] < K) & k_ok[None, :],
                                other=0.0)
                acc = tl.sum(w.to(tl.float32) * v[None, :], axis=1)
                tl.store(y_ptr + (r + 1) * K + n, acc.to(y_ptr.dtype.element_ty), mask=n < K)
            if r + 1 < rounds:  # the next round's first tile: nothing in the chain writes weights
                n = pid * BLOCK_N + rows
                first = tl.load(w_round + K * K + n[:, None] * K + ks[None, :],
                                mask=(n[:, None] < K) & k_ok[None, :], other=0.0)
        _grid_barrier(counter_ptr, (r + 1) * programs)


def resident_per_sm(registers: int, shared: int, warps: int) -> int:
    """How many programs of a kernel one SM holds at once, by registers (allocated per warp in units of 256),
    threads, shared memory and the 32-block limit (compute capability 9.0's figures, read from the device where
    torch gives them)."""
    props = torch.cuda.get_device_properties(0)
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * warps)
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    by_shared = (getattr(props, "shared_memory_per_multiprocessor", 233472) // shared) if shared else 32
    return min(by_registers, by_threads, by_shared, 32)


def worst_round_error(w: torch.Tensor, vectors: torch.Tensor) -> float:
    """The largest relative error (2-norm) of any round's output against float64 products of that round's own input,
    rounded to the vectors' dtype: a correct kernel's float32 sum moves some bf16 roundings by one unit (at most 2^-7
    of the element: a relative norm error at most 2^-7 even if every element moved); a round that read another round's
    vector, or a half-written one, is off by O(1)."""
    truth = torch.einsum("rnk,rk->rn", w.double(), vectors[:-1].double()).to(vectors.dtype).float()
    return ((vectors[1:].float() - truth).norm(dim=1) / truth.norm(dim=1)).max().item()


def run_hidden(label: str, k: int, sms: int, bandwidth: float) -> list[dict]:
    """Every variant on a chain of ROUNDS k x k GEMVs: checked, then timed (a wrong or unrunnable one recorded)."""
    dtype, rows = torch.bfloat16, []
    w = torch.randn(ROUNDS, k, k, device="cuda", dtype=dtype) / k ** 0.5
    x = torch.randn(k, device="cuda", dtype=dtype)
    limit_us = w.numel() * w.element_size() / bandwidth * 1e6

    def per_gemv():
        vectors = [x[None, :]]
        for r in range(ROUNDS):
            vectors.append(ops.decode_gemv(vectors[-1], w[r]))
        return torch.cat(vectors)

    y = torch.empty(ROUNDS + 1, k, device="cuda", dtype=dtype)
    y[0] = x
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)

    def persistent(block_n, warps, per_sm=1, work=True):
        grid = (sms * per_sm,)
        meta = dict(BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(k), WORK=work, num_warps=warps)

        def run():
            counter.zero_()
            _persistent_chain_kernel[grid](w, y, counter, ROUNDS, k, **meta)
            return y
        if per_sm > 1:  # every program must be resident at once, or the barrier waits forever
            compiled = _persistent_chain_kernel.warmup(w, y, counter, ROUNDS, k, grid=grid, **meta)
            compiled._init_handles()  # loads the binary: n_regs is known from then on
            resident = resident_per_sm(compiled.n_regs, compiled.metadata.shared, warps)
            if resident < per_sm:
                raise RuntimeError(f"{per_sm} programs per SM asked, {resident} fit ({compiled.n_regs} "
                                   f"registers a thread, {compiled.metadata.shared} B of shared memory): not run")
        return run

    variants = {"ops.decode_gemv per GEMV (CUDA graph)": per_gemv}
    for block_n, warps in ((4, 4), (8, 8), (2, 4)):
        variants[f"persistent, BLOCK_N={block_n}, {warps} warps"] = lambda b=block_n, n=warps: persistent(b, n)
    # Programs enough that each owns one tile a round, the next round's tile loaded before the barrier: the
    # whole matrix in flight while the barrier waits (Llama's 8 MB fits the H200's 33 MB of registers).
    for block_n, warps, per_sm in ((8, 8, 2), (8, 4, 2), (4, 4, 2), (4, 4, 4)):
        variants[f"persistent, BLOCK_N={block_n}, {warps} warps, {per_sm} programs per SM"] = \
            lambda b=block_n, n=warps, m=per_sm: persistent(b, n, m)
    barriers_only = persistent(4, 4, work=False)
    for name, make in variants.items():
        with torch.inference_mode():
            try:
                run = make() if name.startswith("persistent") else make
                vectors = run()
                torch.cuda.synchronize()
            except Exception as error:  # a compile error, or too few resident: recorded, the others still timed
                rows.append({"hidden": label, "impl": name, "error": f"{type(error).__name__}: {error}"[:2000]})
                print(f"{label} {name}: {type(error).__name__}: {str(error)[:300]}", flush=True)
                continue
            error = worst_round_error(w, vectors)
            row = {"hidden": label, "impl": name, "rounds": ROUNDS, "worst_round_error": round(error, 5)}
            if not error <= 2 ** -7:
                row["wrong"] = True
                print(f"{label} {name}: WRONG, relative error {error:.3g}", flush=True)
                rows.append(row)
                continue
            us = time_graph(run).median_us
        row.update({"us": round(us, 1), "us_per_gemv": round(us / ROUNDS, 2), "limit_us": round(limit_us, 1),
                    "fraction_of_limit": round(limit_us / us, 3)})
        rows.append(row)
        print(f"{label} {name}: {us:.1f} us ({us / ROUNDS:.2f} per GEMV), limit {limit_us:.1f} us "
              f"({limit_us / us:.3f}), error {error:.2g}", flush=True)
    us = time_graph(barriers_only).median_us
    rows.append({"hidden": label, "impl": f"{ROUNDS} grid barriers alone, {sms} programs", "us": round(us, 1),
                 "us_per_barrier": round(us / ROUNDS, 2)})
    print(f"{label} barriers alone: {us:.1f} us ({us / ROUNDS:.2f} per barrier)", flush=True)
    return rows


def main():
    args, bandwidth = gpu_experiment.start(__doc__.split("\n\n")[0],
                                           "persistent_gemv_chain.py spins on grid barriers: it needs a GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for label, k in HIDDEN.items():
        rows += run_hidden(label, k, sms, bandwidth)
        torch.cuda.empty_cache()
    gpu_experiment.write_results(args.out, "python benchmarks/experiments/persistent_gemv_chain.py", bandwidth, rows,
                                 multiprocessors=sms)


if __name__ == "__main__":
    main()
