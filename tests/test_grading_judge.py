"""Issue 43's pieces, each alone and cheap (seconds): the plain-data channel between the judge and a submission's
runner (an always-equal answer arrives as what it is), the Triton-only kernel source and the PyTorch-subset function
source the validated runner defines, a lesson-04 attack through the judge, the course's release check, and the
grader refusing to run without a sandbox.

Cost on 2 cores: 32 s for the file with the machine's load average near 10 (2026-12-05); the slowest are the release
check's git clone (15 s), lesson 05's alternative answer under its checker (7 s) and the lesson-04 forger graded
through a judge process (5 s)."""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import nbformat
import pytest
import torch

from lessonlib import grading
from lessonlib.grading import judge, release, validated, wire
from lessonlib.grading.kernel_source import NotAKernel, kernel_source
from lessonlib.grading.torch_source import NotInSubset, function_source
from tests.test_grading_adversarial import ALWAYS_EQUAL

ROOT = Path(__file__).resolve().parents[1]


def roundtrip(value):
    buffers: list[bytes] = []
    return wire.decode(wire.encode(value, buffers), buffers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.bool])
def test_tensors_and_plain_data_cross_exactly(dtype):
    tensor = (torch.randn(3, 5, 7) * 10).to(dtype)
    value = {"t": tensor[:, 1], "list": [1, 2.5, "x", None, True], "tuple": (tensor[0, 0, 0], 3), "empty": tensor[:0]}
    back = roundtrip(value)
    assert torch.equal(back["t"], tensor[:, 1]) and back["t"].dtype == dtype
    assert back["list"] == [1, 2.5, "x", None, True] and type(back["tuple"]) is tuple
    assert back["empty"].shape == (0, 5, 7)


