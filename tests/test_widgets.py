"""Interactive views: driving one from code returns the result at the values asked for, and leaves the view's
controls and its figure in agreement (notebook 03 once showed a slider at 32,768 beside a plot of 4,096)."""

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

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


def test_recorded_vs_live_shows_the_recorded_run_and_measures_only_on_a_gpu(capsys):
    from lessonlib import measured, results

    recorded = results.load("fusion-h200")
    view = widgets.recorded_vs_live_explorer(recorded)
    for case, (op, shape) in measured.cases(recorded).items():
        got = widgets.drive(view, case=case, measure_here=True)
        plt.close("all")
        want = {r["impl"]: r["gbps"] for r in recorded.select(op=op, **shape)
                if r["impl"] in measured.IMPLS and "regime" not in r and not r.get("sweep")}
        assert got["recorded"] == want and set(want) == set(measured.IMPLS), case
        assert got["live"] is None  # no GPU here: nothing measured, and the view says why
    with pytest.raises(RuntimeError, match="needs a GPU"):
        measured.live_gbps(op, shape)


@pytest.mark.parametrize("op, shape", [("swiglu", {"T": 5, "I": 48}), ("add_rms_norm", {"T": 3, "H": 40}),
                                       ("apply_rope", {"B": 1, "H": 4, "Hkv": 2, "T": 7, "D": 16})])
def test_live_gbps_checks_then_times_each_implementation(monkeypatch, op, shape):
    """The GPU path, run in the interpreter: lessonlib's output is checked against float64 first, then each
    implementation is timed (a stand-in timer here), with a copy of the same bytes, and turned into GB/s of the
    fused kernel's bytes."""
    import torch

    from lessonlib import measure, measured, runtime
    from lessonlib.results import Impl

    timed = []
    monkeypatch.setattr(runtime, "on_gpu", lambda: True)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # Inductor's CPU build is not what is tested
    monkeypatch.setattr(measure, "time_fn", lambda fn, *args: timed.append(fn) or measure.Timing(2.0, True))
    got = measured.live_gbps(op, shape)
    nbytes = measured._fused_bytes(op, shape, torch.finfo(runtime.dtype()).bits // 8)
    assert got == {impl: nbytes / 2e-6 / 1e9 for impl in (*measured.IMPLS, Impl.COPY)} and len(timed) == 4
