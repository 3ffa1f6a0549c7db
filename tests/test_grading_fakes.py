"""Issue 41, through the grader: its five fake kernels planted in every kernel exercise of lessons 00, 02 and 03,
graded by ``python -m lessonlib.grading`` (in the sandbox it chooses) beside the solved instructor copy and an
untouched student copy: each fake gets 0 for each item it fakes, with a one-line reason; the solved copy keeps full
marks; the untouched copy gets 0. Lesson 01's two kernel items get the fifth fake here (a kernel launched on copies),
the other four in tests/test_grading_adversarial.py.

The fakes (:data:`FAKES`): a duck-typed object, a subclass of Triton's kernel class, a patched ``triton.jit``, a
wrapper that launches the student's own kernel and then overwrites the outputs, a wrapper that launches a correct
kernel on copies of the checker's tensors and copies the results in. Each computes the right answer with a correct
kernel the submission carries under another name (the instructor's solution, "copied from a classmate"): one fake
fits every exercise, and what it computes in does not matter to the grader, which never runs the student's object
for a kernel item. Each also has Triton's ``run(*args, grid=...)``: it passes a checker that neither certifies nor
records its launch (the last test; tests/test_observed_launch.py refuses the same kinds when a checker is called
directly).

Every item receives every fake kind: one submission per fake kind (lessons 00, 02 and 03, every kernel exercise
replaced by that fake), plus the solved and the untouched copies: 24 notebooks with lesson 01's three, each trimmed
to its set-up cell, the cell importing the checkers and its kernel exercises' cells; the course is the solved copies
trimmed the same way, so that the kernel items are the only items. The checkers' sizes are their own (each takes
0.1 to 2 s in the interpreter); the cost is the processes each notebook starts.

Cost on 2 cores, measured with /usr/bin/time on 2026-12-05: 82 to 83 s of CPU (user and system, the grader's
sandboxed processes included); wall 168 s with the machine's load average at 6 to 11, 212 s at 10 to 12 (other work
beside it); 72 s wall at a load average of 1.3 for an earlier form of the same run (21 notebooks, 66 s of CPU). On
an idle CI machine about 90 s (estimated from the CPU time: no idle machine was at hand).
"""

import csv
import re
from pathlib import Path

import nbformat
import pytest

from lessonlib import grading
from lessonlib.grading.kernel_source import kernel_source
from tests.grading_helpers import sandbox_or_skip
from tests.test_grading_sandbox import grade_cli

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
LESSONS = ("00_setup_and_roofline.ipynb", "02_flash_attention.ipynb", "03_paged_attention.ipynb")
FUSION = "01_operator_fusion.ipynb"  # its kernel items get the other fakes in test_grading_adversarial.py

# What every planted cell defines first (a cell may run twice: the definitions are the same each time).
COMMON = '''
import torch as _torch


def _same_layout_copy(t):  # a copy of t's whole storage, seen as t sees its own: shape, strides, offset kept
    storage = t.untyped_storage()
    copy = _torch.empty(0, dtype=t.dtype, device=t.device)
    return copy.set_(type(storage)(storage.nbytes(), device=t.device).copy_(storage), t.storage_offset(), t.size(),
                     t.stride())


def _on_copies(kernel, grid, args, meta):  # kernel launched on copies of the tensors, the results copied in
    copies = [_same_layout_copy(a) if isinstance(a, _torch.Tensor) else a for a in args]
    kernel[grid](*copies, **meta)
    for a, c in zip(args, copies):
        if isinstance(a, _torch.Tensor):
            a.copy_(c)


class _LookAlike:  # duck-typed: .fn, kernel[grid](...) and Triton's run(..., grid=...), running another kernel
    rewritten_fn = {}  # as the interpreter's kernel class has

    def __init__(self, real):
        self.fn, self.real, self.arg_names = real.fn, real, getattr(real, "arg_names", None)

    def __getitem__(self, grid):
        return self.real[grid]

    def run(self, *args, grid, warmup=False, **meta):
        return self.real.run(*args, grid=grid, warmup=warmup, **meta)


class _OnCopies(_LookAlike):  # a correct kernel launched on other tensors than the checker's, the results copied in
    def __getitem__(self, grid):
        return lambda *args, **meta: _on_copies(self.real, grid, args, meta)

    def run(self, *args, grid, warmup=False, **meta):
        _on_copies(self.real, grid, args, meta)


class _Overwrites(_LookAlike):  # the student's own kernel launched for real, then its outputs overwritten
    def __init__(self, own, answer):
        super().__init__(own)
        self.answer = answer

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.real[grid](*args, **meta)
            _on_copies(self.answer, grid, args, meta)
        return launch

    def run(self, *args, grid, warmup=False, **meta):
        self.real.run(*args, grid=grid, warmup=warmup, **meta)
        _on_copies(self.answer, grid, args, meta)


def _subclassed(real):  # a subclass of Triton's kernel class that reports Triton's class as its own
    class _Kernel(type(real)):
        @property
        def __class__(self):
            return type(real)

    return _Kernel(real.fn)
'''
# A patched triton.jit: the student's untouched ``@triton.jit def my_..._kernel`` below it becomes a look-alike.
PATCH_JIT = '''
import triton as _triton
_genuine_jit = getattr(_triton.jit, "genuine", _triton.jit)


def _patched_jit(fn=None, **kw):
    if fn is not None and fn.__name__.startswith("my_"):
        return _LookAlike(globals()["_copied_" + fn.__name__])
    return _genuine_jit(fn, **kw) if fn is not None else _genuine_jit(**kw)


_patched_jit.genuine = _genuine_jit
_triton.jit = _patched_jit
'''
FAKES = {  # fake kind -> what rebinds the student's kernel after its (stub) cell; None: the patch above it
    "duck_typed": "{name} = _LookAlike(_copied_{name})",
    "subclass": "{name} = _subclassed(_copied_{name})",
    "patched_jit": None,
    "overwrites_after_launch": "{name} = _Overwrites({name}, _copied_{name})",
    "other_tensors": "{name} = _OnCopies(_copied_{name})",
}
REASONS = {  # one line each: the grader reads the @triton.jit source; the judge runs the stub that a patched jit hid
    "duck_typed": "no @triton.jit function {name} in the notebook",
    "subclass": "no @triton.jit function {name} in the notebook",
    "patched_jit": "not implemented yet",
    "overwrites_after_launch": "no @triton.jit function {name} in the notebook",
    "other_tensors": "no @triton.jit function {name} in the notebook",
}


