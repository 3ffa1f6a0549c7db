"""lessonlib.claims: every claim's verdict is computed from the recorded results files or a live check; a claim
whose records are missing says it is not measured; every claim points at a cell that exists (its quote and source are
checked against the registry by tests/test_quotations.py); the verdict follows the measured numbers (synthetic
records on both sides of a claim)."""

import random
from pathlib import Path

import nbformat
import pytest
import torch

from lessonlib import claims
from lessonlib.claims import live, recorded
from lessonlib.results import Benchmark, Impl, Op, Results, find, recorded_name

ROOT = Path(__file__).resolve().parents[1]
VERDICTS = ("holds", "does not hold", "not measured here", "not yet measured on a GPU")


@pytest.fixture(scope="module")
def rows():
    return claims.table()


def test_every_claim_has_a_computed_verdict_from_the_committed_files(rows):
    assert len(rows) == len(claims.CLAIMS)
    for row in rows:
        assert row["measured"] and row["verdict"].startswith(VERDICTS), row
    by_quote = {row["quote"]: row for row in rows}
    # the committed cuda-graphs run decides both news figures: every recorded (B, context) appears in each verdict
    graphs = find(recorded_name(Benchmark.CUDA_GRAPHS))
    points = {(r["shape"]["B"], r["shape"]["context"]) for r in graphs.select(op=Op.DECODE_STEP)}
    graph = by_quote["“delivering another 10–15% latency reduction”"]
    assert all(f"B={b}/ctx {c:,}" in graph["measured"] for b, c in points), graph
    # "up to 70%" is the news item's claim about fusing attention's kernels: launch-bound attention (lesson 02),
    # decided by its own run once it is committed; the decode step is not its evidence
    seventy = by_quote["“cutting kernel launch overhead by up to 70%”"]
    assert "decode" not in seventy["measured"] + seventy["evidence"] and claims.LAUNCH_CUT in seventy["claim"]
    assert seventy["where"].startswith("lesson 02") and "attention-launches-h200" in seventy["evidence"]
    if find(recorded_name(Benchmark.ATTENTION_LAUNCHES)) is None:
        assert seventy["verdict"].startswith("not yet measured on a GPU"), seventy


def test_the_launch_claim_has_one_definition_in_the_table_and_in_lesson_05():
    notebook = nbformat.read(ROOT / "notebooks" / "05_cuda_graphs.ipynb", as_version=4)
    text = "\n".join(" ".join(cell.source.split()) for cell in notebook.cells if cell.cell_type == "markdown")
    assert claims.LAUNCH_CUT in text


def test_the_rounding_claim_quotes_lesson_04s_seeded_draw():
    from lessonlib import compiler, runtime

    order = compiler.rounding_order(runtime.dtype())
    assert order == compiler.rounding_order(runtime.dtype())  # seeded: the same figures every time
    measured = live.op_order().measured
    assert f"{order.eager_units:.2f} units (eager) and {order.fused_units:.2f} (fused)" in measured, measured


def test_every_claim_points_at_a_cell_that_exists():
    for claim in claims.CLAIMS:
        notebook = nbformat.read(ROOT / "notebooks" / f"{claim.notebook}.ipynb", as_version=4)
        assert claim.cell in {cell.get("id") for cell in notebook.cells}, (claim.notebook, claim.cell)


def test_a_claim_whose_records_are_missing_says_it_is_not_measured(monkeypatch):
    monkeypatch.setattr(recorded, "committed_run", lambda benchmark: None)
    for decide in (recorded.launch_cut, recorded.graph_cut, recorded.flex_paged,
                   recorded.activation_mul, recorded.residual, recorded.softmax_scale, recorded.dropout,
                   recorded.bias_activation_mul, recorded.dequant_matmul):
        verdict = decide()
        assert verdict.verdict.startswith("not yet measured on a GPU") and "--out lessonlib/results/" in verdict.verdict


def test_the_committed_flash_attention_run_without_absorbed_records_says_not_yet_measured(rows):
    run = find(recorded_name(Benchmark.FLASH_ATTENTION))
    if run is not None and run.select(op=Op.ABSORBED):
        pytest.skip("the committed run holds the absorbed-into-attention records: their verdicts are computed")
    for row in rows:
        if row["claim"].startswith(("the softmax scale fused into attention", "dropout fused into attention")):
            assert row["verdict"].startswith("not yet measured on a GPU"), row


