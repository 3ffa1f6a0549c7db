"""The kernel exercises (notebooks 01, 02, 03, 05): the instructor's solution, taken from the notebook
itself, passes its checker; the stub the student copy gets fails with "not implemented yet"; planted mistakes,
each made by editing one line of the solution, fail with a message that names the mistake. Kept small for the
interpreter: the checkers stop at the first failing case, which comes early for every planted mistake."""

import linecache
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from lessonlib import exercises, hints, runtime
from lessonlib.exercises import ExerciseFailed
from lessonlib.ops.flash_attention import flash_attention_dtypes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import make_student_notebooks as gen  # noqa: E402


def solution_source(notebook: str, name: str) -> str:
    """The source of the notebook cell that defines ``name`` (the exercise's solution cell)."""
    cells = [c.source for c in nbformat.read(ROOT / "notebooks" / notebook, as_version=4).cells
             if c.cell_type == "code" and f"def {name}(" in c.source]
    assert len(cells) == 1, f"{notebook}: {len(cells)} cells define {name}"
    return cells[0]


# What the notebook has imported by the time the solution cell runs.
PRELUDE = "import torch\nimport triton\nimport triton.language as tl\nfrom lessonlib import exercises, reference\n"


def define(source: str, name: str):
    """Run a cell's source as the notebook would (registered with linecache, so Triton can read the kernel's source)."""
    source = PRELUDE + source
    filename = f"<exercise-cell-{abs(hash(source))}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def observed(interpreter: str, gpu: str) -> str:
    """The message a planted access mistake must give: Triton's interpreter records every load and store and names
    the line; a GPU sees only what lands in the guard zones (exercises._guards.GPU_NOTE says so to the student)."""
    return interpreter if runtime.mode() == "interpreter" else gpu