def kernel_exercises(lesson: str) -> list:
    """A lesson's kernel exercises: their answers are @triton.jit functions, named my_..._kernel (as the grader tells
    them apart)."""
    return [e for e in grading.course_exercises(NOTEBOOKS)[lesson] if e.solution_id.endswith("_kernel")]


def trimmed(notebook, solutions: set[str]):
    """The notebook's set-up cell, the cell importing the checkers, and each of ``solutions``' cells with the cell
    above (its instructions, or imports it needs) and below (its checker): the rest of a lesson changes no grade
    here and would only cost time (lesson 00's set-up draws a roofline and drives a widget)."""
    copy = nbformat.from_dict(notebook)
    first = next(i for i, c in enumerate(copy.cells) if c.cell_type == "code")
    keep = {first, next(i for i, c in enumerate(copy.cells) if "lessonlib.exercises import" in c.source)}
    for i, c in enumerate(copy.cells):
        if c.metadata.get("nbgrader", {}).get("grade_id") in solutions and c.metadata["nbgrader"].get("solution"):
            keep |= {i - 1, i, i + 1}
    copy.cells = [c for i, c in enumerate(copy.cells) if i in keep]
    return copy


def faked(stub, solved, fake: str):
    """``stub`` (a trimmed student copy) with every kernel exercise's cell replaced by ``fake``: the instructor's
    kernel defined under another name, the fake's helpers, then the student's cell as released and the fake bound
    to its name (or, for the patched jit, the patch and then the student's cell)."""
    copy = nbformat.from_dict(stub)
    solved_cells = [c.source for c in solved.cells if c.cell_type == "code"]
    for cell in copy.cells:
        meta = cell.metadata.get("nbgrader", {})
        name = meta.get("grade_id", "")
        if not (meta.get("solution") and name.endswith("_kernel")):
            continue
        copied = re.sub(rf"\bdef {name}\(", f"def _copied_{name}(", kernel_source(solved_cells, name), count=1)
        head = "import triton\nimport triton.language as tl\n\n\n" + copied + "\n" + COMMON
        if FAKES[fake] is None:
            cell.source = head + PATCH_JIT + "\n\n" + cell.source
        else:
            cell.source = head + "\n\n" + cell.source + "\n\n\n" + FAKES[fake].format(name=name) + "\n"
    return copy


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    mode = sandbox_or_skip()
    base = tmp_path_factory.mktemp("fakes")
    subs, course = base / "submissions", base / "course"
    course.mkdir()
    for lesson in LESSONS + (FUSION,):
        solutions = {e.solution_id for e in kernel_exercises(lesson)}
        solved = trimmed(nbformat.read(NOTEBOOKS / lesson, as_version=4), solutions)
        stub = trimmed(nbformat.read(NOTEBOOKS / "student" / lesson, as_version=4), solutions)
        nbformat.write(solved, course / lesson)
        cases = {"solved": solved, "untouched": stub} | {fake: faked(stub, solved, fake) for fake in FAKES
                                                         if lesson in faked_lessons(fake)}
        for student, notebook in cases.items():
            (subs / student).mkdir(parents=True, exist_ok=True)
            nbformat.write(notebook, subs / student / lesson)
    result = grade_cli(subs, base / "out", base / "tmp", "--course", str(course), "--jobs", "2", "--cell-timeout",
                       "300", sandbox_mode=mode)
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-3000:]
    assert f"in sandbox {mode}".encode() in result.stdout, result.stdout.decode(errors="replace")[-2000:]
    with (base / "out" / "grades.csv").open() as f:
        table = list(csv.reader(f))
    grades = {row[0]: dict(zip(table[0][1:], row[1:])) for row in table[1:]}
    feedback = {student: (base / "out" / "feedback" / f"{student}.txt").read_text() for student in grades}
    return grades, feedback


