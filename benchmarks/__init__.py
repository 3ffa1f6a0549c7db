"""The course's GPU benchmarks (one per lesson, each writing ``lessonlib/results/<name>-h200.json``) and, in
``benchmarks/experiments``, the experiments behind its standing choices. Run from the repository's root as modules:
``python -m benchmarks.bench_fusion --out lessonlib/results/fusion-h200.json``. What each measures and what it found:
``benchmarks/README.md``; the choices they decided: ``benchmarks/decisions/``."""
