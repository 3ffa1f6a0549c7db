"""Lesson 00's Triton on-ramp (issue 22): each puzzle's solution, taken from the notebook, passes its checker; the
student copy's stub fails with "not implemented yet"; a PyTorch function in place of the kernel is refused; planted
mistakes (a missing mask, a wrong stride, an off-by-one program id, a missing loop) fail with a message that names
them, and the store past the end they make lands in the checker's guard (the process stays alive to say so). The
address figure's data comes from the kernel itself."""

import pytest
import torch

from lessonlib import exercises, runtime, traffic
from lessonlib.exercises import ExerciseFailed
from tests.test_kernel_exercises import define, gen, mutated, observed, solution_source

NOTEBOOK = "00_setup_and_roofline.ipynb"
PUZZLES = {  # name: (checker, kernel defined by the solution cell)
    "scale_add": (exercises.check_scale_add_kernel, "my_scale_add_kernel"),
    "transpose": (exercises.check_transpose_kernel, "my_transpose_kernel"),
    "row_sum": (exercises.check_row_sum_kernel, "my_row_sum_kernel"),
}
# What the solution cell needs from the notebook's imports cell.
IMPORTS = "import triton\nimport triton.language as tl\n"


def kernel(source: str, name: str):
    return define(IMPORTS + source, name)


@pytest.mark.parametrize("puzzle", PUZZLES)
def test_solution_passes_stub_and_bypass_fail(puzzle, capsys):
    check, name = PUZZLES[puzzle]
    source = solution_source(NOTEBOOK, name)
    check(kernel(source, name))
    out = capsys.readouterr().out  # on a GPU the first guarded check says once what a GPU run cannot see
    assert out.startswith(f"✓ {puzzle}:") or out.startswith("(On a GPU") and f"\n✓ {puzzle}:" in out, out
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        check(kernel(gen.strip_solutions(source), name))
    with pytest.raises(ExerciseFailed, match="pass your @triton.jit kernel"):
        check(lambda *tensors: tensors[0])


PLANTED = [  # puzzle, (old, new), what the message must name
    ("scale_add", ("(alpha * x + y).to(out_ptr.dtype.element_ty), mask=mask)", "(alpha * x + y).to(out_ptr.dtype.element_ty))"),
     observed("outside out were written.*line 14 of my_scale_add_kernel.*mask=offsets < n",
              r"stored \d+ values outside out .*mask=offsets < n")),
    ("scale_add", ("offsets = tl.program_id(0) * BLOCK", "offsets = (tl.program_id(0) + 1) * BLOCK"),
     "one program late"),
    ("scale_add", ("offsets = tl.program_id(0) * BLOCK + tl.arange", "offsets = tl.program_id(0) + tl.arange"),
     "cover its own BLOCK elements"),
    ("scale_add", ("(alpha * x + y)", "(x + y)"), "ignores alpha"),
    ("transpose", ("rows[:, None] * stride_xm", "rows[:, None] * N"), "loaded x's padding.*stride_xm"),
    ("transpose", ("mask = (rows[:, None] < M) & (cols[None, :] < N)", "mask = cols[None, :] < N"),
     observed("outside out were written.*missing mask.*both dimensions",
              r"stored \d+ values outside out's \(N, M\) elements.*both dimensions")),
    ("transpose", ("rows = tl.program_id(0) * BLOCK_M", "rows = tl.program_id(1) * BLOCK_M"), "never stored"),
    ("row_sum", ("for start in range(0, N, BLOCK_N):", "for start in range(0, BLOCK_N, BLOCK_N):"),
     "sums only the first BLOCK_N"),
    ("row_sum", ("mask=cols < N, other=0.0", "mask=cols >= 0"), "without mask=cols < N"),
    ("row_sum", ("x_ptr + row * stride_xm", "x_ptr + row * N"), "rows to be N elements apart"),
]


@pytest.mark.parametrize("puzzle, edit, message", PLANTED, ids=[f"{p[0]}-{p[2][:24]}" for p in PLANTED])
def test_planted_mistake_is_named(puzzle, edit, message):
    check, name = PUZZLES[puzzle]
    with pytest.raises(ExerciseFailed, match=message):
        check(kernel(mutated(solution_source(NOTEBOOK, name), *edit), name))


def test_launchers_refuse_bad_input_before_launching():
    with pytest.raises(ValueError, match="1-D"):
        exercises.scale_add(None, torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="2-D"):
        exercises.transpose(None, torch.zeros(3))
    with pytest.raises(ValueError, match="unit column stride"):
        exercises.row_sum(None, torch.zeros(4, 3).T)


