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


PNG = b"\x89PNG\r\n\x1a\n"


def _bars(height=1, fail_at=None):
    """A view function of the kind lessons write: prints, draws (ending in the habitual plt.show()), returns."""
    if height == fail_at:
        raise ValueError(f"no bar of height {height}")
    print(f"one bar of height {height}")
    plt.bar(["a"], [height])
    plt.show()
    return {"height": height}


def _bars_view(fail_at=None):
    import ipywidgets as w

    from lessonlib.widgets.view import FigureView

    return FigureView(_bars, {"height": w.IntSlider(value=1, min=1, max=9)}, {"fail_at": fail_at})


def test_a_view_holds_its_text_and_figure_as_widget_state_and_redraws_when_a_control_moves():
    """The text and the PNG are the view's own widgets (not cell output a front end may misroute), and a
    plt.show() inside the function draws into the view."""
    plt.figure()  # a figure some earlier cell left open and current: the view must not draw into it
    figures_before = plt.get_fignums()
    view = _bars_view()
    first = view.figure.value
    assert "one bar of height 1" in view.text.value and bytes(first).startswith(PNG) and view.result == {"height": 1}
    view.controls["height"].value = 7
    assert "one bar of height 7" in view.text.value and view.result == {"height": 7}
    assert bytes(view.figure.value).startswith(PNG) and bytes(view.figure.value) != bytes(first)
    assert plt.get_fignums() == figures_before and not plt.gcf().axes  # each drawn figure closed once a PNG
    plt.close("all")


def test_drive_runs_the_function_once_there_draws_nothing_until_back_and_raises_its_errors():
    view = _bars_view(fail_at=6)
    shown_text, shown_png = view.text.value, bytes(view.figure.value)
    runs, changes = [], []
    real_fn = view.fn
    view.fn = lambda **kw: runs.append(kw["height"]) or real_fn(**kw)
    view.text.observe(changes.append, names="value")
    view.figure.observe(changes.append, names="value")
    assert widgets.drive(view, height=5) == {"height": 5}
    assert runs == [5, 1]  # once at the driven value, once to redraw where the controls are back
    assert changes == []  # the screen never showed height 5 (the redraw at 1 equals what was shown)
    assert (view.text.value, bytes(view.figure.value)) == (shown_text, shown_png)
    with pytest.raises(ValueError, match="no bar of height 6"):
        widgets.drive(view, height=6)
    assert view.controls["height"].value == 1 and view.result == {"height": 1}


def test_a_redraw_that_fails_shows_its_traceback_in_the_view_and_the_next_one_recovers():
    view = _bars_view(fail_at=3)
    view.controls["height"].value = 3
    assert "Traceback" in view.text.value and "no bar of height 3" in view.text.value
    assert view.result is None and view.figure.layout.display == "none"
    view.controls["height"].value = 4
    assert "Traceback" not in view.text.value and view.result == {"height": 4} and view.figure.layout.display is None


def test_a_view_whose_first_draw_fails_raises_in_its_cell():
    with pytest.raises(ValueError, match="no bar of height 1"):
        _bars_view(fail_at=1)


def test_recorded_vs_live_shows_the_recorded_run_and_measures_only_on_a_gpu(capsys):
    """Every case shows the recorded run; ticking "measure here" measures on a GPU (each implementation and the copy
    ceiling, in GB/s) and, without one, measures nothing and says why."""
    from lessonlib import measured, results, runtime
    from lessonlib.results import Impl

    recorded = results.load("fusion-h200")
    view = widgets.recorded_vs_live_explorer(recorded)
    for case, (op, shape) in measured.cases(recorded).items():
        got = widgets.drive(view, case=case, measure_here=True)
        plt.close("all")
        want = {r["impl"]: r["gbps"] for r in recorded.select(op=op, **shape)
                if r["impl"] in measured.IMPLS and "regime" not in r and not r.get("sweep")}
        assert got["recorded"] == want and set(want) == set(measured.IMPLS), case
        if runtime.on_gpu():
            assert set(got["live"]) == {*measured.IMPLS, Impl.COPY}, (case, got["live"])
            assert all(gbps > 0 for gbps in got["live"].values()), (case, got["live"])
        else:
            assert got["live"] is None  # no GPU here: nothing measured, and the view says why
    if not runtime.on_gpu():
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


@pytest.mark.parametrize("lesson", sorted(widgets.LESSONS))
def test_recorded_run_views_show_the_committed_run_for_the_case_and_implementations_chosen(lesson):
    """Lessons 02-05: each case shows the recorded file's numbers for the implementations ticked; "measure here"
    times the case on a GPU and shows only the implementations ticked, and on CPU says why nothing was measured."""
    from lessonlib import results, runtime

    spec = widgets.LESSONS[lesson]
    recorded = results.load(spec.name)
    view = widgets.recorded_run_explorer(lesson, recorded)
    cases = spec.cases(recorded)
    assert len(cases) >= 2 and list(view.controls["case"].options) == list(cases)
    first, last = list(cases)[0], list(cases)[-1]
    shown = {case: widgets.drive(view, case=case) for case in (first, last)}
    plt.close("all")
    assert shown[first] != shown[last]
    for case, got in shown.items():
        op, shape = cases[case]
        assert (got["op"], got["shape"]) == (op, shape) and got["live"] is None
        records = {r["impl"]: r for r in recorded.select(op=op, **shape) if spec.shown(r)}
        assert set(got["recorded"]) == set(records) and records
        for impl, values in got["recorded"].items():
            for field in spec.fields:
                want = (records[spec.baseline]["us"] / records[impl]["us"] if field == "speedup"
                        else records[impl].get(field))
                assert values[field] == pytest.approx(want), (case, impl, field)
    one = view.controls["impls"].options[0]
    narrowed = widgets.drive(view, case=first, impls=(one,), measure_here=True)
    plt.close("all")
    assert set(narrowed["recorded"]) == {one}
    if runtime.on_gpu():
        assert narrowed["skipped"] is None and set(narrowed["live"]) == {one}, narrowed
        assert all(v is not None and v > 0 for v in narrowed["live"][one].values()), narrowed["live"]
    else:
        assert narrowed["live"] is None and "no GPU" in narrowed["skipped"]
    assert view.result == shown[first]  # drive() left the controls, and so the figure, where they were