def _absorbed_run(us: dict) -> Results:
    """A flash-attention run holding only absorbed-into-attention records, times from ``us`` (impl, dropout_p)."""
    shape = {"B": 2, "H": 32, "N": 4096, "D": 128, "causal": False}
    records = [{"op": Op.ABSORBED, "impl": impl, "shape": {**shape, "dropout_p": p}, "dtype": "bfloat16", "us": t}
               for (impl, p), t in us.items()]
    return Results(Benchmark.FLASH_ATTENTION, "synthetic", {}, {}, records, {})


def test_the_scale_and_dropout_verdicts_follow_the_records(monkeypatch):
    folded, sdpa = random.uniform(500, 1500), random.uniform(500, 1500)
    us = {(Impl.LESSONLIB, 0.0): folded, (Impl.PRESCALED_Q, 0.0): folded * 1.05,
          (Impl.SDPA_FLASH, 0.0): sdpa, (Impl.SDPA_FLASH, 0.1): sdpa * 1.2,
          (Impl.SDPA_MATH, 0.0): sdpa * 10, (Impl.SDPA_MATH, 0.1): sdpa * 14,
          (Impl.SDPA_CUDNN, 0.0): sdpa, (Impl.SDPA_CUDNN, 0.1): None}
    monkeypatch.setattr(recorded, "committed_run", lambda benchmark: _absorbed_run(us))
    scale = recorded.softmax_scale()
    assert scale.verdict.startswith("holds") and "+5%" in scale.measured and "µs" in scale.measured
    assert f"+{2 * 2 * 32 * 4096 * 128 * 2 / 1e6:.0f} MB" in scale.measured  # Q read and written once more, bf16
    drop = recorded.dropout()
    assert drop.verdict.startswith(f"holds at {Impl.SDPA_FLASH}") and Impl.SDPA_MATH not in drop.verdict.split(";")[0]
    assert "+20%" in drop.measured and "+40%" in drop.measured and f"refused: {Impl.SDPA_CUDNN}" in drop.measured
    us[(Impl.PRESCALED_Q, 0.0)] = folded * 0.99  # a pass of its own measured no slower: the verdict says so
    assert "no gain measured" in recorded.softmax_scale().verdict


def test_a_percentage_claim_holds_only_where_the_measured_value_is_in_its_range():
    assert claims.in_range({"a": 0.12, "b": 0.14}, 0.10, 0.15) == "holds at every measured point"
    assert claims.in_range({"a": 0.68, "b": -0.01}, 0.10, 0.15) == "does not hold at any measured point"
    assert claims.in_range({"a": 0.42, "b": 0.79}, 0.0, 0.70) == "holds at a; not at b"


def test_allocated_bytes_counts_new_tensors_not_views():
    x = torch.randn(10, 7)
    assert live.allocated_bytes(lambda t: t * 2, x) == 10 * 7 * 4
    assert live.allocated_bytes(lambda t: t.view(7, 10).t(), x) == 0
    assert live.allocated_bytes(lambda t: t.mul_(2), x) == 0


def test_the_live_checks_decide_their_claims():
    assert live.additive_mask().verdict.startswith("holds")
    assert live.linear_memory().verdict.startswith("holds")  # the kernel's bytes linear, naive's quadratic
    assert live.op_order().verdict.startswith("holds")
    assert live.paging_quadratic().verdict.startswith("does not hold")
    assert live.paging_waste().verdict == "holds"


def test_the_rope_kv_write_verdict_follows_the_records(monkeypatch):
    separate = random.uniform(10, 20)
    records = [{"op": Op.ROPE_STORE_KV, "impl": impl, "shape": {"T": t, "H": 32, "Hkv": 8, "D": 128},
                "dtype": "bfloat16", "us": us}
               for t, fused in ((1, separate * 0.5), (4096, separate * 1.1))
               for impl, us in ((Impl.LESSONLIB, fused), (Impl.APPLY_ROPE_THEN_STORE_KV, separate))]
    monkeypatch.setattr(recorded, "committed_run",
                        lambda benchmark: Results(benchmark, "synthetic", {}, {}, records, {}))
    verdict = recorded.rope_kv_write()
    assert verdict.verdict.startswith("holds at T=1/D=128; not at T=4,096/D=128"), verdict
    assert "-50% (T=1/D=128)" in verdict.measured and "+10% (T=4,096/D=128)" in verdict.measured
    monkeypatch.setattr(recorded, "committed_run", lambda benchmark: None)
    assert recorded.rope_kv_write().verdict.startswith("not yet measured on a GPU")


