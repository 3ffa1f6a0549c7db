"""What a student reads off a figure at a glance: which axis a line is read on, legends beside the curves rather than
on them, one meaning per colour within a figure, more than one labelled tick, a missing value drawn as missing (with
its reason) rather than as a bar of height zero, and a footer naming the repository's results file."""

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from lessonlib import plots, results  # noqa: E402
from lessonlib.cases.serving_engine import simulate  # noqa: E402
from lessonlib.plots.serving_engine import plot_recorded, plot_simulation  # noqa: E402
from lessonlib.plots.recorded import recorded_vs_live  # noqa: E402
from lessonlib.results import RESULTS_DIR, Impl, Op, Unit  # noqa: E402

COMMITTED = sorted(path.stem for path in RESULTS_DIR.glob("*.json"))


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.mark.parametrize("name", COMMITTED)
def test_a_committed_run_names_its_repository_file_and_the_command_that_rewrites_it(name):
    recorded = results.load(name)
    text = recorded.provenance()
    file = f"lessonlib/results/{name}.json"
    gpu = recorded.environment["gpu"]
    where = "a CPU (no GPU)" if gpu == results.NO_GPU else gpu  # a CPU run is not "recorded on none (CPU)"
    assert text.startswith(f"recorded on {where}, torch") and f"file: {file};" in text, text
    assert f"--out {file}" in text and "/root/" not in text, text  # not where the recording machine wrote it
    script = recorded.command.split()[1]
    assert script.startswith("benchmarks/bench_") and script in text, text  # the rest of the command is the run's


def test_a_run_read_from_elsewhere_is_named_by_its_own_path(tmp_path):
    copy = tmp_path / "mine.json"
    copy.write_text((RESULTS_DIR / "fusion-h200.json").read_text())
    text = results.load(copy).provenance()
    assert f"file: {copy};" in text and f"--out {copy}" in text and "lessonlib/results" not in text, text


def test_every_figure_footer_names_the_repository_file():
    fig = plots.per_call_time(results.load("fusion-h200"), Op.SWIGLU)
    footers = [t.get_text() for t in fig.texts if t.get_text().startswith("recorded on")]
    assert footers and "lessonlib/results/fusion-h200.json" in footers[0] and "/root/" not in footers[0], footers


def _labelled_ticks(axis, limits) -> list[str]:
    low, high = sorted(limits)
    return [t.get_text() for t in axis.get_ticklabels() if t.get_text() and low <= t.get_position()[1] <= high]


def test_the_per_call_plot_labels_several_ticks_on_its_time_axis():
    """Lesson 01's per-call times span 14-290 µs, under two decades: powers of ten alone gave one label ("100")."""
    fig = plots.per_call_time(results.load("fusion-h200"), Op.SWIGLU)
    ax = fig.axes[0]
    fig.canvas.draw()
    labels = _labelled_ticks(ax.yaxis, ax.get_ylim())
    assert len(labels) >= 3 and "$" not in "".join(labels), labels  # plain text, no mathtext (see plain_log_ticks)


def test_the_kv_blocks_figure_reads_each_line_on_its_own_axis_with_the_legend_beside_it():
    """Lesson 07's KV-blocks figure: blocks and requests on two panels, each with its unit on its y-axis (no twin
    axis to guess between), and each legend outside its panel, so it hides no curve."""
    axes = plot_simulation(simulate(arrival_rate=0.3, steps=120), num_blocks=256)
    fig = axes[0].figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert len(fig.axes) == 2 and [ax.get_ylabel() for ax in axes] == ["KV blocks", "requests"]
    for ax in axes:
        legend = ax.get_legend()
        assert legend is not None and legend.get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1
    labels = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in axes]
    assert any("in use" in label for label in labels[0]) and labels[1] == ["running", "waiting"], labels


def _facecolors(ax) -> set[str]:
    return {to_hex(patch.get_facecolor()) for patch in ax.patches if patch.get_height() > 0}


def test_the_recorded_engine_figure_gives_no_colour_two_meanings():
    """Lesson 07's two panels: implementations on the left, parts of a step on the right; no colour in both."""
    implementations, parts = plot_recorded(results.load("engine-h200"))
    left, right = _facecolors(implementations), _facecolors(parts)
    assert left and right and not left & right, left & right
    assert len(right) == len({r["part"] for r in results.load("engine-h200").select(op=Op.DECODE_STEP_PART)}) - 1


