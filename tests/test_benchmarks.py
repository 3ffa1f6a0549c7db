"""The benchmarks stay runnable (their --smoke mode, tiny sizes, any mode) and write valid results files; their case
tables build on CPU and use only labels lessonlib.results declares; the committed GPU results carry their provenance
and the peers the notebooks plot."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from lessonlib import bench, plots, results
from lessonlib.results import Benchmark, Impl, Op, is_sweep, kernels_sweep_label, recorded_name, sweep_label

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def run_script(script: str, *flags) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *flags],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run


def run_smoke(script: str, tmp_path) -> results.Results:
    out = tmp_path / "smoke.json"
    run_script(script, "--smoke", "--out", str(out))
    return results.load(out)


@pytest.mark.parametrize("name", ["fusion", "flash_attention", "paged_attention", "cuda_graphs", "headline", "engine"])
def test_every_benchmark_imports_on_cpu_and_names_its_own_results_file(name):
    module = importlib.import_module(f"bench_{name}")
    assert callable(module.main)
    assert (results.RESULTS_DIR / f"{recorded_name(getattr(Benchmark, name.upper()))}.json").exists()


def test_sweep_tables_make_the_labels_the_committed_runs_hold():
    import bench_flash_attention
    import bench_fusion
    import bench_paged_attention

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
    import bench_flash_attention

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


def test_bench_cuda_graphs_smoke_writes_a_results_file(tmp_path):
    recorded = run_smoke("bench_cuda_graphs.py", tmp_path)
    assert recorded.select(op=Op.GATED_MLP, impl=Impl.EAGER)
    assert recorded.select(op=Op.DECODE_STEP, impl=Impl.FUSED_STEP)


def test_bench_headline_smoke_and_every_headline_has_its_recorded_twin(tmp_path):
    recorded = run_smoke("bench_headline.py", tmp_path)
    assert recorded.benchmark == Benchmark.HEADLINE and {r["op"] for r in recorded.records} == {
        Op.SWIGLU, Op.ADD_RMS_NORM, Op.FORWARD, Op.PAGED_ATTENTION, Op.READ}
    import bench_headline

    cases = [(op, shape, impl, "gbps") for op, shape in bench_headline.FUSION for impl in (Impl.LESSONLIB, Impl.COPY)]
    cases += [(Op.FORWARD, shape, impl, "tflops") for shape in bench_headline.FLASH
              for impl in (Impl.LESSONLIB, Impl.SDPA_CUDNN)]
    cases += [(Op.PAGED_ATTENTION, shape, impl, "graph_gbps") for shape in bench_headline.PAGED
              for impl in (Impl.LESSONLIB, Impl.SDPA_CONTIGUOUS)]
    for op, shape, impl, metric in cases:
        assert bench_headline.recorded_value(op, shape, impl, metric, per_call=False) > 0, (op, shape, impl)
    for op, shape in bench_headline.PER_CALL:
        assert bench_headline.recorded_value(op, shape, Impl.LESSONLIB, "us", per_call=True) > 0, op