def test_objects_of_the_submission_arrive_as_plain_values_or_not_at_all():
    class Same(float):  # an always-equal number: it arrives as the float it holds
        def __eq__(self, other):
            return True

        __hash__ = float.__hash__

    class Fake:
        pass

    class SameInt(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    class Posing:  # isinstance(x, float) is True: it claims float's class
        __class__ = property(lambda self: float)

        def __eq__(self, other):
            return True

    back = roundtrip([Same(1.5), Fake(), torch.nn.Parameter(torch.ones(2)), SameInt(7), Posing()])
    assert type(back[0]) is float and back[0] == 1.5 and back[0] != 2.0
    assert isinstance(back[1], wire.Foreign) and isinstance(back[2], wire.Foreign)
    assert type(back[3]) is int and back[3] == 7 and back[3] != 8
    assert isinstance(back[4], wire.Foreign) and back[4] != 1.0


@contextlib.contextmanager
def runner_on_a_thread(namespace: dict):
    """The runner's side of the wire (:func:`judge._serve`) answering from ``namespace`` on a thread, and the judge's
    :class:`judge.Remote` for a name: the grader's two ends and their pipes, without the processes."""
    calls_read, calls_write = os.pipe()
    replies_read, replies_write = os.pipe()
    thread = threading.Thread(target=judge._serve, args=(namespace, calls_read, replies_write), daemon=True)
    thread.start()
    try:
        yield lambda name: judge.Remote(name, calls_write, replies_read, 30)
    finally:
        wire.send(calls_write, {"done": 0})  # _serve returns (it would end its process on a closed channel)
        thread.join(30)
        for fd in (calls_read, calls_write, replies_read, replies_write):
            os.close(fd)


def test_an_always_equal_answer_earns_nothing_through_the_wire():
    """Issue 43's row: an always-equal object where lesson 03 expects numbers. Handed to the checker as itself it
    passes (``tuple(got) != want`` asks the object): the attack is real. Through the runner and the wire the judge
    gets plain data, where it is an object of the submission's, not a number: 0."""
    from lessonlib.exercises import check_physical_slot
    from lessonlib.exercises._checking import ExerciseFailed

    namespace: dict = {}
    exec(ALWAYS_EQUAL, namespace)
    check_physical_slot(namespace["my_physical_slot"])  # the old design: the checker beside the object
    with runner_on_a_thread(namespace) as remote:
        with pytest.raises(ExerciseFailed, match="expected"):
            check_physical_slot(remote("my_physical_slot"))
        answer = remote("my_physical_slot")(5, [7, 3], 4)
        assert type(answer) is tuple and all(isinstance(v, wire.Foreign) for v in answer), answer
        honest: dict = {}
        exec("def my_physical_slot(position, table, block_size):\n"
             "    return table[position // block_size], position % block_size\n", honest)
        namespace.update(honest)  # the same path passes an honest answer
        check_physical_slot(remote("my_physical_slot"))


@pytest.mark.parametrize("data, buffers", [
    ({"__tensor__": ["float32", [2, 2], 0]}, [b"\0" * 15]),  # size does not match the shape
    ({"__tensor__": ["object", [1], 0]}, [b"\0" * 8]),  # not a dtype the judge accepts
    ({"__pickle__": "gASV"}, []),  # nothing but encode()'s kinds
    ({"__float__": "1.0", "x": 1}, []),
    (1.5, []),  # a bare JSON number: encode() never writes one
])
def test_the_judge_refuses_what_is_not_well_formed(data, buffers):
    with pytest.raises(wire.WireError):
        wire.decode(data, buffers)


def test_a_frame_past_its_cap_is_refused():
    read, write = os.pipe()
    os.write(write, (wire.HEADER_CAP + 1).to_bytes(8, "little") + (0).to_bytes(8, "little"))
    with pytest.raises(wire.WireError, match="a frame of"):
        wire.receive(read, 5)
    os.close(read)
    os.close(write)


def code_cells(path: Path) -> list[str]:
    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def test_every_kernel_exercise_is_a_triton_jit_function_the_judge_accepts():
    """The course's kernel exercises (solution ids ending _kernel) are exactly its @triton.jit answers, and the
    judge's Triton-only check accepts each instructor solution and each student stub."""
    for name, found in grading.course_exercises(ROOT / "notebooks").items():
        instructor, student = code_cells(ROOT / "notebooks" / name), code_cells(ROOT / "notebooks" / "student" / name)
        for exercise in found:
            solution = next(s for s in instructor if f"def {exercise.solution_id}(" in s)
            assert judge.is_kernel(exercise) == ("@triton.jit" in solution), exercise.name
            if judge.is_kernel(exercise):
                assert f"def {exercise.solution_id}(" in kernel_source(instructor, exercise.solution_id)
                kernel_source(student, exercise.solution_id)


KERNEL = "@triton.jit\ndef my_k(x_ptr, n, BLOCK: tl.constexpr):\n    offs = tl.arange(0, BLOCK)\n{body}\n"


@pytest.mark.parametrize("body, why", [
    ("    import os", "Import"),
    ("    x = torch", "torch is neither"),
    ("    torch.ones(1)", "ones is not"),
    ("    x = x_ptr.__class__", "__class__"),
    ("    f = lambda: 0", "Lambda"),
    ("    def inner():\n        pass", "FunctionDef"),
    ("    tl.core.builtins", "not"),
    ("    x = x_ptr.handle", "handle"),
    ("    try:\n        pass\n    except Exception:\n        pass", "Try"),
])
def test_a_kernel_that_is_not_triton_language_is_refused(body, why):
    with pytest.raises(NotAKernel, match=why):
        kernel_source([KERNEL.format(body=body)], "my_k")


def test_a_kernel_replaced_after_its_definition_is_not_a_kernel():
    cells = [KERNEL.format(body="    pass"), "class Fake:\n    pass\nmy_k = Fake()\n"]
    with pytest.raises(NotAKernel, match="no @triton.jit function my_k"):
        kernel_source(cells, "my_k")
    helper = "@triton.jit\ndef helper(x):\n    return x * 2\n"
    source = kernel_source([helper, KERNEL.format(body="    y = helper(offs)")], "my_k")
    assert source.index("def helper(") < source.index("def my_k(")


@pytest.fixture()
def checkout(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout of the course")
    target = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(target)], check=True, timeout=300)
    return target