# (lesson, op, a tiny shape, the function made wrong: its module's name in lessonlib and its own)
TINY = [("flash_attention", "forward", {"B": 1, "H": 2, "N": 24, "D": 16, "causal": True}, ("ops", "flash_attention")),
        ("paged_attention", "paged_attention", {"B": 2, "context": 37, "H": 4, "Hkv": 2, "D": 16, "block_size": 16},
         ("ops", "paged_attention")),
        ("paged_attention", "rope_store_kv", {"T": 5, "H": 4, "Hkv": 2, "D": 16, "block_size": 16},
         ("ops", "rope_store_kv")),
        ("torch_compile", "gated_mlp", {"T": 5, "H": 32, "I": 48}, ("ops.gated_mlp", "swiglu")),
        ("cuda_graphs", "decode_step", {"B": 2, "context": 19, "H": 64, "heads": 4, "kv_heads": 2, "D": 16},
         ("ops", "paged_attention"))]


@pytest.mark.parametrize("lesson, op, shape, wrong", TINY, ids=[f"{lesson}-{op}" for lesson, op, *_ in TINY])
def test_live_measurement_checks_lessonlib_then_times_the_case_in_the_recorded_fields(monkeypatch, lesson, op, shape,
                                                                                       wrong):
    """The GPU path at tiny sizes, run here in the interpreter (torch.compile stood in for by the eager function:
    Inductor's CPU build is not what is tested): records in the recorded file's fields, then the same with
    lessonlib's output made wrong, which the float64 check must refuse before anything is timed."""
    import importlib

    import torch

    from lessonlib import measure, sdpa
    from lessonlib.results import SDPA_BACKEND_IMPLS, Unit

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    spec = widgets.LESSONS[lesson]
    timed = []
    real_time_fn = measure.time_fn
    monkeypatch.setattr(measure, "time_fn", lambda fn, *a, **k: timed.append(fn) or real_time_fn(fn, *a, cpu_reps=1))
    records = spec.live(op, shape)
    values = spec.values(records, op, shape)
    assert values and timed, records
    # Every field measured (GB/s may round to 0.0 here), but a CUDA graph's, which only a GPU can replay, and the
    # SDPA backends this GPU has no kernels for (a T4's, emulated or real: FlashAttention-2 and cuDNN), whose
    # records carry PyTorch's refusal instead.
    absent = {impl for backend, impl in SDPA_BACKEND_IMPLS.items() if backend not in sdpa.available_backends()}
    assert all(v is not None for impl, got in values.items() if impl not in absent
               for f, v in got.items() if f != Unit.GRAPH_GBPS), values
    assert all("No available kernel" in r["error"] for r in records if r["impl"] in absent), records
    assert all(r["us"] > 0 for r in records if r["impl"] not in absent), records
    module, name = importlib.import_module(f"lessonlib.{wrong[0]}"), wrong[1]
    real = getattr(module, name)

    def off_by_one(*args, **kwargs):
        out = real(*args, **kwargs)
        return (out[0] + 1, *out[1:]) if isinstance(out, tuple) else out + 1

    monkeypatch.setattr(module, name, off_by_one)
    timed.clear()
    with pytest.raises(AssertionError):
        spec.live(op, shape)
    assert not timed


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="GPU only: times each lesson's case live")
@pytest.mark.parametrize("lesson", sorted(widgets.LESSONS))
def test_measure_on_this_gpu_draws_the_live_case_beside_the_recorded_one(lesson):
    """On a GPU: ticking "measure on this GPU" times the view's case (checked first) and shows lessonlib's number."""
    view = widgets.recorded_run_explorer(lesson)
    shown = widgets.drive(view, measure_here=True)
    plt.close("all")
    spec = widgets.LESSONS[lesson]
    assert shown["skipped"] is None and shown["live"], shown
    ours = next(i for i in spec.impls if i in shown["live"])
    assert all(v is not None and v > 0 for v in shown["live"][ours].values()), shown["live"]
    assert set(shown["live"]) <= set(spec.impls) and set(shown["recorded"]) <= set(spec.impls)


def test_the_online_softmax_stepper_shows_the_tile_its_slider_names_from_the_first_to_the_last():
    """The slider's number is the number of tiles folded in: at 1 the view shows the first tile's keys, at its
    end the last tile's, where the output is exact (lesson 02's stepper once read "tile 0" beside "after tile 1")."""
    import re

    seq_len, block = 37, 8  # a ragged last tile: 5 tiles, the last of 5 keys
    view = widgets.online_softmax_stepper(seq_len=seq_len, block=block)
    (slider,) = view.controls.values()
    tiles = -(-seq_len // block)
    assert (slider.min, slider.max) == (1, tiles) and slider.value == slider.min
    for value in range(slider.min, slider.max + 1):
        slider.value = value  # as a student moves it: the view redraws
        said = re.search(r"after tile (\d+) of (\d+) \((\d+) keys\)", view.text.value)
        assert said, view.text.value
        assert [int(g) for g in said.groups()] == [value, tiles, min(value * block, seq_len)], (value, said.group(0))
    assert view.result["error"] < 1e-12  # the last tile: exact attention
