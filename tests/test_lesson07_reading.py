"""What lesson 07's section 10 and 11 cells print and draw from a run (the decodes' gaps, the serving targets in
words, the chunked-prefill timeline's labels inside its axes), and exercise 1's checker naming each planted mistake.
No engine runs here: hand-made records, the committed CPU run, the notebook's own solution."""

import random

import matplotlib.pyplot as plt
import pytest

from lessonlib import plots, results
from lessonlib.cases import chunked_prefill
from lessonlib.results import Benchmark, Impl, Op, Results
from tests.test_benchmarks import serving_row


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_decode_gaps_are_each_decodes_gaps_when_the_decodes_share_their_steps():
    rng, decodes, end, steps = random.Random(), random.randrange(1, 5), 0.0, []
    for _ in range(random.randrange(3, 12)):
        end += rng.uniform(0.01, 0.5)
        steps.append({"end": end, "tokens": [int(rng.random() < 0.7)] * decodes + [int(rng.random() < 0.5)]})
    steps[-1]["tokens"] = [1] * (decodes + 1)  # the window ends on a step that gave every request a token
    gaps = chunked_prefill.decode_gaps(steps)
    arrivals = [s["end"] for s in steps if s["tokens"][0]]
    assert gaps == pytest.approx([b - a for a, b in zip([0.0] + arrivals, arrivals)])
    latency = chunked_prefill.latencies(steps)  # per decode, pooled: the same gaps, once per decode
    assert latency["itl_max_s"] == pytest.approx(max(gaps))


def serving_targets_run(peer_knee: float, ours_knee: float, tokens: dict, peer_error: bool = False) -> Results:
    from benchmarks import bench_serving

    rng, records = random.Random(), []
    for rate in [2.0 ** k for k in range(1, 7)]:
        if not peer_error:
            records.append(serving_row(Impl.HF_SERVE, rate, 2500.0 if rate > peer_knee else rng.uniform(50, 1999),
                                       40.0, 500.0))
        for impl in (Impl.SERVER_CHUNKED_PREFILL, Impl.SERVER_NO_CHUNKED_PREFILL):
            records.append(serving_row(impl, rate, 2500.0 if rate > ours_knee else 15.0, 10.0, tokens[impl]))
    if peer_error:
        records.append({"op": Op.SERVING, "impl": Impl.HF_SERVE, "shape": {"workload": "random"},
                        "error": "RuntimeError: did not start"})
    return Results(Benchmark.SERVING, "test", results.environment(), {}, records,
                   {"targets": bench_serving.targets(records)})


def test_the_serving_targets_are_printed_in_words_with_their_thresholds():
    peer_knee = 2.0 ** random.randrange(1, 4)
    ours_knee = peer_knee * random.choice([1, 2, 4])
    saturation = random.choice([900.0, 990.0])  # chunked over prefill-first's 1000: 0.90 missed, 0.99 met
    text = plots.serving_targets(serving_targets_run(
        peer_knee, ours_knee, {Impl.SERVER_CHUNKED_PREFILL: saturation, Impl.SERVER_NO_CHUNKED_PREFILL: 1000.0}))
    lines = text.splitlines()
    assert f"{Impl.HF_SERVE:42s} {peer_knee:g} requests/s" in text and f"{ours_knee:g} requests/s" in text, text
    knee = f"knee {ours_knee / peer_knee:.2f}x transformers' (target: at least 2x): "
    assert sum(line.strip() == knee + ("met" if ours_knee >= 2 * peer_knee else "missed") for line in lines) == 2, text
    # at the peer's knee our p99 TTFT is 15 ms and ITL 10 ms: within half of the peer's (its TTFT under 2 s, ITL 40)
    met = "p99 ITL 0.25x transformers' (target: at most 0.5x each): met"
    assert sum(line.endswith(met) for line in lines) == 2, text
    assert lines[-1] == (f"output tokens/s at saturation, chunked prefill over prefill-first: {saturation / 1000:.2f}x "
                         f"(target: at least 0.95x): {'met' if saturation >= 950 else 'missed'}"), text


def test_a_server_that_did_not_run_is_not_measured_not_past_its_knee():
    text = plots.serving_targets(serving_targets_run(
        4.0, 8.0, {Impl.SERVER_CHUNKED_PREFILL: 990.0, Impl.SERVER_NO_CHUNKED_PREFILL: 1000.0}, peer_error=True))
    assert f"{Impl.HF_SERVE:42s} not measured" in text and "even the lowest rate" not in text, text
    assert "knee not measured (target: at least 2x): not measured" in text, text


def test_the_timeline_labels_stay_inside_their_axes():
    fig = plots.chunked_prefill_timeline(results.load("chunked-prefill-cpu"))
    fig.canvas.draw()
    steps_ax = fig.axes[0]
    box = steps_ax.get_window_extent()
    assert len(steps_ax.texts) == 2
    for text in steps_ax.texts:
        extent = text.get_window_extent()
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1, (text.get_text(), extent, box)


@pytest.mark.parametrize("old, new, named", [
    (") + cached_idle_blocks", ")", "a cached block in the free list still leaves the free list"),  # idle as free
    ("take_from_free_list = (prompt_blocks - cached_idle_blocks - cached_busy_blocks) + cached_idle_blocks",
     "take_from_free_list = prompt_blocks", "blocks another sequence holds are shared"),  # the prefix cache ignored
    ("batched_tokens == 0 or ", "", "a lone prompt always fits the token budget"),
    ("running < max_num_seqs and ", "", "the batch is full"),
])
def test_the_admission_exercise_names_each_planted_mistake(old, new, named):
    from lessonlib.exercises import ExerciseFailed, check_can_admit
    from tests.test_kernel_exercises import define, mutated, solution_source

    source = solution_source("07_serving_engine.ipynb", "my_can_admit")
    with pytest.raises(ExerciseFailed, match=named):
        check_can_admit(define(mutated(source, old, new), "my_can_admit"))


def test_the_latency_panels_are_log_scaled_and_the_ttft_panel_draws_the_knee_limit():
    run = serving_targets_run(4.0, 8.0, {Impl.SERVER_CHUNKED_PREFILL: 990.0, Impl.SERVER_NO_CHUNKED_PREFILL: 1000.0})
    for record in run.records:  # the panels draw p50 too
        for key in ("ttft_ms", "itl_ms"):
            record[key]["p50"] = record[key]["p99"] / 2
        record["e2e_ms"] = {"p50": 500.0, "p99": 900.0}
    fig = plots.serving_latency(run)
    ttft, itl, e2e, tokens = fig.axes[:4]
    assert [ax.get_yscale() for ax in (ttft, itl, e2e, tokens)] == ["log", "log", "log", "linear"]
    knee_ms = 1e3 * run.notes["targets"]["ttft_knee_s"]
    assert any(list(line.get_ydata()) == [knee_ms, knee_ms] for line in ttft.lines), "no knee line on the TTFT panel"
