"""The benchmarks stay runnable (their --smoke mode, tiny sizes, any mode) and write valid results files; their case
tables build on CPU and use only labels lessonlib.results declares; the committed GPU results carry their provenance
and the peers the notebooks plot."""

import importlib
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lessonlib import bench, plots, results, runtime
from lessonlib.ops import _launcher
from lessonlib.results import Benchmark, Impl, Op, is_sweep, kernels_sweep_label, recorded_name, sweep_label

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, *flags) -> subprocess.CompletedProcess:
    module = "benchmarks." + script.removesuffix(".py").replace("/", ".")
    run = subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run


def run_smoke(script: str, tmp_path) -> results.Results:
    out = tmp_path / "smoke.json"
    run_script(script, "--smoke", "--out", str(out))
    return results.load(out)


@pytest.mark.parametrize("name", ["fusion", "flash_attention", "paged_attention", "cuda_graphs", "headline", "engine",
                                  "flash_attention_schedules", "per_call"])
def test_every_benchmark_imports_on_cpu_and_names_its_own_results_file(name):
    module = importlib.import_module(f"benchmarks.bench_{name}")
    assert callable(module.main)
    assert (results.RESULTS_DIR / f"{recorded_name(getattr(Benchmark, name.upper()))}.json").exists()


def test_sweep_tables_make_the_labels_the_committed_runs_hold():
    from benchmarks import bench_flash_attention
    from benchmarks import bench_fusion
    from benchmarks import bench_paged_attention

    labels = [sweep_label(knobs) for knobs in bench_paged_attention.KNOBS]
    labels += [sweep_label(c) for c in bench_flash_attention.FORWARD_CONFIGS]
    labels += [kernels_sweep_label(c) for c in bench_flash_attention.BACKWARD_CONFIGS]
    labels += [sweep_label({"BLOCK": c["BLOCK"], "warps": c["num_warps"]}, results.FUSION_SWEEP_PREFIX)
               for c in bench_fusion.SWIGLU_SWEEP]
    assert all(is_sweep(label) for label in labels)
    recorded = {r["impl"] for name in ("paged-attention-h200", "flash-attention-h200", "fusion-h200")
                for r in results.load(name).records}
    assert set(labels) <= recorded, set(labels) - recorded  # a changed label format would orphan the recorded sweep
    assert all(is_sweep(sweep_label(c)) for c in bench_flash_attention.SMOKE_FORWARD_CONFIGS)


def test_forward_variants_are_the_plotted_budget_rows():
    from benchmarks import bench_flash_attention

    assert set(bench_flash_attention.FORWARD_VARIANTS.values()) == {impl for impl, _, _ in plots.FORWARD_BUDGET}


def test_a_record_with_an_undeclared_label_fails_at_once():
    run = bench.Run(Benchmark.FUSION)
    with pytest.raises(results.UnknownLabel, match="lessonlib v2"):
        run.record(Op.SWIGLU, "lessonlib v2", {"T": 1}, 1.0)
    check_only = bench.Run(Benchmark.FUSION, check_only=True)
    with pytest.raises(results.UnknownLabel, match="swiglu2"):
        check_only.cases([bench.Case("swiglu2", {"T": 1}, {Impl.LESSONLIB: lambda: None})])
    assert run.records == []


def test_a_case_is_checked_before_it_is_timed():
    order = []
    run = bench.Run(Benchmark.FUSION)
    run.cases([bench.Case(Op.SWIGLU, {"T": 1}, {Impl.LESSONLIB: lambda: order.append("timed")},
                          check=lambda: order.append("checked"))])
    assert order[0] == "checked" and "timed" in order
    assert run.records[0]["impl"] == Impl.LESSONLIB and run.records[0]["us"] > 0

    def wrong():
        raise AssertionError("lessonlib is wrong")

    with pytest.raises(AssertionError, match="lessonlib is wrong"):
        run.cases([bench.Case(Op.SWIGLU, {"T": 2}, {Impl.LESSONLIB: lambda: order.append("timed too")}, wrong)])
    assert "timed too" not in order


def test_bench_cuda_graphs_check_mode_checks_and_writes_nothing():
    run = run_script("bench_cuda_graphs.py", "--check")
    assert "checked decode_step" in run.stdout and "no file written" in run.stdout