def _launch_run(eager_us: dict, fused_share: dict) -> Results:
    """A launch-bound attention run: eager's time per T, and each fused impl's time as a share of it."""
    records = []
    for t, us in eager_us.items():
        shape = {"B": 1, "H": 8, "T": t, "D": 64, "causal": True}
        records.append({"op": Op.LAUNCH_BOUND_ATTENTION, "impl": Impl.EAGER_ATTENTION, "shape": shape,
                        "dtype": "bfloat16", "us": us, "graph_us": us / 4, "launches": 5})
        records += [{"op": Op.LAUNCH_BOUND_ATTENTION, "impl": impl, "shape": shape, "dtype": "bfloat16",
                     "us": us * share[t], "graph_us": us / 5, "launches": 1} for impl, share in fused_share.items()]
    return Results(Benchmark.ATTENTION_LAUNCHES, "synthetic", {}, {}, records, {})


def test_the_seventy_percent_verdict_follows_the_launch_bound_records(monkeypatch):
    eager = {t: random.uniform(20, 40) for t in (16, 256, 1024)}
    shares = {Impl.LESSONLIB: {16: 0.28, 256: 0.5, 1024: 0.9}, Impl.SDPA_FLASH: {16: 0.4, 256: 0.6, 1024: 0.95}}
    monkeypatch.setattr(recorded, "committed_run", lambda benchmark: _launch_run(eager, shares))
    verdict = recorded.launch_cut()
    assert verdict.verdict.startswith(f"holds: {Impl.LESSONLIB} cuts up to 72%"), verdict
    assert "72% (T=16)" in verdict.measured and "10% (T=1024)" in verdict.measured and "60% (T=16)" in verdict.measured
    shares[Impl.LESSONLIB][16] = 0.36  # now the best cut is 64%: short of "up to 70%"
    verdict = recorded.launch_cut()
    assert verdict.verdict.startswith(f"does not hold: the largest cut measured is 64% ({Impl.LESSONLIB})"), verdict


def _extras_run(us: dict) -> Results:
    """A fusion-extras run: bias_swiglu at T=8192 and dequant_matmul at M=1 and 2048, times from ``us``."""
    bias = [{"op": Op.BIAS_SWIGLU, "impl": impl, "shape": {"T": 8192, "I": 14336}, "dtype": "bfloat16", "us": t}
            for impl, t in us["bias"].items()]
    layer = [{"op": Op.DEQUANT_MATMUL, "impl": impl, "shape": {"M": m, "N": 14336, "K": 4096}, "dtype": "bfloat16",
              "us": t} for m, peers in us["layer"].items() for impl, t in peers.items()]
    return Results(Benchmark.FUSION_EXTRAS, "synthetic", {}, {}, bias + layer, {})


def test_the_bias_and_dequantisation_verdicts_follow_the_records(monkeypatch):
    fused, eager = random.uniform(100, 200), random.uniform(400, 600)
    us = {"bias": {Impl.LESSONLIB: fused, Impl.EAGER: eager, Impl.COMPILE: fused * 1.1},
          "layer": {1: {Impl.LESSONLIB: 20.0, Impl.EAGER: 80.0, Impl.LINEAR_16BIT: 30.0},
                    # ahead of eager, behind the 16-bit GEMM: the claim does not hold here (its peer is the GEMM)
                    16: {Impl.LESSONLIB: 50.0, Impl.EAGER: 330.0, Impl.LINEAR_16BIT: 40.0},
                    2048: {Impl.LESSONLIB: 900.0, Impl.EAGER: 800.0, Impl.LINEAR_16BIT: 600.0}}}
    monkeypatch.setattr(recorded, "committed_run", lambda benchmark: _extras_run(us))
    bias = recorded.bias_activation_mul()
    assert bias.verdict == "holds" and f"{eager / fused:.1f}x eager" in bias.measured and "1.10x torch.compile" in bias.measured
    layer = recorded.dequant_matmul()
    assert layer.verdict.startswith("holds at M=1; not at M=16, M=2048"), layer
    assert "M=1: 20.0 µs, F.linear 30.0 µs (1.50x faster)" in layer.measured
    assert "M=16: 50.0 µs, F.linear 40.0 µs (1.25x slower)" in layer.measured
    for peers in us["layer"].values():  # the int8 kernel ahead of the 16-bit GEMM everywhere: holds everywhere
        peers[Impl.LESSONLIB] = peers[Impl.LINEAR_16BIT] * 0.9
    assert recorded.dequant_matmul().verdict.startswith("holds at every measured M")
    us["bias"][Impl.LESSONLIB] = eager * 1.2  # the fused kernel measured behind eager: the verdict says so
    assert recorded.bias_activation_mul().verdict.startswith("does not hold")
