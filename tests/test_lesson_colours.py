"""One colour per implementation across a lesson: lessons 03 and 05 draw each implementation in the same colour in
their own plots and in the recorded-run view below them, and no two of a lesson's implementations share one (in
lesson 03 orange was FlexAttention's in section 7 and SDPA's in the view)."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from lessonlib import plots, results  # noqa: E402
from lessonlib.widgets.recorded import LESSONS  # noqa: E402


def view_colours(impls) -> dict[str, str]:
    """The colour the recorded-run view draws each implementation in, read off its bars (one value each, drawn in
    the reverse of the given order, so a colour picked by position would change)."""
    chosen = list(reversed(impls))
    fig = plots.recorded_vs_live({i: {"gbps": n + 1.0} for n, i in enumerate(chosen)}, None, ("gbps",), "case",
                                 "H200", "provenance")
    bars = fig.axes[0].patches
    colours = {i: to_hex(bar.get_facecolor()) for i, bar in zip(chosen, bars)}
    plt.close(fig)
    return colours


def legend_colours(fig) -> dict[str, str]:
    legend = fig.axes[0].get_legend()
    colours = {t.get_text(): to_hex(h.get_facecolor()) for t, h in zip(legend.get_texts(), legend.legend_handles)}
    plt.close(fig)
    return colours


@pytest.mark.parametrize("lesson, figure", [
    ("paged_attention", lambda: plots.paged_attention_speed(results.load("paged-attention-h200"))),
    ("cuda_graphs", lambda: plots.decode_step_times(results.load("cuda-graphs-h200"))),
])
def test_each_implementation_keeps_its_colour_between_the_lessons_plot_and_its_recorded_view(lesson, figure):
    view = view_colours(LESSONS[lesson].impls)
    assert len(set(view.values())) == len(view), f"two implementations share a colour: {view}"
    drawn = legend_colours(figure())
    assert drawn and all(view[impl] == colour for impl, colour in drawn.items() if impl in view), (drawn, view)
    assert set(drawn) <= set(view), f"drawn in the plot but not in the view: {set(drawn) - set(view)}"
