"""The benchmark stays runnable (its --smoke mode, tiny sizes, any mode) and writes a valid results file; the
committed GPU results carry their provenance and the peers the notebooks plot."""

import subprocess
import sys
from pathlib import Path

from lessonlib import results

ROOT = Path(__file__).resolve().parents[1]


def run_smoke(script: str, tmp_path) -> results.Results:
    out = tmp_path / "smoke.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return results.load(out)


def test_bench_fusion_smoke_writes_a_results_file(tmp_path):
    recorded = run_smoke("bench_fusion.py", tmp_path)
    assert recorded.benchmark == "fusion" and "--smoke" in recorded.command
    assert recorded.select(op="swiglu", impl="lessonlib") and recorded.select(op="launch_overhead")
    assert recorded.notes["launch_counts"]["counts"]["add_rms_norm"]["lessonlib"]["total"] == 1


def test_committed_gpu_results_name_their_provenance_and_peers():
    recorded = results.load("fusion-h200")
    env = recorded.environment
    assert env["gpu"].startswith("NVIDIA") and env["torch"] and env["triton"] and env["date"]
    assert "bench_fusion.py" in recorded.command
    for op, shape in (("swiglu", {"T": 8192, "I": 14336}), ("add_rms_norm", {"T": 8192, "H": 4096})):
        for impl in ("lessonlib", "eager", "torch.compile"):
            assert recorded.select(op=op, impl=impl, **shape)
        assert recorded.one(op="copy", **shape)["gbps"] > 0
    assert recorded.ceilings["bandwidth_gbs"] > 0 and recorded.ceilings["matmul_tflops"] > 0


def test_bench_paged_attention_smoke_writes_a_results_file(tmp_path):
    recorded = run_smoke("bench_paged_attention.py", tmp_path)
    for impl in ("lessonlib", "SDPA, contiguous cache", "gather pages, then SDPA"):
        assert recorded.select(op="paged_attention", impl=impl)
    assert recorded.select(op="store_kv", impl="lessonlib")


def test_bench_flash_attention_smoke_writes_a_results_file(tmp_path):
    recorded = run_smoke("bench_flash_attention.py", tmp_path)
    for op in ("forward", "backward", "decode"):
        assert recorded.select(op=op, impl="lessonlib"), op
    assert recorded.select(op="forward", impl="naive") and recorded.select(op="forward", impl="SDPA")
    assert all(r["tflops"] > 0 for r in recorded.select(op="forward", impl="lessonlib"))


def test_bench_cuda_graphs_smoke_writes_a_results_file(tmp_path):
    recorded = run_smoke("bench_cuda_graphs.py", tmp_path)
    assert recorded.select(op="gated_mlp", impl="eager")
    assert recorded.select(op="decode_step", impl="lessonlib fused step")


def test_bench_headline_smoke_and_every_headline_has_its_recorded_twin(tmp_path):
    recorded = run_smoke("bench_headline.py", tmp_path)
    assert recorded.benchmark == "headline" and {r["op"] for r in recorded.records} == {
        "swiglu", "add_rms_norm", "forward", "paged_attention", "read"}
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_headline

    cases = [(op, shape, impl, "gbps") for op, shape in bench_headline.FUSION for impl in ("lessonlib", "copy (same bytes)")]
    cases += [("forward", shape, impl, "tflops") for shape in bench_headline.FLASH for impl in ("lessonlib", "SDPA cudnn")]
    cases += [("paged_attention", shape, impl, "graph_gbps") for shape in bench_headline.PAGED
              for impl in ("lessonlib", "SDPA, contiguous cache")]
    for op, shape, impl, metric in cases:
        assert bench_headline.recorded_value(op, shape, impl, metric, per_call=False) > 0, (op, shape, impl)
    for op, shape in bench_headline.PER_CALL:
        assert bench_headline.recorded_value(op, shape, "lessonlib", "us", per_call=True) > 0, op
