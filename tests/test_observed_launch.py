"""Issue 41: a kernel exercise's checker certifies the launch it observed. Every kernel exercise of lessons 00 to 03
refuses each fake (a look-alike object, a subclass of Triton's kernel class, a patched ``triton.jit``, lessonlib's
own kernel, a launch whose output is overwritten afterwards or from inside the kernel's Python body, a launch on
other tensors than the checker's), each of which would otherwise pass, since it runs the right kernel; and the
honest mistakes no output comparison shows are named from the recorded accesses. Interpreter only (a GPU records
nothing: its guard zones are tested in test_kernel_exercises.py). Each fake fails at the first, smallest case."""

import gc
import linecache

import pytest
import torch

from lessonlib import exercises, runtime
from lessonlib.exercises import ExerciseFailed, _observe
from lessonlib.exercises._observe import KernelRefused
from tests.test_kernel_exercises import PRELUDE, define, mutated, solution_source

pytestmark = pytest.mark.skipif(runtime.on_gpu(), reason="the recorder runs in Triton's interpreter")

EXERCISES = {  # checker, notebook, kernel, its output parameter
    "scale_add": (exercises.check_scale_add_kernel, "00_setup_and_roofline.ipynb", "my_scale_add_kernel", "out_ptr"),
    "transpose": (exercises.check_transpose_kernel, "00_setup_and_roofline.ipynb", "my_transpose_kernel", "out_ptr"),
    "row_sum": (exercises.check_row_sum_kernel, "00_setup_and_roofline.ipynb", "my_row_sum_kernel", "out_ptr"),
    "swiglu": (exercises.check_swiglu, "01_operator_fusion.ipynb", "my_swiglu_kernel", "out_ptr"),
    "add_rms_norm": (exercises.check_add_rms_norm, "01_operator_fusion.ipynb", "my_add_rms_norm_kernel", "out_ptr"),
    "flash_forward": (exercises.check_flash_forward_kernel, "02_flash_attention.ipynb", "my_flash_forward_kernel",
                      "out_ptr"),
    "flash_dkdv": (exercises.check_flash_dkdv_kernel, "02_flash_attention.ipynb", "my_flash_dkdv_kernel", "dk_ptr"),
    "paged_decode": (exercises.check_paged_decode_kernel, "03_paged_attention.ipynb", "my_paged_decode_kernel",
                     "out_ptr"),
    "rope": (exercises.check_rope_kernel, "03_paged_attention.ipynb", "my_rope_kernel", "out_ptr"),
    "rope_store_kv": (exercises.check_rope_store_kv_kernel, "03_paged_attention.ipynb", "my_rope_store_kv_kernel",
                      "q_out_ptr"),
}


def solution(exercise: str):
    _, notebook, name, _ = EXERCISES[exercise]
    return define(solution_source(notebook, name), name)


class LookAlike:
    """A duck-typed kernel: ``.fn`` and ``kernel[grid](...)``, running the real kernel (or anything in PyTorch)."""

    def __init__(self, real):
        self.fn, self.real = real.fn, real

    def __getitem__(self, grid):
        return self.real[grid]


def subclassed(real):
    class Mine(type(real)):
        def run(self, *args, **kwargs):
            return super().run(*args, **kwargs)

    return Mine(real.fn)


def overwritten_after_launch(monkeypatch):
    """The launch observed, then every tensor it wrote changed (a wrapper fixing up the output in PyTorch)."""
    real = _observe.launch_observed

    def wrapper(name, kernel, grid, *args, **meta):
        obs = real(name, kernel, grid, *args, **meta)
        for t in args:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.mul_(2).add_(1)
        return obs

    monkeypatch.setattr(_observe, "launch_observed", wrapper)


def launched_on_copies(monkeypatch):
    """The kernel launched on copies of the checker's tensors, the results copied back."""
    real = _observe.launch_observed

    def wrapper(name, kernel, grid, *args, **meta):
        copies = [_same_layout_copy(a) if isinstance(a, torch.Tensor) else a for a in args]
        obs = real(name, kernel, grid, *copies, **meta)
        for a, c in zip(args, copies):
            if isinstance(a, torch.Tensor):
                a.copy_(c)
        return obs

    monkeypatch.setattr(_observe, "launch_observed", wrapper)


def _same_layout_copy(a: torch.Tensor) -> torch.Tensor:
    storage = a.untyped_storage()
    copy = torch.empty(0, dtype=a.dtype, device=a.device)
    copy.set_(type(storage)(storage.nbytes(), device=a.device).copy_(storage), a.storage_offset(), a.size(), a.stride())
    return copy


