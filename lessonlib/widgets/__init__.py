"""Interactive views for the notebooks (ipywidgets). Each view is a plain function that prints, draws and returns what
it showed, wrapped by :class:`lessonlib.widgets.view.FigureView`; the function's return value (``view.result``) is
what tests and nbval check, since a headless kernel has no front end to look at."""

from __future__ import annotations

import numpy as np
import torch

from lessonlib import plots, traffic
from lessonlib.results import Ceilings

from lessonlib.widgets.recorded import LESSONS, RecordedRun, recorded_run_explorer, show_recorded_run  # noqa: F401 (re-exported)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def op_traffic(op: str, tokens: int, hidden: int, intermediate: int, dtype: str) -> traffic.OpTraffic:
    """The traffic model of one op at one size; attention-style shapes use Llama-8B's heads (32 q, 8 kv, D=128)."""
    itemsize = DTYPE_BYTES[dtype]
    if op == "swiglu":
        return traffic.swiglu(tokens, intermediate, itemsize)
    if op == "add_rms_norm":
        return traffic.add_rms_norm(tokens, hidden, itemsize)
    if op == "apply_rope":
        return traffic.apply_rope(1, 32, 8, tokens, 128, itemsize)
    if op == "gated_mlp":
        return traffic.gated_mlp(tokens, hidden, intermediate, itemsize)
    raise ValueError(f"unknown op {op!r}; choose from {sorted(traffic.OPS)}")


def show_traffic(op="add_rms_norm", tokens=8192, hidden=4096, intermediate=14336, dtype="bfloat16") -> dict:
    """Draw eager vs fused bytes for one op; return the numbers shown."""
    model = op_traffic(op, tokens, hidden, intermediate, dtype)
    print(f"{op}: eager {model.eager.launches} launches, {model.eager.bytes / 1e6:,.1f} MB -> fused "
          f"{model.fused.launches} launch, {model.fused.bytes / 1e6:,.1f} MB ({model.byte_ratio:.2f}x fewer bytes)")
    plots.traffic_bars(model)
    return {"eager_MB": model.eager.bytes / 1e6, "fused_MB": model.fused.bytes / 1e6, "byte_ratio": model.byte_ratio,
            "eager_launches": model.eager.launches, "fused_launches": model.fused.launches}


def show_roofline(ceilings: Ceilings, op="swiglu", tokens=8192, hidden=4096, intermediate=14336, dtype="bfloat16") -> dict:
    """Place one op, eager and fused, on the roofline; return intensities and time floors."""
    model = op_traffic(op, tokens, hidden, intermediate, dtype)
    bw, peak = ceilings.bandwidth_gbs * 1e9, ceilings.matmul_tflops * 1e12
    result = {
        "eager_intensity": model.eager.intensity,
        "fused_intensity": model.fused.intensity,
        "bound": "memory" if model.fused.intensity < ceilings.ridge_intensity else "compute",
        "eager_floor_us": model.eager.time_floor_s(bw, peak) * 1e6,
        "fused_floor_us": model.fused.time_floor_s(bw, peak) * 1e6,
    }
    print(f"{op} at T={tokens}: fused {result['fused_intensity']:.2f} FLOP/byte, {result['bound']}-bound; "
          f"fastest possible: eager {result['eager_floor_us']:,.1f} µs, fused {result['fused_floor_us']:,.1f} µs")
    plots.roofline(ceilings, [(f"{op} eager", model.eager.intensity, None), (f"{op} fused", model.fused.intensity, None)])
    return result


def _sliders():
    import ipywidgets as w

    return dict(
        tokens=w.IntSlider(value=8192, min=1, max=32768, step=1, description="tokens T", continuous_update=False),
        hidden=w.IntSlider(value=4096, min=256, max=16384, step=256, description="hidden H", continuous_update=False),
        intermediate=w.IntSlider(value=14336, min=512, max=57344, step=512, description="inter. I", continuous_update=False),
        dtype=w.Dropdown(options=list(DTYPE_BYTES), value="bfloat16", description="dtype"),
    )