def test_bench_fusion_smoke_writes_a_results_file(tmp_path):
    recorded = run_smoke("bench_fusion.py", tmp_path)
    assert recorded.benchmark == Benchmark.FUSION and "--smoke" in recorded.command
    assert recorded.select(op=Op.SWIGLU, impl=Impl.LESSONLIB) and recorded.select(op=Op.LAUNCH_OVERHEAD)
    assert recorded.notes["launch_counts"]["counts"][Op.ADD_RMS_NORM][Impl.LESSONLIB]["total"] == 1


def test_bench_per_call_smoke_times_each_launch_path_against_eager_in_both_orders(tmp_path):
    from benchmarks import bench_per_call

    recorded = run_smoke("bench_per_call.py", tmp_path)
    assert recorded.benchmark == Benchmark.PER_CALL and "--smoke" in recorded.command
    rounds = bench_per_call.SMOKE_ROUNDS
    for op, eager in bench_per_call.EAGER.items():
        for tokens in bench_per_call.SMOKE_TOKENS:
            records = [r for r in recorded.select(op=op) if r["shape"]["T"] == tokens]
            assert {r["impl"] for r in records} == {Impl.LESSONLIB_CACHED_LAUNCH, Impl.LESSONLIB_PLAIN_LAUNCH,
                                                    Impl.BARE_LAUNCH, eager}, (op, tokens)
            assert all(r["us"] > 0 and len(r["samples_us"]) == 2 * rounds for r in records)  # A B, then B A
    assert set(recorded.notes["cached_over_eager"]) == {f"{op} T={t}" for op in bench_per_call.EAGER
                                                       for t in bench_per_call.SMOKE_TOKENS}
    assert recorded.notes["cached_launch"] == ("on" if runtime.on_gpu() else _launcher.why_not())
    # each case's checked call skipped Triton's binder exactly where the cached launch is on (never in the interpreter)
    ran = recorded.notes["cached_launch_ran"]
    assert ran == {case: runtime.on_gpu() for case in recorded.notes["cached_over_eager"]}


def test_bench_fusion_extras_smoke_writes_a_results_file(tmp_path):
    recorded = run_smoke("bench_fusion_extras.py", tmp_path)
    assert recorded.benchmark == Benchmark.FUSION_EXTRAS and "--smoke" in recorded.command
    for op, impls in ((Op.BIAS_SWIGLU, (Impl.LESSONLIB, Impl.EAGER, Impl.COMPILE)),
                      (Op.DEQUANT_MATMUL, (Impl.LESSONLIB, Impl.EAGER, Impl.COMPILE, Impl.LINEAR_16BIT)),
                      (Op.ABSMAX_NORMALIZE, (Impl.TWO_LAUNCHES, Impl.ONE_PROGRAM, Impl.EAGER, Impl.COMPILE))):
        assert all(r["us"] > 0 for impl in impls for r in recorded.select(op=op, impl=impl)), op
        assert {r["impl"] for r in recorded.select(op=op)} == set(impls), op
    counts = recorded.notes["launch_counts"]["counts"]
    assert counts[Op.ABSMAX_NORMALIZE][Impl.TWO_LAUNCHES] == 2 and counts[Op.ABSMAX_NORMALIZE][Impl.ONE_PROGRAM] == 1
    assert counts[Op.BIAS_SWIGLU][Impl.LESSONLIB] == counts[Op.DEQUANT_MATMUL][Impl.LESSONLIB] == 1


def test_committed_gpu_results_name_their_provenance_and_peers():
    recorded = results.load(recorded_name(Benchmark.FUSION))
    env = recorded.environment
    assert env["gpu"].startswith("NVIDIA") and env["torch"] and env["triton"] and env["date"]
    assert "bench_fusion.py" in recorded.command
    for op, shape in ((Op.SWIGLU, {"T": 8192, "I": 14336}), (Op.ADD_RMS_NORM, {"T": 8192, "H": 4096})):
        for impl in (Impl.LESSONLIB, Impl.EAGER, Impl.COMPILE):
            assert recorded.select(op=op, impl=impl, **shape)
        assert recorded.one(op=Op.COPY, **shape)["gbps"] > 0
    assert recorded.ceilings["bandwidth_gbs"] > 0 and recorded.ceilings["matmul_tflops"] > 0


def test_bench_paged_attention_smoke_writes_a_results_file(tmp_path):
    recorded = run_smoke("bench_paged_attention.py", tmp_path)
    for impl in (Impl.LESSONLIB, Impl.SDPA_CONTIGUOUS, Impl.GATHER_THEN_SDPA):
        assert recorded.select(op=Op.PAGED_ATTENTION, impl=impl)
    assert recorded.select(op=Op.STORE_KV, impl=Impl.LESSONLIB)
    for impl in (Impl.LESSONLIB, Impl.APPLY_ROPE_THEN_STORE_KV, Impl.COPIES_APPLY_ROPE_STORE_KV, Impl.EAGER):
        assert recorded.select(op=Op.ROPE_STORE_KV, impl=impl), impl