def overwriting_from_the_body(exercise: str):
    """A genuine kernel whose Python body (the interpreter runs it as Python) rewrites its output in PyTorch after
    its stores: found by the address its output pointer holds."""
    _, notebook, name, output = EXERCISES[exercise]
    source = solution_source(notebook, name).rstrip() + f"\n    _overwrite({output})\n"
    source = PRELUDE + "from tests.test_observed_launch import _overwrite\n" + source
    filename = f"<exercise-cell-{abs(hash(source))}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def _overwrite(pointer):
    import warnings

    address = int(pointer.handle.data.reshape(-1)[0])
    with warnings.catch_warnings():  # isinstance on every live object wakes deprecated module attributes
        warnings.simplefilter("ignore")
        found = []
        for t in gc.get_objects():
            try:
                if isinstance(t, torch.Tensor):
                    found.append(t)
            except ReferenceError:  # a weak proxy whose object is gone (left by an earlier test)
                continue
    for t in found:
        try:
            mine = t.is_floating_point() and t.numel() and t.data_ptr() == address
        except (RuntimeError, ReferenceError):  # no storage (torch.compile's fake tensors, left by an earlier test)
            continue
        if mine:
            t.fill_(0.25)  # "the right answer", computed elsewhere


FAKES = ["look-alike", "subclass", "patched triton.jit", "lessonlib's kernel", "overwritten after the launch",
         "overwritten from the body", "launched on copies"]


@pytest.mark.parametrize("exercise", EXERCISES)
def test_every_fake_is_refused_before_any_point(exercise, monkeypatch):
    """Each fake runs the right kernel, so without certification it would pass; each is refused with one line."""
    import triton

    check = EXERCISES[exercise][0]
    real = solution(exercise)
    messages = {}
    for fake in FAKES:
        with monkeypatch.context() as patch:
            if fake == "look-alike":
                kernel = LookAlike(real)
            elif fake == "subclass":
                kernel = subclassed(real)
            elif fake == "patched triton.jit":
                genuine = triton.jit
                patch.setattr(triton, "jit", lambda fn=None, **kw: genuine(fn, **kw) if fn else genuine(**kw))
                kernel = solution(exercise)
            elif fake == "lessonlib's kernel":
                kernel = lessonlib_kernel()
            elif fake == "overwritten from the body":
                kernel = overwriting_from_the_body(exercise)
            else:
                kernel = real
                (overwritten_after_launch if fake == "overwritten after the launch" else launched_on_copies)(patch)
            with pytest.raises(ExerciseFailed) as refused:
                check(kernel)
            messages[fake] = str(refused.value)
        assert "\n" not in messages[fake], (fake, messages[fake])
        assert isinstance(refused.value, KernelRefused) or "other than through" in messages[fake], (fake, messages)
    assert "pass your @triton.jit kernel itself" in messages["look-alike"]
    assert "pass your @triton.jit kernel itself" in messages["subclass"]
    assert "triton.jit has been replaced" in messages["patched triton.jit"]
    assert "lessonlib's kernel, not yours" in messages["lessonlib's kernel"]
    assert "changed after your kernel's launch" in messages["overwritten after the launch"]
    assert "other than through" in messages["overwritten from the body"]
    assert "not launched on the checker's" in messages["launched on copies"]


def lessonlib_kernel():
    """A @triton.jit kernel defined in lessonlib (not the student's)."""
    import importlib

    module = importlib.import_module("lessonlib.ops.swiglu")
    kernels = [v for v in vars(module).values() if type(v).__name__ in ("InterpretedFunction", "JITFunction")]
    assert kernels, "lessonlib.ops.swiglu defines no kernel at import any more: pick another module"
    return kernels[0]


# A causal forward that visits every key tile and keeps the keys its tile cannot see out some other way (v_hi: the
# end of the keys the tile's last real query sees).
VISIT_EVERY_TILE = [("    hi = n_kv\n    if CAUSAL:", "    hi = n_kv\n    v_hi = n_kv\n    if CAUSAL:"),
                    ("        hi = tl.minimum(n_kv, tl.minimum(start_m + BLOCK_M, n_q) + n_kv - n_q)",
                     "        v_hi = tl.minimum(n_kv, tl.minimum(start_m + BLOCK_M, n_q) + n_kv - n_q)")]