def test_the_course_is_checked_against_its_commit_and_put_back(checkout):
    course = release.Course(checkout, checkout / "notebooks")
    assert course.origin.startswith("git commit")
    source = checkout / "lessonlib" / "exercises" / "operator_fusion.py"
    original = source.read_bytes()
    pyc = Path(__import__("importlib.util").util.cache_from_source(str(source)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(b"forged")
    (checkout / "sitecustomize.py").write_text("x = 1\n")
    source.write_bytes(original + b"\n# changed\n")
    with pytest.raises(release.CourseChanged) as refused:
        release.Course(checkout, checkout / "notebooks")
    for what in ("operator_fusion.py differs", "sitecustomize.py is not released", "is not its source compiled"):
        assert what in str(refused.value)
    found = course.repair()
    assert source.read_bytes() == original and not pyc.exists() and not (checkout / "sitecustomize.py").exists()
    assert len(found) == 3 and course.repair() == []
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(source)], check=True)  # Python's own: kept
    assert course.repair() == [] and pyc.exists()


def test_without_a_sandbox_the_grader_refuses_unless_told(tmp_path, monkeypatch):
    from lessonlib.grading import sandbox, submissions

    (tmp_path / "subs").mkdir()
    monkeypatch.delenv("LESSONLIB_GRADING_SANDBOX", raising=False)
    assert grading.main([str(tmp_path / "subs"), "--sandbox", "none"]) == 3
    monkeypatch.setattr(sandbox, "choose", lambda mode="auto": ("none", "no bwrap here"))
    with pytest.raises(sandbox.SandboxUnavailable, match="refuses to run untrusted notebooks"):
        submissions._sandbox("auto", False, print)
    lines = []
    assert submissions._sandbox("auto", True, lines.append) == "none" and "UNSANDBOXED" in lines[0]


# --- The checkers that must run the student's function in their own process (judge.IN_PROCESS): its source in the
# grader's PyTorch subset, run by the validated runner beside lessonlib's checker and nothing else of the submission.

ALTERNATIVES = {  # another honest answer to each, as a student might write it
    "my_scale_by_max": "def my_scale_by_max(x):\n    peak = torch.amax(torch.abs(x))\n    return 2.0 * x / peak\n",
    "my_refresh_static_inputs": ("def my_refresh_static_inputs(static, new):\n    for name in static:\n"
                                 "        static[name][...] = new[name]\n"),
    "my_graph_safe_decode_step": '''
def attend(q, k, v, visible):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).float()
    v = v.repeat_interleave(groups, dim=1).float()
    scores = torch.einsum("bhd,bhnd->bhn", q.float(), k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("bhn,bhnd->bhd", F.softmax(scores, dim=-1), v)


def my_graph_safe_decode_step(q, k_new, v_new, k_cache, v_cache, lengths, out):
    batch, capacity = k_cache.shape[0], k_cache.shape[2]
    rows = torch.arange(batch, device=q.device)
    k_cache[rows, :, lengths] = k_new
    v_cache[rows, :, lengths] = v_new
    visible = torch.arange(capacity, device=q.device)[None, :] <= lengths[:, None]
    out.copy_(attend(q, k_cache, v_cache, visible))
    lengths += 1
    return out
''',
}


def in_process_exercises():
    found = [(name, e) for name, listed in grading.course_exercises(ROOT / "notebooks").items() for e in listed
             if e.name in judge.IN_PROCESS]
    assert {e.name for _, e in found} == judge.IN_PROCESS
    return found