def test_bench_flash_attention_smoke_writes_a_results_file(tmp_path):
    from lessonlib import runtime

    recorded = run_smoke("bench_flash_attention.py", tmp_path)
    for op in (Op.FORWARD, Op.BACKWARD, Op.DECODE):
        assert recorded.select(op=op, impl=Impl.LESSONLIB), op
    # SDPA: as PyTorch chooses on CPU; on a GPU forced onto each backend, of which the memory-efficient one has
    # kernels on every GPU and profile (a T4's too: float16 there).
    sdpa_impl = Impl.SDPA_EFFICIENT if runtime.on_gpu() else Impl.SDPA
    assert recorded.select(op=Op.FORWARD, impl=Impl.NAIVE) and recorded.select(op=Op.FORWARD, impl=sdpa_impl)
    assert all(r["tflops"] > 0 for r in recorded.select(op=Op.FORWARD, impl=Impl.LESSONLIB))
    for impl in (Impl.LESSONLIB, Impl.PRESCALED_Q):  # the scale folded into exp2, and applied as a pass of its own
        assert recorded.one(op=Op.ABSORBED, impl=impl, dropout_p=0.0)["us"] > 0
    for dropout_p in (0.0, 0.1):  # SDPA without and with dropout, at the same shape
        assert recorded.one(op=Op.ABSORBED, impl=sdpa_impl, dropout_p=dropout_p)["us"] > 0


def test_bench_flash_attention_schedules_smoke_records_each_technique_checked(tmp_path):
    """Every technique at every tile configuration, forward and backward, beside the peers; each timed result was
    checked within the allowed error first. In the interpreter every configuration runs; on a GPU one Triton cannot
    compile for the profile (TMA before sm_90, warp specialization) may carry its error instead."""
    from benchmarks import bench_flash_attention_schedules as schedules

    recorded = run_smoke("bench_flash_attention_schedules.py", tmp_path)
    peer = Impl.SDPA_CUDNN if runtime.on_gpu() else Impl.SDPA
    for op, impls, tile_sets in ((Op.FORWARD, schedules.FORWARDS, [schedules.SMOKE_FORWARD_TILES]),
                                 (Op.BACKWARD, schedules.BACKWARDS, [schedules.SMOKE_BACKWARD_TILES])):
        assert recorded.select(op=op, impl=Impl.LESSONLIB) and recorded.select(op=op, impl=peer), op
        for impl in impls:
            records = recorded.select(op=op, impl=impl)
            causal_cases = 1 if op == Op.FORWARD else 2
            assert sorted(tuple(r["tiles"]) for r in records) == sorted(tile_sets[0] * causal_cases), (op, impl)
            for r in records:
                if "error" in r and runtime.on_gpu():
                    continue
                allowed = recorded.notes[f"backward allowed error, causal={r['shape']['causal']}"] if (
                    op == Op.BACKWARD) else None
                assert r["us"] > 0 and (allowed is None or r["max_error"] <= allowed), r


def test_bench_flash_attention_schedules_never_times_a_wrong_result():
    """A technique that computes otherwise than attention is recorded as wrong, with no time; one that fails to
    compile is recorded with its error; a result of another shape is the script's own bug and raises."""
    from benchmarks import bench_flash_attention_schedules as schedules

    run = bench.Run(Benchmark.FLASH_ATTENTION_SCHEDULES, smoke=True)
    want, tiles = [torch.ones(2, 4)], (16, 16, 1, 1)
    for fn in (lambda: [torch.ones(2, 4) * 1.01], lambda: [torch.full((2, 4), float("nan"))]):
        schedules.record_checked(run, Op.BACKWARD, Impl.BACKWARD_ATOMIC_DQ, {}, fn, want, 0.005, 1.0, tiles)
    schedules.record_checked(run, Op.BACKWARD, Impl.BACKWARD_ATOMIC_DQ, {}, lambda: 1 / 0, want, 0.005, 1.0, tiles)
    assert [r["us"] for r in run.records] == [None] * 3
    assert [r["error"].split(":")[0] for r in run.records] == ["wrong result", "wrong result", "ZeroDivisionError"]
    with pytest.raises(ValueError, match="shapes"):
        schedules.record_checked(run, Op.BACKWARD, Impl.BACKWARD_ATOMIC_DQ, {}, lambda: [torch.ones(4)], want, 0.005,
                                 1.0, tiles)


