"""Lesson 04's checker (notebook 04_torch_compile): a function torch.compile captures without a graph break.
"""

from __future__ import annotations

import torch

from lessonlib.exercises._checking import ExerciseFailed, passed


def check_no_graph_break(fn) -> None:
    """``fn(x)`` must compute ``x / max|x| * 2`` (as ``scale_by_max`` in notebook 04 does) with no graph break:
    torch._dynamo.explain must find one graph, and the compiled result must match the eager one."""
    from lessonlib.compiler import graph_breaks

    for shape in ((7,), (4, 33), (2, 3, 5)):
        x = torch.randn(shape, dtype=torch.float32) * 3
        want = x / x.abs().max() * 2.0
        try:
            breaks = graph_breaks(fn, x)
            got = torch.compile(fn, fullgraph=True)(x)
        except NotImplementedError as e:
            raise ExerciseFailed(f"no_graph_break: not implemented yet ({str(e) or 'NotImplementedError'}). Fill in the stub.") from None
        except Exception as e:  # fullgraph=True raises on the first graph break
            raise ExerciseFailed(f"no_graph_break: torch.compile(fullgraph=True) failed: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:300]}") from None
        if breaks:
            raise ExerciseFailed(f"no_graph_break: still {len(breaks)} graph break(s): {breaks[0].reason} at {breaks[0].where}")
        torch.testing.assert_close(got, want)
    passed("no_graph_break: one graph, no break, same result as eager on 3 shapes")