def test_the_torch_subset_accepts_the_instructor_solutions_the_stubs_and_alternatives():
    for name, exercise in in_process_exercises():
        for folder in (ROOT / "notebooks", ROOT / "notebooks" / "student"):
            source = function_source(code_cells(folder / name), exercise.solution_id)
            assert source.startswith(f"def {exercise.solution_id}("), source
        alternative = function_source(["import torch", ALTERNATIVES[exercise.solution_id]], exercise.solution_id)
        assert alternative.index("def my_") > (alternative.find("def attend(") if "attend" in alternative else -1)


@pytest.mark.parametrize("solution_id", ["my_refresh_static_inputs", "my_graph_safe_decode_step"])
def test_the_alternatives_pass_their_checkers_as_the_validated_runner_defines_them(solution_id):
    """Lesson 05's (the CPU path; lesson 04's torch.compile costs seconds more: the grading test below runs it)."""
    from lessonlib import exercises

    fn = validated.define_function(solution_id, function_source([ALTERNATIVES[solution_id]], solution_id))
    getattr(exercises, "check_" + solution_id.removeprefix("my_"))(fn)


FUNCTION = "def my_f(x, table):\n{body}\n    return x\n"


@pytest.mark.parametrize("body, why", [
    ("    import os", "Import is not"),
    ("    x.data = table", "assigning to .data"),
    ("    global table", "Global is not"),
    ("    f = lambda: 0", "Lambda is not"),
    ("    class C:\n        pass", "ClassDef is not"),
    ("    try:\n        pass\n    except Exception:\n        pass", "Try is not"),
    ("    with torch.no_grad():\n        pass", "With is not"),
    ("    def inner():\n        pass", "FunctionDef is not"),
    ("    y = (z := 1)", "NamedExpr is not"),
    ("    y = __import__('os')", "__import__ is refused"),
    ("    y = x.__class__", r"\.__class__ starts with _"),
    ("    y = x._base", r"\._base starts with _"),
    ("    torch._dynamo.reset()", r"\._dynamo starts with _"),
    ("    y = torch.load('f')", "load reaches past tensors"),
    ("    y = torch.utils.data", "utils reaches past tensors"),
    ("    y = torch.os.system", "torch.os.system is not a PyTorch function"),
    ("    y = torch.os", "is a module, not a function"),
    ("    y = F.Callable", "F.Callable is not a PyTorch function"),
    ("    y = x.register_hook(print)", r"\.register_hook is not a public attribute"),
    ("    y = np", "np is neither"),
    ("    torch = table", "torch is rebound"),
] + [(f"    y = {name}", f"{name} is refused") for name in
     ("sys", "gc", "inspect", "builtins", "open", "exec", "eval", "getattr", "setattr", "globals")])
def test_a_function_outside_the_torch_subset_is_refused_with_its_reason(body, why):
    with pytest.raises(NotInSubset, match=why):
        function_source([FUNCTION.format(body=body)], "my_f")


def test_a_decorated_or_replaced_function_is_refused():
    with pytest.raises(NotInSubset, match="no decorator"):
        function_source(["@torch.no_grad()\n" + FUNCTION.format(body="    pass")], "my_f")
    with pytest.raises(NotInSubset, match="no function my_f"):
        function_source([FUNCTION.format(body="    pass"), "my_f = print\n"], "my_f")
    with pytest.raises(NotInSubset, match="no function my_f"):
        function_source([FUNCTION.format(body="    pass"), "from os import system as my_f\n"], "my_f")


# Lesson 04's answer as an attacker writes it: reading the checker's frames, resetting what Dynamo counted, or
# writing the validated runner's outcome line itself ("ok") and exiting before the checker can say otherwise.
STACK_WALKER = ("def my_scale_by_max(x):\n    frame = sys._getframe(1)\n    frame.f_locals['breaks'] = []\n"
                "    return x / x.abs().max().item() * 2.0\n")
DYNAMO = ("def my_scale_by_max(x):\n    torch._dynamo.utils.counters.clear()\n"
          "    return x / x.abs().max().item() * 2.0\n")
