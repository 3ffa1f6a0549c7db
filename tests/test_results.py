"""The path from a benchmark to a plot: every committed results file loads with only declared labels, every
figure draws from them (headless), and a label the schema does not declare fails loudly."""

import json
import re

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

import lessonlib.plots as plots  # noqa: E402
from lessonlib import results  # noqa: E402
from lessonlib.plots.serving_engine import plot_recorded  # noqa: E402
from lessonlib.results import Benchmark, Impl, Op, recorded_name  # noqa: E402

CPU_RECORDED = sorted(p.stem for p in results.RESULTS_DIR.glob("*-cpu.json"))
COMMITTED = sorted(p.stem for p in results.RESULTS_DIR.glob("*.json") if p.stem not in CPU_RECORDED)


def test_every_benchmark_has_its_committed_file():
    benchmarks = [v for k, v in vars(Benchmark).items() if k.isupper() and v not in results.AWAITING_GPU_RUN]
    assert sorted(recorded_name(b) for b in benchmarks) == COMMITTED
    # a benchmark awaiting its GPU run has no file yet; once its file is committed it must leave the set
    assert not {recorded_name(b) for b in results.AWAITING_GPU_RUN} & set(COMMITTED)
    # meanwhile its CPU run may stand in, named as such
    assert sorted(recorded_name(b, "cpu") for b in results.RECORDED_ON_CPU) == CPU_RECORDED


@pytest.mark.parametrize("name", COMMITTED + CPU_RECORDED)
def test_committed_results_load_with_declared_labels(name):
    recorded = results.load(name)
    where = "a CPU (no GPU)" if name in CPU_RECORDED else "NVIDIA"
    assert recorded.records and recorded.provenance().startswith(f"recorded on {where}")


@pytest.mark.parametrize("name", COMMITTED + CPU_RECORDED)
def test_committed_results_round_trip_unchanged(name, tmp_path):
    path = results.RESULTS_DIR / f"{name}.json"
    written = results.load(name).save(tmp_path / "copy.json")
    assert json.loads(written.read_text()) == json.loads(path.read_text())


def _with_record(tmp_path, **changes):
    data = json.loads((results.RESULTS_DIR / "fusion-h200.json").read_text())
    data["records"][0].update(changes)
    path = tmp_path / "renamed.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("field, label", [("impl", "lessonlib (renamed)"), ("op", "swiglu2"),
                                          ("impl", "sweep BLOCK=big")])
def test_an_undeclared_label_fails_to_load_naming_it_and_the_file(tmp_path, field, label):
    path = _with_record(tmp_path, **{field: label})
    with pytest.raises(results.UnknownLabel, match=re.escape(f"renamed.json: {field} '{label}'")):
        results.load(path)


def test_an_undeclared_label_fails_to_save(tmp_path):
    recorded = results.load("fusion-h200")
    recorded.records[0]["impl"] = "lessonlib v2"
    with pytest.raises(results.UnknownLabel, match="lessonlib v2"):
        recorded.save(tmp_path / "out.json")


def test_sweep_labels_are_built_and_read_by_the_schema():
    assert results.sweep_label({"num_splits": 4}) == "lessonlib num_splits=4"
    assert results.sweep_label({"BLOCK": 1024, "warps": 4}, results.FUSION_SWEEP_PREFIX) == "sweep BLOCK=1024 warps=4"
    both = results.kernels_sweep_label({"dkdv": {"BLOCK_M": 32}, "dq": {"BLOCK_M": 64}})
    assert both == "lessonlib dkdv BLOCK_M=32 | dq BLOCK_M=64" and results.is_sweep(both)
    assert results.sweep_settings("lessonlib num_splits=8 num_warps=8") == {"num_splits": 8, "num_warps": 8}
    assert not results.is_sweep(Impl.LESSONLIB) and not results.is_sweep(Impl.FUSED_STEP)


FUSION, FLASH, PAGED, GRAPHS, ENGINE = (recorded_name(b) for b in (
    Benchmark.FUSION, Benchmark.FLASH_ATTENTION, Benchmark.PAGED_ATTENTION, Benchmark.CUDA_GRAPHS, Benchmark.ENGINE))
FIGURES = {  # every figure drawn from a recorded run, as the notebooks call it
    "bandwidth swiglu": lambda: plots.bandwidth(results.load(FUSION), Op.SWIGLU, {"T": 8192, "I": 14336}),
    "bandwidth add_rms_norm": lambda: plots.bandwidth(results.load(FUSION), Op.ADD_RMS_NORM, {"T": 8192, "H": 4096}),
    "per_call_time": lambda: plots.per_call_time(results.load(FUSION), Op.SWIGLU),
    "launch_overhead": lambda: plots.launch_overhead(results.load(FUSION)),
    "gated_mlp": lambda: plots.gated_mlp(results.load(FUSION)),
    "register_pressure": lambda: plots.register_pressure(results.load(FUSION)),
    "attention_speed": lambda: plots.attention_speed(results.load(FLASH), causal=True),
    "attention_speed backward": lambda: plots.attention_speed(results.load(FLASH), causal=True, op=Op.BACKWARD),
    "forward_time_budget": lambda: plots.forward_time_budget(results.load(FLASH),
                                                             {"B": 2, "H": 32, "N": 4096, "D": 128, "causal": False}),
    "paged_attention_speed": lambda: plots.paged_attention_speed(results.load(PAGED)),
    "decode_step_times": lambda: plots.decode_step_times(results.load(GRAPHS)),
    "launch_modes": lambda: plots.launch_modes(results.load(GRAPHS)),
    "engine plot_recorded": lambda: plot_recorded(results.load(ENGINE))[0].figure,
}


@pytest.mark.parametrize("name", FIGURES)
def test_every_recorded_figure_draws_from_the_committed_run(name):
    fig = FIGURES[name]()
    try:
        axes = fig.get_axes()
        drawn = sum(len(ax.patches) + len(ax.lines) + len(ax.collections) for ax in axes)
        assert drawn > 0, f"{name} drew nothing"
        assert any(t.get_text().startswith("recorded on NVIDIA") for t in fig.texts), f"{name}: no provenance"
        fig.canvas.draw()
    finally:
        plt.close(fig)


def test_attention_speed_plots_named_implementations_only_not_the_sweep():
    fig = plots.attention_speed(results.load(FLASH), causal=False)
    labels = {line.get_label() for line in fig.axes[0].lines if not line.get_label().startswith("_")}
    plt.close(fig)
    assert labels == {Impl.LESSONLIB, Impl.NAIVE, Impl.SDPA_FLASH, Impl.SDPA_CUDNN, Impl.SDPA_EFFICIENT}


def test_every_forward_budget_row_names_a_recorded_variant():
    recorded = results.load(FLASH)
    for impl, _, _ in plots.FORWARD_BUDGET:
        assert recorded.select(op=Op.FORWARD_VARIANT, impl=impl), impl
