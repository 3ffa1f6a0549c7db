"""One long prompt arriving among running decodes, prefill-first against chunked prefill (lesson 07): each step's
wall time and which requests' tokens came out of it; TTFT and the decodes' inter-token gaps.

    python -m benchmarks.bench_chunked_prefill --out lessonlib/results/chunked-prefill-h200.json
    python -m benchmarks.bench_chunked_prefill --smoke --out lessonlib/results/chunked-prefill-cpu.json

The GPU run: the random-weight Llama-3.2-1B-shaped model of bench_engine.py (its positions raised to hold twice the
long prompt), bf16, every feature on but the one compared: issue 26's case, one 4,096-token prompt among 32 running
decodes (planned to take at most 90 s on the H200, Triton's compilations included). The notes record issue 26's
target, computed from the run (``chunked_prefill.itl_target``). ``--smoke`` on the CPU: a small random Llama
(lessonlib.cases.chunked_prefill.CPU_MODEL), float32, the plain-PyTorch features (no Triton interpreter); on a GPU:
the tiny model. lessonlib.cases.chunked_prefill holds the workload and the measurement.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path


import torch

from lessonlib.cases.engine_models import LLAMA_1B, TINY, build_checkpoint
from lessonlib import bench, runtime
from lessonlib.cases import chunked_prefill
from lessonlib.engine import Features
from lessonlib.engine.features import PLAIN_PYTORCH
from lessonlib.measure import warm_up_gpu
from lessonlib.results import Benchmark, Results


def main():
    args = bench.parse_args(__doc__, "bench_chunked_prefill.py")
    run = bench.Run(Benchmark.CHUNKED_PREFILL, smoke=args.smoke, check_only=args.check,
                    dtype=runtime.dtype(cpu=torch.float32))
    started = time.perf_counter()
    warm_up_gpu()
    gpu = runtime.on_gpu()
    if not gpu:
        torch.set_num_threads(1)  # steady step times on a shared CPU (two threads under load: 20x slower steps)
    sizes = chunked_prefill.SMOKE if args.smoke else chunked_prefill.FULL
    shape = (TINY if args.smoke else LLAMA_1B) if gpu else chunked_prefill.CPU_MODEL
    shape = {**shape, "max_position_embeddings": max(2048, 2 * sizes["prompt"])}  # the engine's max_model_len
    features = Features() if gpu else replace(PLAIN_PYTORCH, continuous_batching=True)
    folder = Path(tempfile.mkdtemp(prefix="bench-chunked-", dir=runtime.scratch_dir()))
    run.notes["model"] = {"shape": shape, "weights": "random (torch.manual_seed(0))"}
    run.notes["features"] = {k: v for k, v in vars(features).items() if k != "chunked_prefill"}
    run.notes["sizes"] = sizes
    try:
        path = build_checkpoint(folder, shape, run.dtype)
        chunked_prefill.measure(run, path, sizes, features, shape["vocab_size"])
    finally:  # an interrupt (timeout -s INT) still writes the mode measured so far
        shutil.rmtree(folder, ignore_errors=True)
        run.notes["target"] = chunked_prefill.itl_target(Results(run.benchmark, "", {}, {}, run.records, {}))
        print("issue 26's chunked-prefill target:", run.notes["target"], flush=True)
        run.notes["seconds"] = round(time.perf_counter() - started, 1)
        run.save(args.out, {})


if __name__ == "__main__":
    main()