def test_bench_cuda_graphs_smoke_writes_a_results_file(tmp_path):
    recorded = run_smoke("bench_cuda_graphs.py", tmp_path)
    assert recorded.select(op=Op.GATED_MLP, impl=Impl.EAGER)
    assert recorded.select(op=Op.DECODE_STEP, impl=Impl.FUSED_STEP)


def test_bench_headline_smoke_and_every_headline_has_its_recorded_twin(tmp_path):
    recorded = run_smoke("bench_headline.py", tmp_path)
    assert recorded.benchmark == Benchmark.HEADLINE and {r["op"] for r in recorded.records} == {
        Op.SWIGLU, Op.ADD_RMS_NORM, Op.FORWARD, Op.PAGED_ATTENTION, Op.READ}
    from benchmarks import bench_headline

    cases = [(op, shape, impl, "gbps") for op, shape in bench_headline.FUSION for impl in (Impl.LESSONLIB, Impl.COPY)]
    cases += [(Op.FORWARD, shape, impl, "tflops") for shape in bench_headline.FLASH
              for impl in (Impl.LESSONLIB, Impl.SDPA_CUDNN)]
    cases += [(Op.PAGED_ATTENTION, shape, impl, "graph_gbps") for shape in bench_headline.PAGED
              for impl in (Impl.LESSONLIB, Impl.SDPA_CONTIGUOUS)]
    for op, shape, impl, metric in cases:
        assert bench_headline.recorded_value(op, shape, impl, metric, per_call=False) > 0, (op, shape, impl)
    for op, shape in bench_headline.PER_CALL:
        assert bench_headline.recorded_value(op, shape, Impl.LESSONLIB, "us", per_call=True) > 0, op


def test_bench_attention_launches_smoke_counts_five_kernels_against_one(tmp_path):
    from lessonlib import runtime
    from lessonlib.cases.attention_launches import fused_sdpa_impl, time_cuts

    recorded = run_smoke("bench_attention_launches.py", tmp_path)
    assert recorded.benchmark == Benchmark.ATTENTION_LAUNCHES
    for t in (16, 40):
        eager = recorded.one(op=Op.LAUNCH_BOUND_ATTENTION, impl=Impl.EAGER_ATTENTION, T=t)
        ours = recorded.one(op=Op.LAUNCH_BOUND_ATTENTION, impl=Impl.LESSONLIB, T=t)
        assert eager["launches"] == 5 and ours["launches"] == 1 and eager["us"] > 0 and ours["us"] > 0
        assert recorded.one(op=Op.LAUNCH_BOUND_ATTENTION, impl=fused_sdpa_impl()[0], T=t)["launches"] == 1
    graphs = {16, 40} if runtime.on_gpu() else set()  # a graph replay needs a GPU
    assert set(time_cuts(recorded)) == {16, 40} and set(time_cuts(recorded, field="graph_us")) == graphs


def test_the_eager_attention_peer_is_attention_and_a_wrong_peer_fails_its_check():
    import torch

    from lessonlib import runtime
    from lessonlib.cases import attention_launches

    q, k, v = (torch.randn(1, 2, 23, 64, device=runtime.device()).half() for _ in range(3))
    calls = attention_launches.peers(q, k, v)
    sdpa_impl = attention_launches.fused_sdpa_impl()[0]
    attention_launches.check(q, k, v, {impl: calls[impl] for impl in (Impl.EAGER_ATTENTION, sdpa_impl)})
    unmasked = {"no mask": lambda: torch.softmax((q @ k.transpose(-1, -2)).float() / 8, -1).half() @ v}
    with pytest.raises(AssertionError, match="no mask"):
        attention_launches.check(q, k, v, unmasked)


def _ladder_rows(spreads: list[tuple[float, float, float]], **extra) -> list[dict]:
    shape = {"requests": 64, "max_num_seqs": 32, "prompt": 128, "max_tokens_low": 16, "max_tokens_high": 256}
    return [{"op": Op.LADDER, "impl": impl, "shape": shape, "dtype": "bfloat16", "tokens_per_s": mid,
             "tokens_per_s_min": low, "tokens_per_s_max": high, "seconds": 8636 / mid, "repeats": 3,
             "prefill_steps": 4, "decode_steps": 990, "same_tokens_as_top_rung": 64, **extra}
            for impl, (low, mid, high) in zip((Impl.RUNG_PLAIN, Impl.RUNG_FUSED_OPS, Impl.RUNG_FLASH_PREFILL), spreads)]