FORGER = '''def my_scale_by_max(x):
    import json, os
    line = json.dumps({"index": 3, "status": "ok", "stdout": "no_graph_break: forged", "ename": "", "evalue": ""})
    for fd in os.listdir("/proc/self/fd"):  # whichever is the outcome pipe
        try:
            os.write(int(fd), (line + "\\n").encode())
        except OSError:
            pass
    os._exit(0)
'''


def graded_04(tmp_path, solution: str):
    """judge.score on lesson 04's exercise with ``solution`` as the student's cell: the grader's processes and pipes,
    unsandboxed (mode none: bubblewrap's own tests are test_grading_sandbox's and the attack test's)."""
    from lessonlib.grading import sandbox

    exercise = next(e for name, e in in_process_exercises() if e.name == "no_graph_break")
    sources = ["", "import torch\nfrom lessonlib.exercises import check_no_graph_break\n", solution,
               exercise.checker_source]
    boxes = {}
    for role in ("runner", "judge"):
        box = sandbox.Box("none", tmp_path / role / "s", tmp_path / role / "w", (), 1 << 28, 512, 1 << 28)
        sandbox.prepare(box)
        boxes[role] = (box, sandbox.environment(box, {"LESSONLIB_GRADING_SCRATCH": str(box.work),
                                                      "PYTHONPATH": str(ROOT)}))
    found, notes = judge.score(sources, {3: exercise}, [exercise], boxes, 300, 120,
                               {role: tmp_path / f"{role}.txt" for role in boxes})
    return found.get(3)


@pytest.mark.parametrize("attack, why", [(STACK_WALKER, "refused|starts with _"), (DYNAMO, "starts with _"),
                                         (FORGER, "Import is not")])
def test_a_lesson_04_attack_is_refused_before_anything_runs(attack, why):
    exercise = next(e for name, e in in_process_exercises() if e.name == "no_graph_break")
    entry, = judge.plan_checks(["", attack, exercise.checker_source], {2: exercise}, [exercise])
    assert "source" not in entry and re.search(why, entry["refused"]), entry


def test_a_lesson_04_forger_gets_nothing_through_the_judge(tmp_path):
    """Through the judge and (were it accepted) the validated runner, as graded: a few seconds (one judge; an honest
    lesson-04 answer would add a torch.compile of tens of seconds on a CPU: test_grading grades lesson 05's)."""
    status, stdout, ename, evalue = graded_04(tmp_path, FORGER)
    assert status == "error" and "Import is not" in evalue and "forged" not in stdout, (status, stdout, evalue)


@pytest.mark.parametrize("gpu", [False, True], ids=["fork", "fresh interpreter"])
def test_the_validated_runner_gives_the_same_outcomes_forked_or_fresh(gpu, monkeypatch):
    """On a GPU the validated runner is a fresh interpreter (a child forked after the judge asked CUDA for a GPU could
    not use CUDA); here that path is taken by saying so, and both paths give the same outcomes: the instructor's
    lesson-00 kernel passes, the stub does not."""
    from lessonlib import runtime

    monkeypatch.setattr(runtime, "on_gpu", lambda: gpu)
    instructor = code_cells(ROOT / "notebooks" / "00_setup_and_roofline.ipynb")
    student = code_cells(ROOT / "notebooks" / "student" / "00_setup_and_roofline.ipynb")
    checks = [{"index": i, "name": "scale_add", "validated": "kernel", "solution_id": "my_scale_add_kernel",
               "source": kernel_source(cells, "my_scale_add_kernel"),
               "checker_source": "check_scale_add_kernel(my_scale_add_kernel)"}
              for i, cells in enumerate((instructor, student))]
    fd, pid = validated.fork(checks, timeout=120)
    with os.fdopen(fd, "rb") as pipe:
        lines = [json.loads(line) for line in pipe.read().splitlines()]
    os.waitpid(pid, 0)
    assert [(line["index"], line["status"]) for line in lines] == [(0, "ok"), (1, "error")]
    assert "✓ scale_add" in lines[0]["stdout"] and "not implemented yet" in lines[1]["evalue"]
