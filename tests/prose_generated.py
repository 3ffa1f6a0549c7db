"""The figures in what lessonlib shows a student (legends, titles, tables, checker messages, hints, printed
verdicts), each with what makes it true: the same kinds as the notebooks' markdown (tests/prose_figures.py), with
the module's path in place of the notebook and no cell. A figure that code formats from the data needs no entry."""

from __future__ import annotations

from tests.prose_figures import Given, Holds, Measured  # noqa: F401  (the kinds entries use)

GENERATED = ()
