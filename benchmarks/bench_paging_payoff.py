"""Paging's payoff (the vLLM paper's result): the largest batch that fits in the same KV memory with contiguous slabs
against paged blocks, and the decode tokens/s the engine reaches at each.

    python -m benchmarks.bench_paging_payoff --out lessonlib/results/paging-payoff-h200.json

The random-weight Llama-3.2-1B-shaped model of bench_engine.py, bf16. A KV pool of 16 slabs of 2,048 tokens (1 GiB);
requests with lesson 03's spread of lengths (median 300 tokens), each generating 32 tokens. Slabs fit 16 sequences;
blocks fit the first requests whose blocks add up to the pool. Each batch runs on the engine (CUDA graphs,
continuous batching, the same pool, max_num_seqs = the batch) after a warm-up, REPEATS times: decode tokens/s from
the engine's step log, the median run's with the slowest and fastest. lessonlib.cases.paging_payoff holds the
workload and the measurement. About a minute and a half on an H200, most of it building the checkpoint.
``--smoke`` runs a tiny model in any mode (4 slabs of 64 tokens).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path


import torch

from lessonlib.cases.engine_models import LLAMA_1B, TINY, build_checkpoint
from lessonlib import bench, runtime
from lessonlib.cases import paging_payoff
from lessonlib.measure import warm_up_gpu
from lessonlib.results import Benchmark

REPEATS, SMOKE_REPEATS = 5, 2


def main():
    args = bench.parse_args(__doc__, "bench_paging_payoff.py")
    run = bench.Run(Benchmark.PAGING_PAYOFF, smoke=args.smoke, check_only=args.check,
                    dtype=runtime.dtype(cpu=torch.float32))
    started = time.perf_counter()
    warm_up_gpu()
    folder = Path(tempfile.mkdtemp(prefix="bench-paging-", dir=runtime.scratch_dir()))
    try:
        path = build_checkpoint(folder, TINY if args.smoke else LLAMA_1B, run.dtype)
        sizes = paging_payoff.SMOKE if args.smoke else paging_payoff.FULL
        paging_payoff.measure(run, path, sizes, SMOKE_REPEATS if args.smoke else REPEATS)
        run.notes["model"] = {"shape": TINY if args.smoke else LLAMA_1B, "weights": "random (torch.manual_seed(0))"}
        run.notes["seconds"] = round(time.perf_counter() - started, 1)
        run.save(args.out, {})
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
