"""Experiments: measurements that decided a standing choice of the course (``benchmarks/decisions/``) rather than a
figure a lesson plots. One row each in ``benchmarks/experiments/README.md``; run as modules from the repository's
root: ``python -m benchmarks.experiments.rope_layout --out FILE``."""
