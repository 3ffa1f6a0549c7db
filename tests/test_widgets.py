"""Interactive views: driving one from code returns the result at the values asked for, and leaves the view's
controls and its figure in agreement (notebook 03 once showed a slider at 32,768 beside a plot of 4,096)."""

import matplotlib
import pytest

matplotlib.use("Agg")

from lessonlib import kv_memory, widgets  # noqa: E402


def test_drive_returns_the_result_there_and_leaves_the_view_as_it_was():
    view = widgets.kv_reservation_explorer(kv_memory.request_lengths(n=64, median=600, max_len=4096))
    shown = {name: control.value for name, control in view.controls.items()}
    shown_result = dict(view.result)
    driven = widgets.drive(view, block_size=256, max_len=32768)
    assert driven != shown_result  # the values asked for were really computed
    assert widgets.drive(view, block_size=256, max_len=32768) == driven  # and are a function of them
    assert {name: control.value for name, control in view.controls.items()} == shown
    assert view.result == shown_result  # the figure on screen is the one its controls describe


def test_drive_refuses_unknown_controls():
    view = widgets.kv_reservation_explorer(kv_memory.request_lengths(n=8, median=600, max_len=4096))
    with pytest.raises(ValueError, match="no control named"):
        widgets.drive(view, blocksize=16)