def _explorer(fn, op, **fixed):
    """The op dropdown and size sliders over ``fn`` (show_traffic or show_roofline)."""
    import ipywidgets as w

    from lessonlib.widgets.view import FigureView

    controls = {"op": w.Dropdown(options=list(traffic.OPS), value=op, description="op"), **_sliders()}
    return FigureView(fn, controls, fixed)


def traffic_explorer(op="add_rms_norm"):
    """Sliders over tokens, hidden and intermediate size: bytes moved, eager vs fused."""
    return _explorer(show_traffic, op)


def roofline_explorer(ceilings: Ceilings, op="swiglu"):
    """Choose an op and a size, see where it sits on the roofline."""
    return _explorer(show_roofline, op, ceilings=ceilings)


def drive(view, **values) -> dict:
    """The view's result with its controls at ``values`` (``drive(view, tokens=1)``), computed once with the
    controls moved as a student would, then moved back; whatever the function raises there is raised here. Nothing
    is drawn until the controls are back, so a control and its figure never disagree after "Run all"."""
    unknown = set(values) - set(view.controls)
    if unknown:
        raise ValueError(f"no control named {sorted(unknown)}; this view has {sorted(view.controls)}")
    before = {name: view.controls[name].value for name in values}
    with view.quietly():
        try:
            for name, value in values.items():
                view.controls[name].value = value
            return view.compute()
        finally:
            for name, value in before.items():
                view.controls[name].value = value


def show_score_memory(tokens=8192, heads=32, dtype="bfloat16") -> dict:
    """Bytes of naive attention's score matrix at one size, against what FlashAttention moves."""
    itemsize = DTYPE_BYTES[dtype]
    scores = traffic.score_matrix_bytes(tokens, heads, itemsize)
    io = traffic.attention_io_bytes(tokens, heads, 128, itemsize)
    print(f"T={tokens:,}, {heads} heads, {dtype}: score matrix {scores / 1e9:,.3f} GB per layer; "
          f"Q, K, V, O {io / 1e9:,.3f} GB ({scores / io:,.0f}x less)")
    plots.score_bytes(tokens, heads, 128, itemsize)
    return {"score_bytes": scores, "io_bytes": io}


def score_memory_explorer():
    """Slide the sequence length: the score matrix grows with T², FlashAttention's traffic with T."""
    import ipywidgets as w

    from lessonlib.widgets.view import FigureView

    controls = {
        "tokens": w.IntSlider(value=8192, min=256, max=131072, step=256, description="tokens T", continuous_update=False),
        "heads": w.IntSlider(value=32, min=1, max=128, step=1, description="heads", continuous_update=False),
        "dtype": w.Dropdown(options=list(DTYPE_BYTES), value="bfloat16", description="dtype"),
    }
    return FigureView(show_score_memory, controls)


def show_online_softmax(trace, exact, tiles=1) -> dict:
    """The online softmax after the first ``tiles`` tiles (1 to ``len(trace)``: the slider's number is the count)."""
    tiles = max(1, min(tiles, len(trace)))
    state = trace[tiles - 1]
    error = float((state["out"] - torch.as_tensor(exact)).abs().max())
    print(f"after tile {tiles} of {len(trace)} ({state['keys_seen']} keys): m = {state['m']:.4f}, "
          f"l = {state['l']:.4f}, old sum rescaled by {state['correction']:.4f}\n"
          f"max |output - exact| = {error:.2e}")
    plots.online_softmax(trace, tiles, np.asarray(exact))
    return {"m": state["m"], "l": state["l"], "error": error}