def faked_lessons(fake: str) -> tuple[str, ...]:
    return LESSONS + (FUSION,) if fake == "other_tensors" else LESSONS


ITEMS = [e for lesson in LESSONS + (FUSION,) for e in kernel_exercises(lesson)]


def test_the_solved_copy_keeps_full_marks_and_the_untouched_copy_gets_nothing(graded):
    grades, _ = graded
    assert {e.name: grades["solved"][e.name] for e in ITEMS} == {e.name: f"{e.points:g}" for e in ITEMS}
    assert {e.name: grades["untouched"][e.name] for e in ITEMS} == {e.name: "0" for e in ITEMS}


def test_the_solved_copy_is_told_the_checkers_whole_verdict(graded):
    """The checker's verdict, not the tail of it: a checker wraps its message over several lines."""
    _, feedback = graded
    for e in ITEMS:
        line = next(line for line in feedback["solved"].splitlines() if line.startswith(f"  {e.name}: "))
        assert f"  {e.name}: {e.points:g}/{e.points:g}  " in line, line
        assert re.search(rf"/{e.points:g}  (✓ )?{e.name.removesuffix('_kernel')}: .{{40}}", line), line


@pytest.mark.parametrize("fake", FAKES)
def test_each_fake_gets_nothing_for_each_item_it_fakes_and_one_line_saying_why(graded, fake):
    grades, feedback = graded
    faked_items = [e for lesson in faked_lessons(fake) for e in kernel_exercises(lesson)]
    assert {e.name: grades[fake][e.name] for e in faked_items} == {e.name: "0" for e in faked_items}, grades[fake]
    assert grades[fake]["total"] == "0"
    for e in faked_items:  # feedback: "  item: 0/points  reason", one line per item
        lines = [line for line in feedback[fake].splitlines() if line.startswith(f"  {e.name}: ")]
        assert len(lines) == 1 and lines[0].startswith(f"  {e.name}: 0/{e.points:g}  "), (e.name, feedback[fake])
        assert REASONS[fake].format(name=e.solution_id) in lines[0], (e.name, lines[0])


def plain_launch(name, kernel, grid, *args, student=True, **meta):
    """``launch_observed`` with its defences taken out: no certification, nothing recorded (a checker that only
    compares the outputs, as the checkers did before issue 41)."""
    import torch

    from lessonlib.exercises import _observe

    names = list(getattr(kernel, "arg_names", None) or [])
    tensors = {(names[i] if i < len(names) else f"arg{i}").removesuffix("_ptr"): a for i, a in enumerate(args)
               if isinstance(a, torch.Tensor)}
    before = {k: t.detach().cpu().clone() for k, t in tensors.items()}
    grid = tuple(int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,)))
    kernel[grid](*args, **meta)
    records = {k: _observe._plain_record(k, t, before[k]) for k, t in tensors.items()}
    return _observe.Observation(kernel.fn.__name__, grid, False, [], records)


@pytest.mark.parametrize("fake", FAKES)
def test_each_fake_passes_a_checker_that_neither_certifies_nor_records(fake, monkeypatch):
    """The fakes the grader refuses work: run in this process, with launch_observed reduced to a plain launch and
    its certification and findings switched off, each passes lesson 00's checkers (lessons 02 and 03 too: checked
    once, 2026-12-05; 25 s more, so not repeated here). Without this, a fake that had stopped working would get 0
    above for the wrong reason."""
    import linecache

    import triton

    from lessonlib import exercises
    from lessonlib.exercises import _observe

    monkeypatch.setattr(triton, "jit", triton.jit)  # put back after the patched jit's cells
    monkeypatch.setattr(_observe, "launch_observed", plain_launch)
    monkeypatch.setattr(_observe, "certify_kernel", lambda *a, **k: None)
    monkeypatch.setattr(_observe, "certify_outputs", lambda *a, **k: None)
    monkeypatch.setattr(_observe, "findings", lambda obs: [])
    lesson = LESSONS[0]
    found = kernel_exercises(lesson)
    solutions = {e.solution_id for e in found}
    solved = trimmed(nbformat.read(NOTEBOOKS / lesson, as_version=4), solutions)
    stub = trimmed(nbformat.read(NOTEBOOKS / "student" / lesson, as_version=4), solutions)
    planted = faked(stub, solved, fake)
    namespace = {"__name__": "__main__"}
    for e in found:
        cell = next(c for c in planted.cells if c.metadata.get("nbgrader", {}).get("grade_id") == e.solution_id)
        source = "import torch\nimport triton\nimport triton.language as tl\n" + cell.source
        filename = f"<planted {fake} {e.name}>"  # registered, so that Triton can read the kernels' source
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), namespace)
        getattr(exercises, e.checker_id)(namespace[e.solution_id])