HONEST = [  # exercise, edits of the solution, what the message must name
    ("scale_add", [("x = tl.load(x_ptr + offsets, mask=mask)", "x = tl.load(x_ptr + offsets)"),
                   ("y = tl.load(y_ptr + offsets, mask=mask)", "y = tl.load(y_ptr + offsets)")],
     "outside x and y were read .*missing mask"),  # only the store masked: the values past n are never used
    ("add_rms_norm", [("w = tl.load(weight_ptr + cols, mask=mask)", "w = tl.load(weight_ptr + cols)")],
     "outside weight were read .*missing mask"),
    ("row_sum", [("mask=cols < N, other=0.0)", "mask=cols < N)")], "has no other=, and its masked-off lanes reach out"),
    ("flash_forward", VISIT_EVERY_TILE + [
        ("v = tl.load(v_rows + cols[:, None] * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < n_kv, other=0.0)",
         "v = tl.load(v_rows + cols[:, None] * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < v_hi, other=0.0)")],
     "visited .* key tiles above the diagonal"),  # every tile visited, V's loads masked to the visible keys
    ("flash_forward", VISIT_EVERY_TILE + [
        ("acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)",
         "v = tl.where(cols[:, None] < v_hi, v, 0.0)\n        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)")],
     "visited .* key tiles above the diagonal"),  # tl.where on V
    ("add_rms_norm", [("tl.sum(h * h, axis=0) / n_cols", "tl.sum(h * h, axis=0) / BLOCK")],
     "mean of squares over BLOCK"),
    ("swiglu", [("out = gate * tl.sigmoid(gate) * up", "out = tl.sigmoid(gate) * up")], "sigmoid\\(gate\\) \\* up gives"),
    ("swiglu", [(".to(tl.float32)", "")] * 2, "missing cast"),
    ("flash_forward", [("tl.dot(p.to(v.dtype), v)", "tl.dot(p, v)")], "missing cast"),
]


@pytest.mark.parametrize("exercise, edits, message", HONEST, ids=[f"{h[0]}-{h[2][:28]}" for h in HONEST])
def test_honest_mistake_is_named(exercise, edits, message):
    check, notebook, name, _ = EXERCISES[exercise]
    source = solution_source(notebook, name)
    for old, new in edits:
        source = mutated(source, old, new) if source.count(old) == 1 else source.replace(old, new, 1)
    with pytest.raises(ExerciseFailed, match=message):
        check(define(source, name))


def test_recorder_reports_plain_data_and_leaves_memory_alone():
    """launch_observed's contract: a launch with no mask at all records its stray lanes; those outside the memory
    the tensor's storage owns are not performed (this process goes on), those inside it (a guard zone) are; the
    observation holds plain data only."""
    source = solution_source("00_setup_and_roofline.ipynb", "my_scale_add_kernel").replace(", mask=mask)", ")")
    kernel = define(source, "my_scale_add_kernel")
    x, y, out = torch.randn(5), torch.ones(5), torch.full((5,), float("nan"))
    obs = _observe.launch_observed("scale_add", kernel, (1,), x, y, out, 5, 2.0, BLOCK=1024)
    assert torch.equal(out, (2 * x.float() + y).to(out.dtype))
    record = obs.tensors["out"]
    assert [(o.count, o.first, o.last) for o in record.writes_outside] == [(1019, 5, 1023)]
    assert [(o.count, o.first, o.last) for o in obs.tensors["x"].reads_outside] == [(1019, 5, 1023)]
    assert torch.equal(record.stored, out) and bool(record.written.all())
    assert obs.programs == [[0, 0, 0]] and obs.recorded and obs.unset_lanes == []
    assert "outside out were written" in _observe.findings(obs)[0]
    plain = (int, float, str, bool, list, tuple, dict, torch.Tensor, type(None))
    for value in [*vars(obs).values(), *(v for r in obs.tensors.values() for v in vars(r).values())]:
        assert isinstance(value, plain), type(value)
    buffer = torch.full((64,), 7.0)  # a guard zone: out inside a buffer of its own
    inside = buffer[8:13].fill_(float("nan"))
    obs = _observe.launch_observed("scale_add", kernel, (1,), x, y, inside, 5, 2.0, BLOCK=16)
    assert not torch.equal(buffer[13:24], torch.full((11,), 7.0)) and torch.equal(buffer[24:], torch.full((40,), 7.0))
    assert [(o.count, o.first, o.last) for o in obs.tensors["out"].writes_outside] == [(11, 5, 15)]


@pytest.mark.parametrize("exercise, computes", [("scale_add", "alpha \\* x \\+ y"), ("swiglu", "silu\\(gate\\) \\* up"),
                                                ("rope", "rotate_half")])
def test_a_stub_is_told_what_to_write(exercise, computes):
    """The student copy's kernel (its body `pass`): the message names the kernel and what each program computes."""
    from tests.test_kernel_exercises import gen

    check, notebook, name, _ = EXERCISES[exercise]
    with pytest.raises(ExerciseFailed, match=f"not implemented yet: {name} stored nothing.*YOUR CODE HERE.*{computes}"):
        check(define(gen.strip_solutions(solution_source(notebook, name)), name))