def mutated(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, f"the planted mistake no longer applies: {old!r}"
    return source.replace(old, new)


EXERCISES = {  # checker, notebook, name
    "swiglu": (exercises.check_swiglu, "01_operator_fusion.ipynb", "my_swiglu_kernel"),
    "add_rms_norm": (exercises.check_add_rms_norm, "01_operator_fusion.ipynb", "my_add_rms_norm_kernel"),
    "flash_forward": (exercises.check_flash_forward_kernel, "02_flash_attention.ipynb", "my_flash_forward_kernel"),
    "paged_decode": (exercises.check_paged_decode_kernel, "03_paged_attention.ipynb", "my_paged_decode_kernel"),
    "rope": (exercises.check_rope_kernel, "03_paged_attention.ipynb", "my_rope_kernel"),
    "rope_store_kv": (exercises.check_rope_store_kv_kernel, "03_paged_attention.ipynb", "my_rope_store_kv_kernel"),
    "graph_safe_decode_step": (exercises.check_graph_safe_decode_step, "05_cuda_graphs.ipynb",
                               "my_graph_safe_decode_step"),
}


@pytest.mark.parametrize("exercise", EXERCISES)
def test_solution_passes_and_stub_fails(exercise, capsys):
    check, notebook, name = EXERCISES[exercise]
    source = solution_source(notebook, name)
    check(define(source, name))
    assert f"{exercise}:" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        check(define(gen.strip_solutions(source), name))


PLANTED = [  # exercise, (old line fragment, new), what the message must name
    ("add_rms_norm", ("tl.sum(h * h, axis=0) / n_cols", "tl.sum(h * h, axis=0) / BLOCK"),
     "mean of squares over BLOCK = 128 .*divide the sum of squares by the row's length"),
    ("flash_forward", ("acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot"), "rescales l but not acc"),
    ("flash_forward", ("l_i = l_i * alpha + tl.sum", "l_i = l_i + tl.sum"), "rescales acc but not l"),
    ("flash_forward", ("(cols[None, :] <= offs_m[:, None] + n_kv - n_q)", "(cols[None, :] < offs_m[:, None] + n_kv - n_q)"),
     "causal mask off by one"),
    ("flash_forward", ("tl.minimum(start_m + BLOCK_M, n_q) + n_kv - n_q)", "tl.minimum(start_m + BLOCK_M, n_q) + n_kv - n_q - 1)"),
     "loop that stops one key early"),
    ("flash_forward", ("visible = cols[None, :] < n_kv\n", "visible = cols[None, :] >= 0\n"), "without a bounds mask"),
    ("paged_decode", ("rows = (physical * PAGE_SIZE", "rows = (logical * PAGE_SIZE"), "logical block index"),
    ("paged_decode", ("block_table_ptr + seq * max_blocks + logical", "block_table_ptr + logical"), "sequence 0's row"),
    ("paged_decode", ("* kv_heads + kv_head\n", "* kv_heads + head\n"), "query head instead of its KV head"),
    ("rope", ("(x1 * cos1 - x2 * sin1)", "(x1 * cos1 + x2 * sin1)"), "first half computed as x1 \\* cos \\+ x2"),
    ("rope", ("tl.store(out_ptr + row, ", "tl.store(out_ptr + row + HALF, "), "left some elements unwritten"),
    ("rope", ("mask = (h < n_heads) & (d < HALF)", "mask = (h < n_heads) & (d < BLOCK_HALF)"),
     "outside out were written"),
    ("rope_store_kv", ("(k2 * cos2 + k1 * sin2)", "(k2 * cos2 - k1 * sin2)"), "the K in the cache.*second half"),
    ("rope_store_kv", ("cache_row = (slot * n_kv_heads", "cache_row = (token * n_kv_heads"), "belongs to another token"),
    ("graph_safe_decode_step", ("    ### BEGIN SOLUTION\n", "    ### BEGIN SOLUTION\n    return out.copy_(exercises.eager_decode_step(q, k_new, v_new, k_cache, v_cache, lengths))\n"),
     "reads a tensor's value on the CPU"),
    ("graph_safe_decode_step", ("    out.copy_(reference", "    out = torch.empty_like(out)\n    out.copy_(reference"), "not `out`"),
    ("graph_safe_decode_step", ("    lengths += 1", "    lengths = lengths + 1"), "advance it in place"),
    ("graph_safe_decode_step", ("rows = torch.arange(batch, device=q.device)", "rows = torch.tensor(list(range(batch)))"),
     "builds a tensor from Python data"),
    ("graph_safe_decode_step", ("<= lengths[:, None]", "< lengths[:, None]"), "max error"),
]


MISSING_MASKS = [  # exercise, edits (applied in turn) that drop a mask, what the message must name
    ("swiglu", [("tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)",
                 "tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty))")], "outside out were written"),
    ("swiglu", [(", mask=mask)", ")")] * 3, "outside out were written"),  # the crash of issue 22: no mask at all
    ("add_rms_norm", [("r = tl.load(residual_ptr + row * n_cols + cols, mask=mask, other=0.0)",
                       "r = tl.load(residual_ptr + row * n_cols + cols)")], "outside residual were read"),
    ("add_rms_norm", [("tl.store(residual_out_ptr + row * n_cols + cols, h, mask=mask)",
                       "tl.store(residual_out_ptr + row * n_cols + cols, h)")], "outside residual_out were written"),
    ("flash_forward", [("v = tl.load(v_rows + cols[:, None] * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < n_kv, "
                        "other=0.0)", "v = tl.load(v_rows + cols[:, None] * HEAD_DIM + offs_d[None, :])")],
     "outside v were read"),
    # A walk one logical block ahead reads the table's -1 past the sequence's blocks; without the pool-bounds mask
    # that row -1 is read from before the cache.
    ("paged_decode", [("block_table_ptr + seq * max_blocks + logical)", "block_table_ptr + seq * max_blocks + logical + 1)"),
                      (" & (rows >= 0) & (rows < pool_rows)", "")], "outside k_cache and v_cache were read"),
    ("rope", [("tl.store(out_ptr + row + HALF, (x2 * cos2 + x1 * sin2).to(out_ptr.dtype.element_ty), mask=mask)",
               "tl.store(out_ptr + row + HALF, (x2 * cos2 + x1 * sin2).to(out_ptr.dtype.element_ty))")],
     "outside out were written"),
    ("rope_store_kv", [("tl.store(q_out_ptr + q_row + HALF, (q2 * cos2 + q1 * sin2).to(q_out_ptr.dtype.element_ty), "
                        "mask=q_mask)", "tl.store(q_out_ptr + q_row + HALF, (q2 * cos2 + q1 * sin2).to("
                        "q_out_ptr.dtype.element_ty))")], "outside q_out were written"),
]


@pytest.mark.parametrize("exercise, edits, message", MISSING_MASKS, ids=[f"{m[0]}-{m[2]}" for m in MISSING_MASKS])
def test_missing_mask_is_named_and_the_process_survives(exercise, edits, message):
    """Issue 22: in the interpreter a store without its mask corrupted memory and killed the notebook's kernel.
    On guarded buffers the access lands in a guard zone, and the checker names it; this test's process going on to
    the next test is the "stays alive" part."""
    check, notebook, name = EXERCISES[exercise]
    source = solution_source(notebook, name)
    for old, new in edits:
        assert old in source, f"the planted missing mask no longer applies: {old!r}"
        source = source.replace(old, new, 1)
    with pytest.raises(ExerciseFailed, match=f"{message}.*missing mask"):
        check(define(source, name))


def test_a_launcher_called_directly_in_the_interpreter_guards_its_output():
    """A student timing or trying their kernel through the launcher, not the checker: in the interpreter the
    launcher's output still sits between guards, so a store without its mask is named, not a crashed kernel."""
    if runtime.on_gpu():
        pytest.skip("on a GPU a direct launch allocates no guards (timing stays clean); the checkers still do")
    _, notebook, name = EXERCISES["swiglu"]
    source = mutated(solution_source(notebook, name), "out.to(out_ptr.dtype.element_ty), mask=mask)",
                     "out.to(out_ptr.dtype.element_ty))")
    gate = torch.randn(5, 7, device=runtime.device())
    with pytest.raises(ExerciseFailed, match="elements 35..1023 outside out were written"):
        exercises.swiglu(define(source, name), gate, gate)


def test_flash_forward_that_masks_but_never_skips_is_refused():
    """Causal: a kernel whose loop visits every key tile and hides the invisible ones gives the right values; the
    checker must still refuse it, since skipping those tiles is the exercise."""
    check, notebook, name = EXERCISES["flash_forward"]
    source = mutated(solution_source(notebook, name), "hi = tl.minimum(n_kv, tl.minimum(start_m + BLOCK_M, n_q) + n_kv - n_q)",
                     "hi = n_kv")
    with pytest.raises(ExerciseFailed, match=observed("visited .* key tiles above the diagonal",
                                                      "does not skip the key tiles above the diagonal.*NaN")):
        check(define(source, name))


def test_exercise_failed_renders_as_its_message_in_ipython():
    """One clear line in a notebook, not a traceback through lessonlib's checker."""
    lines = ExerciseFailed("swiglu: not implemented yet\n  on inputs of shapes (1, 1)")._render_traceback_()
    assert len(lines) == 2 and "swiglu: not implemented yet" in lines[0] and "File" not in "".join(lines)


@pytest.mark.parametrize("exercise, edit, message", PLANTED, ids=[f"{p[0]}-{p[2][:30]}" for p in PLANTED])
def test_planted_mistake_is_named(exercise, edit, message):
    check, notebook, name = EXERCISES[exercise]
    source = mutated(solution_source(notebook, name), *edit)
    with pytest.raises(ExerciseFailed, match=message):
        check(define(source, name))


def test_graph_safe_step_whose_shapes_change_is_refused():
    """A step with the right values and no host read, which also slices with a Python counter: its shapes change
    every call, and a graph would replay the first call's shapes forever."""
    check, notebook, name = EXERCISES["graph_safe_decode_step"]
    source = mutated(solution_source(notebook, name), "    lengths += 1",
                     "    CALLS.append(1)\n    k_cache[:, :, : len(CALLS)].sum()\n    lengths += 1")
    with pytest.raises(ExerciseFailed, match="other operations than step 1"):
        check(define("CALLS = []\n" + source, name))


def test_launchers_refuse_bad_input_before_launching():
    device, dtype = runtime.device(), runtime.supported_dtypes()[0]
    # flash_attention takes fewer dtypes (no float32 on a GPU): one it takes, so that the heads are what is refused
    q = torch.randn(1, 2, 5, 16, device=device, dtype=flash_attention_dtypes()[0])
    with pytest.raises(ValueError, match="multiple"):
        exercises.flash_forward(None, q, q[:, :1].expand(1, 3, 5, 16), q[:, :1].expand(1, 3, 5, 16))
    x = torch.randn(3, 2, 8, device=device, dtype=dtype)
    with pytest.raises(ValueError, match="cos and sin"):
        exercises.rope(None, x, torch.randn(3, 6, device=device, dtype=dtype), torch.randn(3, 6, device=device, dtype=dtype))
    cache = torch.randn(2, 4, 2, 8, device=device, dtype=dtype)
    cos = torch.randn(3, 8, device=device, dtype=dtype)
    slots = torch.tensor([0, 1, 1], device=device)
    with pytest.raises(ValueError, match="distinct"):
        exercises.rope_store_kv(None, x, x, x, cos, cos, cache, cache.clone(), slots)


def test_hints_are_revealed_one_at_a_time(capsys):
    for exercise, texts in hints.HINTS.items():
        hints.hint(exercise, 1)
        out = capsys.readouterr().out
        assert f"Hint 1 of {len(texts)}" in out and texts[0] in out and (len(texts) == 1 or texts[1] not in out)
    with pytest.raises(KeyError, match="no hints"):
        hints.hint("nonexistent")
    with pytest.raises(ValueError, match="hints 1 to"):
        hints.hint("rope", 99)


def test_rope_store_kv_bytes_counts_the_round_trip_of_k():
    moved = exercises.rope_store_kv_bytes(tokens=10, heads=4, kv_heads=2, head_dim=8, itemsize=2)
    k_bytes = 10 * 2 * 8 * 2
    assert moved["separate"] - moved["fused"] == 2 * k_bytes  # k_rot written by apply_rope, read by store_kv