def test_a_ladder_gain_is_a_verdict_only_beyond_the_runs_spread():
    from lessonlib.plots.serving_engine import ladder_gain, plot_ladder

    rows = _ladder_rows([(300, 369, 400), (600, 650, 700), (420, 640, 800)], gpu_us_per_step=9000.0,
                        wall_us_per_step=13000.0, gpu_tokens_per_s=900.0)
    assert ladder_gain(rows[1], rows[0]) == "×1.76 (faster, beyond the spread)"
    assert ladder_gain(rows[2], rows[1]) == "×0.98 (within the spread)"
    assert ladder_gain(rows[0], rows[1]).endswith("(slower, beyond the spread)")
    one_run = [{k: v for k, v in r.items() if k not in ("tokens_per_s_min", "tokens_per_s_max")} for r in rows]
    assert ladder_gain(one_run[1], one_run[0]) == "×1.76 (one run: no verdict)"
    own = {"command": "python ladder", "gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "date": "2026-12-02"}
    run = results.Results(Benchmark.ENGINE, "synthetic", {"gpu": "g", "torch": "t", "triton": "3", "date": "2026"},
                          {}, rows, {"ladder": {"provenance": own}})
    ax = plot_ladder(run)
    assert len(ax.patches) == len(rows) and len(ax.figure.axes) == 2  # tokens/s, and time per step
    assert len(ax.figure.axes[1].patches) == 2 * len(rows)  # wall and GPU time per step, a bar each
    assert "ladder recorded on NVIDIA H200" in ax.figure.texts[0].get_text()


def test_bench_engine_ladder_only_replaces_the_ladder_and_keeps_every_other_record(tmp_path):
    out = tmp_path / "engine.json"
    committed = results.load(recorded_name(Benchmark.ENGINE))
    committed.save(out)
    run_script("bench_engine.py", "--smoke", "--ladder-only", "--out", str(out))
    merged = results.load(out)
    ladder = merged.select(op=Op.LADDER)
    assert ladder and all(r["repeats"] == 2 and len(r["seconds_runs"]) == 2 for r in ladder)
    assert all(r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"] for r in ladder)
    assert all(r["shape"]["requests"] == 3 for r in ladder)  # the smoke ladder, not the committed one
    kept = [r for r in committed.records if r["op"] != Op.LADDER]
    assert [r for r in merged.records if r["op"] != Op.LADDER] == kept
    assert merged.command == committed.command and "--ladder-only" in merged.notes["ladder"]["provenance"]["command"]


def test_largest_batch_counts_slabs_and_blocks_for_the_same_pool():
    import torch

    from lessonlib import kv_memory

    lengths = torch.tensor([17, 1, 64, 33, 100, 5])  # blocks of 16: 2, 1, 4, 3, 7, 1 -> running sums 2, 3, 7, 10, 17
    fit = kv_memory.largest_batch(lengths, pool_tokens=160, max_len=128, block_size=16)
    assert (fit.slabs, fit.blocks) == (1, 4)  # 160 slots: one 128-token slab; 10 blocks hold the first four
    assert kv_memory.largest_batch(lengths, 10_000, 128, 16) == kv_memory.LargestBatch(6, 6)  # all fit both ways
    with pytest.raises(ValueError, match="longer than max_len"):
        kv_memory.largest_batch(lengths, 160, 64, 16)


def test_bench_paging_payoff_smoke_runs_both_batches(tmp_path):
    from lessonlib.cases import paging_payoff

    recorded = run_smoke("bench_paging_payoff.py", tmp_path)
    slabs = recorded.one(op=Op.LARGEST_BATCH, impl=Impl.KV_SLABS)
    blocks = recorded.one(op=Op.LARGEST_BATCH, impl=Impl.KV_BLOCKS)
    assert slabs["batch"] == paging_payoff.SMOKE["slabs"] < blocks["batch"]
    assert blocks["kv_blocks_needed"] <= blocks["shape"]["pool_blocks"] and blocks["preemptions"] == 0
    for row in (slabs, blocks):
        assert row["repeats"] == 2 and 0 < row["decode_tokens_per_s_min"] <= row["decode_tokens_per_s_max"]
        assert row["blocks_used_peak"] <= row["shape"]["pool_blocks"]
    assert paging_payoff.payoff(recorded)["batch"] == blocks["batch"] / slabs["batch"]
    assert plots.paging_payoff(recorded).axes


def test_the_profiled_ladder_run_covers_every_step_in_windows(monkeypatch):
    """profiled_gpu_seconds restarts the profiler every PROFILED_STEPS steps; the windows together run every step of
    the requests once (a fake profiler here: it returns the steps its window ran as 'seconds')."""
    import torch

    from lessonlib import runtime, tiny_model
    from lessonlib.engine import LLM, SamplingParams

    from lessonlib.cases import serving_engine as ladder
    llm = LLM(str(tiny_model.build()), dtype=runtime.dtype(cpu=torch.float32), max_num_seqs=2, num_blocks=16,
              max_model_len=64)
    prompts, params = ["Hello, my name is", "A paged KV cache"], SamplingParams(temperature=0.0, max_tokens=3,
                                                                               ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    steps_expected, windows = len(llm.steps), []

    def fake_profiler(fn):
        before = len(llm.steps)
        fn()
        windows.append(len(llm.steps) - before)
        return None, float(windows[-1])

    monkeypatch.setattr(ladder, "gpu_busy_seconds", fake_profiler)
    monkeypatch.setattr(ladder, "PROFILED_STEPS", 2)
    total = ladder.profiled_gpu_seconds(llm, prompts, params)
    assert total == steps_expected == sum(windows) and max(windows) <= 2 and len(windows) > 1
    assert llm.num_blocks_in_use() == 0
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected  # the engine is left clean


def test_bench_serving_smoke_loads_the_server_at_each_rate_and_records_the_peers(tmp_path):
    pytest.importorskip("openai", reason="the serving benchmark drives the server with the openai client")
    recorded = run_smoke("bench_serving.py", tmp_path)
    assert recorded.benchmark == Benchmark.SERVING and "--smoke" in recorded.command
    served = [r for r in recorded.select(op=Op.SERVING) if "error" not in r]
    sizes = recorded.notes["sizes"]
    assert {(r["shape"]["workload"], r["shape"]["rate"]) for r in served} == \
        {(kind, rate) for kind in ("random", "shared prefix") for rate in sizes["rates"]}
    for r in served:  # every request answered, its measurements ordered as percentiles are
        assert r["completed"] == r["shape"]["requests"] and r["failed"] == 0 and r["output_tokens_per_s"] > 0
        for metric in ("ttft_ms", "e2e_ms", "tpot_ms"):
            assert 0 < r[metric]["p50"] <= r[metric]["p90"] <= r[metric]["p99"] and r[metric]["mean"] > 0
        assert r["ignore_eos"] is (r["impl"] != Impl.HF_SERVE) and r["peak_output_tokens_per_s"] > 0
        assert 0 <= r["request_goodput"] and r["goodput_slo_ms"] == {"ttft": 2000.0, "tpot": 100.0}
    # each peer is in the file: measured, or with the reason it did not run
    assert {r["impl"] for r in recorded.records} == {Impl.SERVER_CHUNKED_PREFILL, Impl.SERVER_NO_CHUNKED_PREFILL,
                                                     Impl.HF_SERVE}
    assert plots.serving_latency(recorded).axes and plots.serving_latency(recorded, workload="shared prefix").axes
    from benchmarks import bench_serving

    assert recorded.notes["targets"] == bench_serving.targets(recorded.records)  # computed from the run's records


def test_bench_serving_reports_what_vllm_bench_serve_reports_on_hand_made_requests():
    from benchmarks import bench_serving

    # three requests: TTFT 0.5, 1.0 and 3.0 s; 5 tokens each over E2EL 0.9, 1.8, 3.2 s: TPOT 0.1, 0.2, 0.05 s
    finished = [{"ttft": 0.5, "e2e": 0.9, "tokens": 5}, {"ttft": 1.0, "e2e": 1.8, "tokens": 5},
                {"ttft": 3.0, "e2e": 3.2, "tokens": 5}]
    assert [bench_serving.tpot(r) for r in finished] == pytest.approx([0.1, 0.2, 0.05])
    stats = bench_serving.percentiles([r["ttft"] for r in finished])
    assert stats["mean"] == 1500.0 and stats["median"] == stats["p50"] == 1000.0 and stats["p99"] == 3000.0
    # good: TTFT <= 2 s and TPOT <= 100 ms: only the first (the second is too slow per token, the third to start)
    assert bench_serving.goodput(finished, span=2.0) == 0.5
    assert bench_serving.peak_tokens_per_s([0.0, 0.2, 0.9, 1.1, 1.5, 1.6, 1.7, 2.5]) == 4  # [1, 2): 4 chunks
    assert bench_serving.tpot({"ttft": 0.3, "e2e": 0.3, "tokens": 1}) is None


def serving_row(impl, rate, ttft_p99_ms, itl_p99_ms, tokens_per_s, failed=0):
    return {"op": Op.SERVING, "impl": impl, "shape": {"rate": rate, "workload": "random"}, "failed": failed,
            "ttft_ms": {"p99": ttft_p99_ms}, "itl_ms": {"p99": itl_p99_ms}, "output_tokens_per_s": tokens_per_s}


def test_a_request_cut_by_the_benchmarks_deadline_is_not_past_the_knee_but_a_server_error_is():
    """The knee is a TTFT rule: a rate whose p99 TTFT is under 2 s stays under the knee when requests were cut short
    by the benchmark's own deadline (their TTFT is counted), and is past it when the server failed one."""
    from benchmarks import bench_serving

    row = {"ttft_ms": {"p99": 245.0}, "failed": 1, "cut_by_deadline": 1}
    assert not bench_serving.past_knee(row)
    assert bench_serving.past_knee({**row, "failed": 2})  # one error beside the cut one
    assert bench_serving.past_knee({**row, "cut_by_deadline": 0})
    assert bench_serving.past_knee({**row, "ttft_ms": {"p99": 2000.0}})
    assert bench_serving.past_knee({"ttft_ms": {"p99": 10.0}, "failed": 1})  # a record without the count: an error


def test_a_knee_no_rate_passed_is_a_lower_bound_and_decides_only_what_it_can():
    """A server whose time ran out before a rate past its knee has a knee of at least its highest rate: against a
    peer's unreached knee our ratio is an upper bound (a 'met' undecided, a 'missed' still missed), against our own
    unreached knee a lower bound (a 'met' still met); the latencies at an unreached peer knee are recorded, undecided."""
    from benchmarks import bench_serving

    rng = random.Random()
    peer_top = 2.0 ** rng.randrange(1, 4)  # the peer's last rate, still under its knee

    def verdicts(ours_knee, ours_top, peer_reached=False):
        records = [serving_row(Impl.HF_SERVE, 2.0 ** k, rng.uniform(50, 1999), 40.0, 500.0)
                   for k in range(1, int(math.log2(peer_top)) + 1)]
        if peer_reached:  # one rate more, past the peer's knee
            records.append(serving_row(Impl.HF_SERVE, 2 * peer_top, 2500.0, 40.0, 500.0))
        for impl in (Impl.SERVER_CHUNKED_PREFILL, Impl.SERVER_NO_CHUNKED_PREFILL):
            records += [serving_row(impl, 2.0 ** k, 2500.0 if 2.0 ** k > ours_knee else 15.0, 10.0, 1000.0)
                        for k in range(1, int(math.log2(ours_top)) + 1)]
        return bench_serving.targets(records)

    got = verdicts(ours_knee=4 * peer_top, ours_top=8 * peer_top)  # ours reached, 4x an unreached peer knee
    assert got["knee_reached"] == {Impl.HF_SERVE: False, Impl.SERVER_CHUNKED_PREFILL: True,
                                   Impl.SERVER_NO_CHUNKED_PREFILL: True}
    assert got["knee_rate"][Impl.HF_SERVE] == peer_top
    verdict = got[Impl.SERVER_CHUNKED_PREFILL]
    assert verdict["knee_rate_over_peer"] == 4 and verdict["met_knee"] is None
    assert verdict["p99_over_peer_at_peer_knee"]["itl_ms"] == 0.25 and verdict["met_latency_at_peer_knee"] is None
    assert verdicts(ours_knee=peer_top, ours_top=2 * peer_top)[Impl.SERVER_CHUNKED_PREFILL]["met_knee"] is False
    # ours unreached at twice the peer's rate: a lower bound of 2x, met only if the peer's knee is known
    got = verdicts(ours_knee=4 * peer_top, ours_top=2 * peer_top)
    assert got["knee_reached"][Impl.SERVER_CHUNKED_PREFILL] is False
    assert got[Impl.SERVER_CHUNKED_PREFILL]["met_knee"] is None  # neither knee known
    got = verdicts(ours_knee=4 * peer_top, ours_top=2 * peer_top, peer_reached=True)
    assert got[Impl.SERVER_CHUNKED_PREFILL]["met_knee"] is True  # at least 2x a known knee
    assert got[Impl.SERVER_CHUNKED_PREFILL]["met_latency_at_peer_knee"] is True  # TTFT 15 / >= 50 ms, ITL 10 / 40
    # in words: the peer's knee as a lower bound, the verdicts it cannot decide said so
    records = [serving_row(Impl.HF_SERVE, peer_top, 100.0, 40.0, 500.0)]
    records += [serving_row(impl, 2.0 ** k, 2500.0 if k > 6 else 15.0, 10.0, 1000.0)
                for impl in (Impl.SERVER_CHUNKED_PREFILL, Impl.SERVER_NO_CHUNKED_PREFILL) for k in range(1, 8)]
    text = plots.serving_summary(results.Results(Benchmark.SERVING, "test", results.environment(), {}, records,
                                                 {"targets": bench_serving.targets(records)}))
    assert f"{Impl.HF_SERVE:42s} at least {peer_top:g} requests/s (its time ran out first)" in text, text
    assert text.count(f"knee at most {64 / peer_top:.2f}x;") == 2, text  # over a lower bound: an upper bound


def test_serving_targets_are_read_from_the_records():
    """Issue 26's verdicts on hand-made records: the knee is the highest rate before the first one past 2 s (or with a
    failure), the latencies are compared at the peer's knee, the saturation throughput is each schedule's best."""
    from benchmarks import bench_serving

    rng = random.Random()
    peer_knee = 2.0 ** rng.randrange(1, 4)
    rates = [2.0 ** k for k in range(1, 8)]
    records, peer = [], {}
    for rate in rates:
        ttft = 2500.0 if rate > peer_knee else rng.uniform(50, 1999)
        peer[rate] = serving_row(Impl.HF_SERVE, rate, ttft, 40.0, 500.0)
    records += peer.values()
    ours_knee = peer_knee * rng.choice([1, 2, 4])
    for impl, tokens in ((Impl.SERVER_CHUNKED_PREFILL, 960.0), (Impl.SERVER_NO_CHUNKED_PREFILL, 1000.0)):
        for rate in rates:
            failed = int(rate > ours_knee)  # past our knee by a failure, not by TTFT
            records.append(serving_row(impl, rate, rng.uniform(10, 1000), rng.uniform(5, 30), tokens, failed))
    got = bench_serving.targets(records)
    assert got["knee_rate"] == {Impl.HF_SERVE: peer_knee, Impl.SERVER_CHUNKED_PREFILL: ours_knee,
                                Impl.SERVER_NO_CHUNKED_PREFILL: ours_knee}
    for impl in (Impl.SERVER_CHUNKED_PREFILL, Impl.SERVER_NO_CHUNKED_PREFILL):
        ours = next(r for r in records if r["impl"] == impl and r["shape"]["rate"] == peer_knee)
        ratios = [ours[k]["p99"] / peer[peer_knee][k]["p99"] for k in ("ttft_ms", "itl_ms")]
        assert got[impl]["met_knee"] == (ours_knee >= 2 * peer_knee)
        assert got[impl]["met_latency_at_peer_knee"] == all(r <= 0.5 for r in ratios)
    assert got["saturation_chunked_over_prefill_first"] == 0.96 and got["met_saturation"] is True


def test_the_step_profile_finds_the_layers_kernels():
    """decode_step_profile.summarize on a made-up replay: 2 kernels before the layers, 3 layers of 3 kernels (the
    second overlapping the first, as under PDL), 1 after; each role's advance is how far the step's end moved."""
    from benchmarks.experiments import decode_step_profile as profile

    replay, t = [], 0.0
    for name, length, overlap in [("embed", 2, 0), ("cos", 1, 0)] + [("qkv", 5, 0), ("attn", 4, 3), ("o", 2, 0)] * 3 \
            + [("head", 10, 0)]:
        start = t - overlap
        replay.append({"name": name, "start": start, "end": start + length})
        t = start + length
    summary = profile.summarize(replay, layers=3)
    assert summary["kernels_per_layer"] == 3 and summary["kernels"] == 12
    assert [r["name"] for r in summary["roles"]] == ["qkv", "attn", "o"]
    assert [r["advance_us_per_layer"] for r in summary["roles"]] == [5, 1, 2]
    assert [o["name"] for o in summary["outside_layers"]] == ["embed", "cos", "head"]
    assert summary["idle_us"] == 0 and summary["span_us"] == 2 + 1 + 3 * 8 + 10