def test_program_owners_is_measured_on_the_kernel():
    """The figure's data: the right kernel gives each block to its program and leaves padding unread; a kernel
    without its store mask shows writes past the end (recorded, not performed: this process goes on); a wrong
    stride shows reads of the padding."""
    name = "my_scale_add_kernel"
    source = solution_source(NOTEBOOK, name)
    vector = exercises.program_owners(kernel(source, name), "scale_add", 20, block=dict(BLOCK=8))
    guard = vector["guard"]
    assert vector["out"][guard:guard + 20].tolist() == [i // 8 for i in range(20)]
    assert vector["x"][guard:guard + 20].tolist() == [i // 8 for i in range(20)]
    assert (vector["out"][guard + 20:] == -1).all() and (vector["out"][:guard] == -1).all()
    assert not vector["findings"] and vector["outside"] in ({"x": 0, "out": 0}, {"x": -1, "out": -1})
    unmasked = mutated(source, "(alpha * x + y).to(out_ptr.dtype.element_ty), mask=mask)",
                       "(alpha * x + y).to(out_ptr.dtype.element_ty))")
    spilled = exercises.program_owners(kernel(unmasked, name), "scale_add", 20, block=dict(BLOCK=8))
    assert spilled["out"][guard + 20:guard + 24].tolist() == [2, 2, 2, 2]  # the last program's lanes 20..23
    if not runtime.on_gpu():
        assert spilled["outside"]["out"] == 4 and "outside out were written" in spilled["findings"][0]

    name = "my_transpose_kernel"
    source = solution_source(NOTEBOOK, name)
    tile = exercises.program_owners(kernel(source, name), "transpose", (6, 10), block=dict(BLOCK_M=4, BLOCK_N=4))
    rows, cols = torch.arange(6)[:, None], torch.arange(10)[None, :]
    assert torch.equal(tile["x"][:6, :10], (rows // 4) * 3 + cols // 4)
    assert (tile["x"][:, 10:] == -1).all() and (tile["out"][:, 6:] == -1).all()
    assert (tile["x"][6:] == -1).all() and (tile["out"][10:] == -1).all()  # nothing past the end
    assert torch.equal(tile["out"][:10, :6], tile["x"][:6, :10].T)
    strided = kernel(mutated(source, "rows[:, None] * stride_xm", "rows[:, None] * N"), name)
    wrong = exercises.program_owners(strided, "transpose", (6, 10), block=dict(BLOCK_M=4, BLOCK_N=4))
    assert (wrong["x"][:, 10:] >= 0).any()  # rows taken N apart reach into the padding
    no_masks = kernel(source.replace(", mask=mask)", ")"), name)  # what the lesson invites: remove the masks
    reach = exercises.program_owners(no_masks, "transpose", (6, 10), block=dict(BLOCK_M=4, BLOCK_N=4))
    assert (reach["x"][6:8, :12] >= 0).all()  # rows 6, 7 of the last row of tiles, columns up to 11
    if not runtime.on_gpu():
        assert reach["outside"]["x"] > 0 and reach["outside"]["out"] > 0


# --- "Predict, then measure" (lessons 01, 02, 03, 05) ---------------------------------------------------------

from lessonlib.exercises import predictions  # noqa: E402

PREDICTIONS = {  # name: (checker, notebook, function)
    "swiglu_ratio": (exercises.check_swiglu_ratio, "01_operator_fusion.ipynb", "my_swiglu_ratio"),
    "causal_speedup": (exercises.check_causal_speedup, "02_flash_attention.ipynb", "my_causal_speedup"),
    "gather_ratio": (exercises.check_gather_ratio, "03_paged_attention.ipynb", "my_gather_ratio"),
    "graph_saving": (exercises.check_graph_saving, "05_cuda_graphs.ipynb", "my_graph_saving"),
}


@pytest.mark.parametrize("item", PREDICTIONS)
def test_prediction_solution_passes_and_stub_fails(item, capsys):
    check, notebook, name = PREDICTIONS[item]
    source = solution_source(notebook, name)
    check(define(source, name))
    out = capsys.readouterr().out
    assert out.startswith(f"✓ {item}: predicted") and "recorded H200 run measured" in out and "band is ±" in out
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        check(define(gen.strip_solutions(source), name))


WRONG_PREDICTIONS = [  # item, (old, new) in the solution, what the message must name
    ("swiglu_ratio", ("extra = tensor + tensor", "extra = tensor"), "counting the intermediate once"),
    ("swiglu_ratio", ("extra_us = extra / (copy_gbps * 1e3)", "extra_us = extra / copy_gbps"), "nanoseconds"),
    ("swiglu_ratio", ("predicted = (fused_us + extra_us) / fused_us", "predicted = 5 / 3"), "the byte ratio alone"),
    ("swiglu_ratio", ("measured = eager_us / fused_us", "measured = fused_us / eager_us"), "upside down"),
    ("causal_speedup", ("predicted = query_tiles * key_tiles / causal_tiles", "predicted = 2.0"),
     "ignoring the diagonal tiles"),
    ("causal_speedup", ("-(-min((i + 1) * block_m, tokens) // block_n)", "min((i + 1) * block_m, tokens) // block_n"),
     "one key tile early"),
    ("gather_ratio", ("gathered = (kv + kv) + (kv + q_out)", "gathered = kv + (kv + q_out)"), "the copy's write"),
    ("graph_saving", ("predicted = launches * launch_us", "predicted = launch_us"), "one launch's cost alone"),
    ("graph_saving", ("measured = fused_us - graph_us", "measured = 363.36"), "the timings give"),
]


@pytest.mark.parametrize("item, edit, message", WRONG_PREDICTIONS, ids=[f"{w[0]}-{w[2][:20]}" for w in WRONG_PREDICTIONS])
def test_wrong_prediction_is_named(item, edit, message):
    check, notebook, name = PREDICTIONS[item]
    with pytest.raises(ExerciseFailed, match=message):
        check(define(mutated(solution_source(notebook, name), *edit), name))


def test_typed_numbers_fail_on_the_made_up_cases():
    """The recorded answers typed in pass the recorded case and fail the next, made-up one."""
    recorded = predictions.GRAPH.recorded()
    typed = (predictions.GRAPH.predict(**recorded), predictions.GRAPH.measure(**recorded))
    with pytest.raises(ExerciseFailed, match="launches="):
        exercises.check_graph_saving(lambda **_: typed)


def test_swiglu_prediction_is_not_the_printed_byte_ratio():
    """The byte ratio 5/3 (printed by two earlier cells) is a named mistake, and the band's reason holds on the
    recorded run: each chain within 5% of the copy rate, eager's bytes counted as the lesson counts them."""
    with pytest.raises(ExerciseFailed, match="the byte ratio alone"):
        exercises.check_swiglu_ratio(lambda eager_us, fused_us, **_: (5 / 3, eager_us / fused_us))
    r = predictions.SWIGLU.recorded()
    model = traffic.swiglu(r["tokens"], r["intermediate"], r["itemsize"])
    for nbytes, us in ((model.eager.bytes, r["eager_us"]), (model.fused.bytes, r["fused_us"])):
        assert abs(nbytes / (us * 1e3) / r["copy_gbps"] - 1) <= 0.05


def test_a_recorded_run_outside_its_band_fails(monkeypatch):
    """If the recorded measurement left the model's band, the item says so rather than passing."""
    check, notebook, name = PREDICTIONS["gather_ratio"]
    recorded = predictions.GATHER.recorded()
    far = dict(recorded, gather_us=2 * recorded["gather_us"])  # measured 6x against a predicted 3x
    monkeypatch.setattr(predictions, "GATHER", predictions.dataclasses_replace(predictions.GATHER, recorded=lambda: far))
    with pytest.raises(ExerciseFailed, match="outside the band"):
        predictions.check_gather_ratio(define(solution_source(notebook, name), name))


# --- Lesson 02's backward exercise: dK and dV for one key tile -------------------------------------------------

DKDV = "my_flash_dkdv_kernel"
DKDV_PLANTED = [  # (old, new), what the message must name
    (("    dk = dk * sm_scale\n", ""), "without the final scale"),
    (("ds = p * (dp - delta[:, None])", "ds = p * dp"), "without subtracting delta"),
    (("s = tl.dot(q, tl.trans(k)) * sm_scale", "s = tl.dot(q, tl.trans(k))"), "without sm_scale"),
    (("p = tl.exp(s - lse[:, None])", "p = tl.exp(s)"), "not normalised"),
    (("for start_m in range(0, n_q, BLOCK_M):", "for start_m in range(0, BLOCK_M, BLOCK_M):"),
     "first query tile only"),
    (("dk.to(dk_ptr.dtype.element_ty), mask=key_rows)", "dk.to(dk_ptr.dtype.element_ty))"),
     observed("outside dk were written.*missing mask.*keys < n_kv", r"stored \d+ values outside dk .*keys < n_kv")),
]


def test_dkdv_solution_passes_stub_and_bypass_fail(capsys):
    source = solution_source("02_flash_attention.ipynb", DKDV)
    exercises.check_flash_dkdv_kernel(define(source, DKDV))
    assert "flash_dkdv: your kernel's dK and dV match" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        exercises.check_flash_dkdv_kernel(define(gen.strip_solutions(source), DKDV))
    with pytest.raises(ExerciseFailed, match="pass your @triton.jit kernel"):
        exercises.check_flash_dkdv_kernel(lambda q, k, v, do: (k, v))


@pytest.mark.parametrize("edit, message", DKDV_PLANTED, ids=[p[1][:24] for p in DKDV_PLANTED])
def test_dkdv_planted_mistake_is_named(edit, message):
    source = mutated(solution_source("02_flash_attention.ipynb", DKDV), *edit)
    with pytest.raises(ExerciseFailed, match=message):
        exercises.check_flash_dkdv_kernel(define(source, DKDV))


def test_dkdv_launcher_refuses_bad_input_before_launching():
    q = torch.randn(1, 2, 5, 16, device=runtime.device()).half()  # float16 runs in the interpreter and on any GPU
    with pytest.raises(ValueError, match="q's heads"):
        exercises.flash_dkdv(None, q, q[:, :1], q[:, :1], q)


def test_band_reasons_hold_on_the_recorded_runs():
    """Each band's stated reason, checked against the files it is about (a stale reason fails here)."""
    from lessonlib import results, traffic
    from lessonlib.results import Impl, Op, Regime

    fusion, flash, paged = (results.load(f"{name}-h200") for name in ("fusion", "flash-attention", "paged-attention"))
    # swiglu: every kernel over 200 MB; both chains within about 7% of the copy bandwidth, on their own bytes
    model = traffic.swiglu(8192, 14336)
    assert min(k.bytes for k in model.eager.kernels + model.fused.kernels) > 200e6
    for chain, impl in ((model.eager, Impl.EAGER), (model.fused, Impl.LESSONLIB)):
        us = [r for r in fusion.select(op=Op.SWIGLU, impl=impl, T=8192, I=14336) if "regime" not in r][0]["us"]
        assert abs(chain.bytes / us / 1e3 / fusion.ceilings["bandwidth_gbs"] - 1) < 0.07
    # causal: compute-bound at N = 8192 (over 400 TFLOP/s); one kernel timed several times spreads about 5%
    assert flash.one(op=Op.FORWARD, impl=Impl.LESSONLIB, B=2, N=8192, D=128, causal=False)["tflops"] > 400
    same = [r["us"] for r in flash.records if r["shape"].get("N") == 4096 and r["shape"].get("B") == 2
            and r["shape"].get("D") == 128 and not r["shape"].get("causal") and not r["shape"].get("dropout_p")
            and r["impl"] in (Impl.LESSONLIB, results.sweep_label(flash.notes["default_configs"]["D=128"]["forward"]))
            and r["op"] in (Op.FORWARD, Op.FORWARD_VARIANT, Op.ABSORBED)]
    assert len(same) == 4 and 0.03 < max(same) / min(same) - 1 < 0.07
    # gather: 537 MB of K and V, over 100 µs, both paths at 85 to 90% of the copy bandwidth on their own bytes
    shape = dict(B=32, context=4096, H=32, Hkv=8, D=128)
    gather, direct = (paged.one(op=Op.PAGED_ATTENTION, impl=i, **shape) for i in (Impl.GATHER_THEN_SDPA, Impl.LESSONLIB))
    assert round(direct["bytes"] / 1e6) == 537 and direct["us"] > 100
    for trips, record in ((3, gather), (1, direct)):
        assert 0.85 <= trips * record["bytes"] / record["us"] / 1e3 / paged.ceilings["bandwidth_gbs"] <= 0.90
    # graph: lessonlib's add_rms_norm costs the host about 50 µs per call at T = 1
    launch = fusion.one(op=Op.LAUNCH_OVERHEAD, impl=Impl.OPS_ADD_RMS_NORM, regime=Regime.PER_CALL)
    assert 45 < launch["us"] < 55