def online_softmax_stepper(seq_len: int = 40, block: int = 8, head_dim: int = 8, seed: int = 0):
    """Step through one query's keys tile by tile: running max, running sum, and the output converging to exact.
    The slider counts the tiles folded in, from 1 (the first tile) to the last, where the output is exact."""
    import ipywidgets as w

    from lessonlib import reference
    from lessonlib.widgets.view import FigureView

    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(seq_len, generator=generator, dtype=torch.float64) * 2
    values = torch.randn(seq_len, head_dim, generator=generator, dtype=torch.float64)
    exact = (torch.softmax(scores, dim=0) @ values).numpy()
    trace = reference.online_softmax_trace(scores, values, block)
    controls = {"tiles": w.IntSlider(value=1, min=1, max=len(trace), description="tiles seen",
                                     continuous_update=False)}
    view = FigureView(show_online_softmax, controls, {"trace": trace, "exact": exact})
    view.trace, view.exact = trace, exact
    return view


def show_kv_reservation(lengths, block_size=16, max_len=4096) -> dict:
    """Used vs paged vs contiguous KV memory for ``lengths`` (Llama-3-8B's 128 KiB of K and V per token)."""
    from lessonlib import kv_memory

    result = kv_memory.reservation(lengths, max_len, block_size)
    per_token = kv_memory.kv_bytes_per_token()
    print(f"block_size {block_size}, max_len {max_len:,}: used {result.used_tokens * per_token / 1e9:,.1f} GB; paged "
          f"holds {result.paged_tokens * per_token / 1e9:,.1f} GB ({result.paged_waste:.1%} unused); contiguous "
          f"reserves {result.contiguous_tokens * per_token / 1e9:,.1f} GB ({result.contiguous_waste:.1%} unused)")
    plots.kv_reservation(lengths.clamp(max=max_len), result, per_token, max_len, block_size)
    return {"paged_waste": result.paged_waste, "contiguous_waste": result.contiguous_waste,
            "used_tokens": result.used_tokens}


def kv_reservation_explorer(lengths):
    """Block size and maximum length against the memory the same requests hold."""
    import ipywidgets as w

    from lessonlib.widgets.view import FigureView

    controls = {
        "block_size": w.Dropdown(options=[1, 8, 16, 32, 64, 128, 256], value=16, description="block_size"),
        "max_len": w.IntSlider(value=4096, min=1024, max=32768, step=1024, description="max_len", continuous_update=False),
    }
    return FigureView(show_kv_reservation, controls, {"lengths": lengths})


def show_recorded_vs_live(recorded, case: str, measure_here: bool = False, live_cache: dict | None = None) -> dict:
    """One of lesson 01's fused ops at one recorded shape: the recorded run's GB/s for eager, torch.compile and
    lessonlib, and with ``measure_here`` the same three measured now on this GPU (kept in ``live_cache``, so moving
    back to a case does not measure it again). Without a GPU the recorded run is shown alone, and says why."""
    from lessonlib import measured, runtime

    op, shape = measured.cases(recorded)[case]
    live = None
    if measure_here and not runtime.on_gpu():
        print("measuring here needs a GPU: this machine runs Triton's interpreter, whose timings say nothing of a GPU")
    elif measure_here:
        cache = live_cache if live_cache is not None else {}
        live = cache[case] = cache.get(case) or measured.live_gbps(op, shape)
    plots.bandwidth(recorded, op, shape, live=live)
    return {"op": op, "shape": shape, "recorded": measured.recorded_gbps(recorded, op, shape), "live": live}


def recorded_vs_live_explorer(recorded, case: str | None = None):
    """Pick an op and a shape of the recorded run; tick "measure here" on a GPU to time the same three
    implementations on it, beside the recorded numbers."""
    import ipywidgets as w

    from lessonlib import measured
    from lessonlib.widgets.view import FigureView

    options = list(measured.cases(recorded))
    controls = {"case": w.Dropdown(options=options, value=case or options[-1], description="op, shape"),
                "measure_here": w.Checkbox(value=False, description="measure here")}
    return FigureView(show_recorded_vs_live, controls, {"recorded": recorded, "live_cache": {}})
