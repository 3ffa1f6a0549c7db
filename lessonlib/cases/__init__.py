"""Timed cases shared by the benchmarks (which record a GPU run) and the notebooks' "measure on this GPU" views
(which time the same case live beside the recorded one): one module per lesson, each yielding
:class:`lessonlib.bench.Case` (a float64 check first, then the peers timed by :class:`lessonlib.bench.Run`).
Lesson 07's (:mod:`lessonlib.cases.serving_engine`) runs the whole engine instead: the tokens/s ladder, the scheduler
under arriving requests, and the live ladder's check against transformers."""