def test_a_value_the_run_lacks_is_a_marker_with_its_reason_not_a_bar():
    values = {Impl.LESSONLIB: {Unit.GBPS: 3000.0, Unit.GRAPH_GBPS: 3100.0},
              Impl.TABLES_VALIDATED: {Unit.GBPS: 1000.0, Unit.GRAPH_GBPS: None},
              Impl.FLEX_PAGED: {Unit.GBPS: None, Unit.GRAPH_GBPS: None}}
    missing = {"recorded": {Impl.TABLES_VALIDATED: {Unit.GRAPH_GBPS: "not timed: a host sync"},
                            Impl.FLEX_PAGED: {Unit.GBPS: "failed: InductorError: BLOCK_M"}}}
    fig = recorded_vs_live(values, None, (Unit.GBPS, Unit.GRAPH_GBPS), "case", "NVIDIA H200", "recorded on X",
                           missing)
    by_field = dict(zip((Unit.GBPS, Unit.GRAPH_GBPS), fig.axes))
    for field, ax in by_field.items():
        widths = sorted(patch.get_width() for patch in ax.patches)
        assert widths == sorted(v[field] for v in values.values() if v[field] is not None), (field, widths)
    texts = {field: " ".join(t.get_text() for t in ax.texts) for field, ax in by_field.items()}
    assert "failed: InductorError" in texts[Unit.GBPS] and "not timed: a host sync" in texts[Unit.GRAPH_GBPS]
    assert "not recorded" in texts[Unit.GRAPH_GBPS]  # FlexAttention's graph value came with no reason
    assert {t.get_text() for t in fig.axes[0].get_yticklabels()} == set(values)  # names on one line each


def test_the_recorded_paged_view_prints_and_draws_why_a_peer_has_no_number():
    """Lesson 03's committed run: FlexAttention failed at B=64 (its error recorded), and the validated kernel has no
    CUDA-graph time (its checks sync with the host): the view says both, where it used to print "(failed)"."""
    from lessonlib import widgets

    spec = widgets.LESSONS["paged_attention"]
    recorded = results.load(spec.name)
    case = next(c for c, (op, shape) in spec.cases(recorded).items() if op == Op.PAGED_ATTENTION and shape["B"] == 64)
    error = recorded.one(op=Op.PAGED_ATTENTION, impl=Impl.FLEX_PAGED, B=64)["error"]
    view = widgets.recorded_run_explorer("paged_attention", recorded, case)
    why = view.result["missing"]["recorded"]
    assert why[Impl.FLEX_PAGED] == {Unit.GBPS: f"failed: {error}", Unit.GRAPH_GBPS: f"failed: {error}"}
    validated = why[Impl.TABLES_VALIDATED]
    assert validated[Unit.GRAPH_GBPS].startswith("not timed") and Unit.GBPS not in validated
    assert error[:40] in view.text.value and "host sync" in view.text.value and "(failed)" not in view.text.value


def test_a_recorded_view_with_no_implementation_ticked_says_so(recwarn):
    fig = recorded_vs_live({}, None, (Unit.GBPS,), "case", "NVIDIA H200", "recorded on X")
    fig.canvas.draw()
    assert "no implementation chosen" in [t.get_text() for t in fig.axes[0].texts] and not recwarn.list


def test_the_launch_bound_legend_states_the_kernels_the_records_counted():
    """SDPA's FlashAttention-2 launches one kernel at short T and two (split-KV, then a combine) at T = 512 and
    1,024 on the H200: the legend says what each record counted, and follows the file when a count changes."""
    import copy

    from lessonlib.cases.attention_launches import launch_counts

    run = results.load("attention-launches-h200")
    legend = [t.get_text() for t in plots.launch_bound_attention(run).axes[0].get_legend().get_texts()]
    sdpa = launch_counts(run, Impl.SDPA_FLASH)
    assert sorted(set(sdpa.values())) == [1, 2]  # the recorded run this lesson's text describes
    assert f"{Impl.SDPA_FLASH} (1 kernel at T=16-256, 2 at T=512-1024)" in legend, legend
    assert f"{Impl.LESSONLIB} (1 kernel)" in legend and f"{Impl.EAGER_ATTENTION} (5 kernels)" in legend, legend
    planted = copy.deepcopy(run)
    for record in planted.select(op=Op.LAUNCH_BOUND_ATTENTION, impl=Impl.SDPA_FLASH):
        record["launches"] = 1
    legend = [t.get_text() for t in plots.launch_bound_attention(planted).axes[0].get_legend().get_texts()]
    assert f"{Impl.SDPA_FLASH} (1 kernel)" in legend, legend


def test_lesson_02_gives_each_implementation_one_colour_in_every_figure():
    """Naive attention is grey and cuDNN red in every figure of lesson 02 (its first figure once drew the naive
    score matrix in cuDNN's red)."""
    flash = results.load("flash-attention-h200")
    colours: dict[str, set] = {}
    memory = plots.score_bytes(8192).axes[0].get_lines()
    for impl, line in zip((Impl.NAIVE, Impl.LESSONLIB), memory):
        colours.setdefault(to_hex(line.get_color()), set()).add(impl)
    figures = [plots.attention_speed(flash, causal=c, op=op) for c in (False, True) for op in (Op.FORWARD, Op.BACKWARD)]
    figures.append(plots.launch_bound_attention(results.load("attention-launches-h200")))
    for fig in figures:
        for line in fig.axes[0].get_lines():
            impl = next((i for i in (Impl.SDPA_FLASH, Impl.SDPA_CUDNN, Impl.SDPA_EFFICIENT, Impl.NAIVE,
                                     Impl.EAGER_ATTENTION, Impl.LESSONLIB) if line.get_label().startswith(i)), None)
            if impl is not None:
                colours.setdefault(to_hex(line.get_color()), set()).add(impl)
    assert len(colours) >= 6 and all(len(impls) == 1 for impls in colours.values()), colours
