"""Lesson 02's launch-bound attention: naive attention's five kernels against one fused launch, at tiny T.

    python -m benchmarks.bench_attention_launches --out lessonlib/results/attention-launches-h200.json

The news item says merging the softmax and matrix-product kernels cuts kernel-launch overhead "by up to 70%". This
measures that mechanism: B=1, H=8, D=64, causal, T=16..1024, in the course's dtype; eager attention (matmul, scale,
mask, softmax, matmul) against lessonlib's flash_attention and SDPA's fused kernel, each checked against float64
first, its kernels counted (torch.profiler), timed per call back to back (launches included) and replayed from a
CUDA graph (the GPU's work alone). lessonlib.cases.attention_launches holds the cases and the claim's definition
(time cut = 1 - fused / eager). About a minute on an H200. ``--smoke`` runs tiny sizes in any mode.
"""

from __future__ import annotations

from lessonlib import bench
from lessonlib.cases import attention_launches as cases
from lessonlib.measure import gbps, time_copy, warm_up_gpu
from lessonlib.results import Benchmark


def main():
    args = bench.parse_args(__doc__, "bench_attention_launches.py")
    run = bench.Run(Benchmark.ATTENTION_LAUNCHES, smoke=args.smoke, check_only=args.check)
    warm_up_gpu()
    sizes = cases.SMOKE if args.smoke else dict(heads=cases.HEADS, head_dim=cases.HEAD_DIM, lengths=cases.LENGTHS)
    cases.measure(run, calls=5 if args.smoke else cases.CALLS, **sizes)
    run.notes["definition"] = "time cut by fusion = 1 - fused us / eager us, per call back to back"
    ceiling_bytes = 1 << (20 if args.smoke else 32)
    run.save(args.out, {"bandwidth_gbs": round(gbps(ceiling_bytes, time_copy(ceiling_bytes)), 1),
                        "matmul_tflops": None})


if __name__ == "__main__":
    main()
