"""Issue 43: students who want points they did not earn, graded in one run beside an untouched student copy and the
solved instructor copy, from a checkout of the course under /tmp (a ``git clone`` of this one, reusing this Python):
each attack gets 0 on the items it attacks, the untouched copy 0, the solved copy full marks; the host's files, a
host socket and the course stay unchanged; nothing of the run survives it; grades.csv stays as written.

The sandbox must start wherever bubblewrap is installed: there this file fails, not skips, when it cannot.

Cost on 2 cores: one grading run of 18 trimmed lesson-01 notebooks (set-up and its three exercises) and one trimmed
lesson-03 notebook (set-up and physical_slot: the always-equal row), two at a time, and a git clone: 60 to 80 s
here with the machine's load average at 6, 175 s at 20 (2026-12-05, 19 lesson-01 notebooks); 251 s at 10 to 12 with
the validated runner (a third sandboxed process per notebook with kernel checks), 2026-12-05."""

import csv
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat
import pytest

from lessonlib import grading
from tests.grading_helpers import sandbox_or_skip
from tests.test_grading_sandbox import survivors, trimmed

ROOT = Path(__file__).resolve().parents[1]
FUSION = "01_operator_fusion.ipynb"
PAGED = "03_paged_attention.ipynb"  # its physical_slot (1 point) only: the always-equal row
KERNELS = ("swiglu", "add_rms_norm")  # the kernel exercises (2 + 3 points); swiglu_ratio is a prediction (1)
SECRET = "answer-key-" + os.urandom(8).hex()

# A fake kernel: an object with .fn and [grid] that computes the answer in PyTorch (issue 41).
FAKE = '''
import torch as _torch
class _Launch:
    def __init__(self, kind): self.kind = kind
    def __call__(self, *a, **k):
        if self.kind == "swiglu":
            gate, up, out = a[0], a[1], a[2]
            out.copy_((_torch.nn.functional.silu(gate.float()) * up.float()).to(out.dtype).view_as(out))
        else:
            x, residual, weight, out, residual_out, n, eps = a[:7]
            r = x.float() + residual.float()
            residual_out.copy_(r.to(residual_out.dtype))
            out.copy_((r * _torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(out.dtype))
class _Fake:
    fn = staticmethod(lambda *a: None)
    def __init__(self, kind): self.kind = kind
    def __getitem__(self, grid): return _Launch(self.kind)
'''
SPOOF = FAKE + '''
import triton.runtime.jit as _jit
class _Spoof(_Fake):
    @property
    def __class__(self):  # isinstance(kernel, JITFunction) is True
        return _jit.JITFunction
_Fake = _Spoof
'''
FAKES_BOUND = "\nmy_swiglu_kernel = _Fake('swiglu')\nmy_add_rms_norm_kernel = _Fake('rms')\n"
# A patched triton.jit: every kernel defined after it is a fake that computes in PyTorch (issue 41).
PATCHED_JIT = FAKE + '''
import triton as _triton
_triton.jit = lambda fn=None, **kw: _Fake("swiglu" if "swiglu" in fn.__name__ else "rms")
@_triton.jit
def my_swiglu_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK):
    pass
@_triton.jit
def my_add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, n_cols, eps, BLOCK):
    pass
'''
# The student's own (stub) kernels launched for real, then the outputs overwritten from PyTorch: the values compared
# were not written by the kernel's stores (issue 41).
OVERWRITES = FAKE + '''
class _Overwrites:
    def __init__(self, kernel, kind): self.kernel, self.kind, self.fn = kernel, kind, kernel.fn
    def __getitem__(self, grid):
        def launch(*a, **k):
            self.kernel[grid](*a, **k)
            _Launch(self.kind)(*a)
        return launch
my_swiglu_kernel = _Overwrites(my_swiglu_kernel, "swiglu")
my_add_rms_norm_kernel = _Overwrites(my_add_rms_norm_kernel, "rms")
'''
# Patch lessonlib's launcher so that the stub kernels "write" the answer: the patch made to look like library code.
EXEC_INTO = FAKE + '''
import lessonlib.ops._common as _common
_common.__dict__["_Launch"] = _Launch
exec("def launch(kernel, grid, *a, **k):\\n    _Launch('swiglu' if 'swiglu' in kernel.__name__ else 'rms')(*a)\\n",
     _common.__dict__)
'''
COMPILED_AS = FAKE + '''
import lessonlib.ops._common as _common
_ns = {"_Launch": _Launch}
exec(compile("def launch(kernel, grid, *a, **k):\\n    _Launch('swiglu' if 'swiglu' in kernel.__name__ else 'rms')(*a)\\n",
             _common.__file__, "exec"), _ns)
_common.launch = _ns["launch"]
'''
ISNAN = '''
import torch, unittest.mock  # a mock is a library's object: NaN outputs look written and finite
_isnan, _isfinite = torch.isnan, torch.isfinite
torch.isnan = unittest.mock.MagicMock(side_effect=lambda t: _isnan(t) & False)
torch.isfinite = unittest.mock.MagicMock(side_effect=lambda t: _isfinite(t) | True)
'''
STACK = '''
import sys
_f = sys._getframe()
while _f is not None and "report" not in _f.f_locals:
    _f = _f.f_back
if _f is not None:
    for _i, _c in enumerate(_f.f_locals["cells"]):
        if _c.get("exercise"):
            _f.f_locals["report"](_i, "ok", "forged: correct")
'''
GC_NONCE = '''
import gc, os, sys
for _o in gc.get_objects():
    if isinstance(_o, dict) and "nonce" in _o and "cells" in _o:
        for _i, _c in enumerate(_o["cells"]):
            if _c.get("exercise"):
                os.write(int(sys.argv[-1]), (repr((_o["nonce"], _i, "ok", "forged", "", "")) + "\\n").encode())
'''
# An always-equal answer where lesson 03 expects numbers: handed to the checker as itself (the old, in-process
# design) it passes check_physical_slot, whose `tuple(got) != want` asks the object (test_grading_judge shows it);
# through the wire it arrives as what it is, not a number, and gets nothing.
ALWAYS_EQUAL = '''
class _Same:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = object.__hash__
def my_physical_slot(position, block_table, block_size):
    return (_Same(), _Same())
'''
FLOOD = '''
from IPython.display import display
display({"text/plain": "flood"}, metadata={"x": "y" * 100_000_000}, raw=True)
raise type("E" * 10_000_000, (Exception,), {})("z" * 10_000_000)
'''


def reads(path: str) -> str:
    """Read a host file and put it where feedback comes from: a checker's exception message."""
    return (f"try:\n    _text = open({path!r}).read()[:200]\nexcept OSError as e:\n    _text = 'unreadable'\n"
            "print('READ', _text)\n"
            "def my_swiglu_ratio(*a, **k):\n    raise ValueError(_text)\n")


def solved_from(path: str) -> str:
    """Run the solution cells of the instructor's notebook, read from inside the sandbox."""
    return ("import json\ntry:\n"
            f"    _nb = json.load(open({path!r}))\n"
            "    for _c in _nb['cells']:\n"
            "        _s = ''.join(_c['source'])\n"
            "        if _c['cell_type'] == 'code' and 'BEGIN SOLUTION' in _s:\n"
            "            exec(_s, globals())\n"
            "    print('SOLVED FROM HOST')\nexcept Exception as e:\n    print('NO HOST NOTEBOOK', type(e).__name__)\n")


def connects(path: str) -> str:
    return ("import socket\ntry:\n    _s = socket.socket(socket.AF_UNIX)\n"
            f"    _s.settimeout(3)\n    _s.connect({path!r})\n    _s.sendall(b'hello')\n    print('CONNECTED')\n"
            "except OSError as e:\n    print('NO SOCKET', type(e).__name__)\n")


def tampers(checkout: Path) -> str:
    """A .pyc for lessonlib.exercises.operator_fusion whose checkers pass everything (header matching the source,
    so Python would load it), and a sitecustomize.py in the checkout's root; each through lessonlib's path as seen
    inside, and through the checkout's path on the host."""
    forged = ("import sys\nfrom lessonlib.exercises._checking import *\n"
              "def check_swiglu(*a, **k): print('swiglu: correct')\n"
              "def check_add_rms_norm(*a, **k): print('add_rms_norm: correct')\n"
              "def check_swiglu_ratio(*a, **k): print('swiglu_ratio: correct')\n")
    return ("import importlib.util, marshal, os, lessonlib\n"
            f"for _root in {{os.path.dirname(os.path.dirname(lessonlib.__file__)), {str(checkout)!r}}}:\n"
            "    _src = os.path.join(_root, 'lessonlib', 'exercises', 'operator_fusion.py')\n"
            "    _pyc = importlib.util.cache_from_source(_src)\n"
            "    try:\n"
            "        _st = os.stat(_src)\n"
            f"        _code = compile({forged!r}, _src, 'exec')\n"
            "        os.makedirs(os.path.dirname(_pyc), exist_ok=True)\n"
            "        with open(_pyc, 'wb') as _f:\n"
            "            _f.write(importlib.util.MAGIC_NUMBER + b'\\0' * 4 + (int(_st.st_mtime) & 0xFFFFFFFF)"
            ".to_bytes(4, 'little') + (_st.st_size & 0xFFFFFFFF).to_bytes(4, 'little') + marshal.dumps(_code))\n"
            "        print('WROTE PYC', _pyc)\n"
            "    except OSError as e:\n"
            "        print('NO PYC', type(e).__name__)\n"
            "    try:\n"
            "        with open(os.path.join(_root, 'sitecustomize.py'), 'w') as _f:\n"
            "            _f.write('import builtins; builtins.GRADING_TAMPERED = True\\n')\n"
            "        print('WROTE SITECUSTOMIZE')\n"
            "    except OSError as e:\n"
            "        print('NO SITECUSTOMIZE', type(e).__name__)\n")


def detached(out: Path) -> str:
    code = (f"import os, time\np = {str(out / 'grades.csv')!r}\n"
            "while not os.path.exists(p): time.sleep(0.2)\n"
            "time.sleep(3)\nopen(p, 'w').write('student,total\\nforger,99\\n')  # detached-forger-marker\n")
    return (f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {code!r}], start_new_session=True,"
            " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n")


def appended(notebook, solution_id: str, source: str):
    """A copy whose solution cell ``solution_id`` ends with ``source`` (a solution cell runs whole wherever the
    grader runs the student's code)."""
    copy = nbformat.from_dict(notebook)
    cell = next(c for c in copy.cells if c.metadata.get("nbgrader", {}).get("grade_id") == solution_id)
    cell.source += "\n\n" + source
    return copy


def listener(path: Path, received: list) -> socket.socket:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(8)
    server.settimeout(0.5)

    def serve():
        while server.fileno() != -1:
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(2)
                try:
                    received.append(conn.recv(100))
                except OSError:
                    received.append(b"connected")

    threading.Thread(target=serve, daemon=True).start()
    return server


def tree_state(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (the checkout, bytecode included; .git aside): what no submission may change."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames:
            path = Path(dirpath) / name
            state[str(path.relative_to(folder))] = path.read_bytes() if path.is_file() else b"?"
    return state


@pytest.fixture(scope="module")
def attacked():
    mode = sandbox_or_skip()
    # Under /tmp whatever TMPDIR says (LESSONLIB_TEST_ATTACK_DIR elsewhere: to see an older grader's row by row)
    base = Path(tempfile.mkdtemp(prefix="lessonlib-attacked-", dir=os.environ.get("LESSONLIB_TEST_ATTACK_DIR", "/tmp")))
    yield run_attacks(base, mode)
    shutil.rmtree(base, ignore_errors=True)


def run_attacks(base: Path, mode: str) -> dict:
    checkout = base / "course-checkout"  # a checkout under /tmp, as a CI clone or a scratch checkout
    subprocess.run(["git", "clone", "-q", str(ROOT), str(checkout)], check=True, timeout=300)
    course = base / "course"  # the instructor's solved notebooks, beside the checkout, with a secret beside them
    course.mkdir()
    found = grading.course_exercises(ROOT / "notebooks")[FUSION]
    solutions = {e.solution_id for e in found}
    solved = trimmed(nbformat.read(ROOT / "notebooks" / FUSION, as_version=4), solutions)
    stub = trimmed(nbformat.read(ROOT / "notebooks" / "student" / FUSION, as_version=4), solutions)
    nbformat.write(solved, course / FUSION)
    paged = {"my_physical_slot"}
    nbformat.write(trimmed(nbformat.read(ROOT / "notebooks" / PAGED, as_version=4), paged), course / PAGED)
    paged_stub = trimmed(nbformat.read(ROOT / "notebooks" / "student" / PAGED, as_version=4), paged)
    (base / "answer-key.txt").write_text(SECRET)
    out, subs = base / "graded", base / "submissions"
    kernel = "my_swiglu_kernel"  # the first solution cell
    cases = {
        "solved": solved,
        "untouched": stub,
        "stack_walker": appended(stub, kernel, STACK),
        "gc_nonce": appended(stub, kernel, GC_NONCE),
        "class_spoof": appended(stub, "my_add_rms_norm_kernel", SPOOF + FAKES_BOUND),
        "isnan_mock": appended(stub, kernel, ISNAN),
        "exec_into_lessonlib": appended(stub, kernel, EXEC_INTO),
        "compiled_as_lessonlib": appended(stub, kernel, COMPILED_AS),
        "fake_kernel": appended(stub, "my_add_rms_norm_kernel", FAKE + FAKES_BOUND),
        "patched_jit": appended(stub, "my_add_rms_norm_kernel", PATCHED_JIT),
        "overwrites_after_launch": appended(stub, "my_add_rms_norm_kernel", OVERWRITES),
        "reads_solved": appended(stub, "my_add_rms_norm_kernel", solved_from(str(course / FUSION))
                                 + solved_from(str(ROOT / "notebooks" / FUSION))),
        "secret": appended(stub, "my_swiglu_ratio", reads(str(base / "answer-key.txt"))),
        "hostname": appended(stub, "my_swiglu_ratio", reads("/etc/hostname")),
        "socket": appended(stub, kernel, connects(str(base / "host.sock"))),
        "tamper": appended(stub, kernel, tampers(checkout)),
        "detached_forger": appended(stub, kernel, detached(out)),
        "flood": appended(stub, kernel, FLOOD),
    }
    for student, notebook in cases.items():
        (subs / student).mkdir(parents=True)
        nbformat.write(notebook, subs / student / FUSION)
    (subs / "always_equal").mkdir()
    nbformat.write(appended(paged_stub, "my_physical_slot", ALWAYS_EQUAL), subs / "always_equal" / PAGED)
    (subs / "symlink").mkdir()
    (subs / "symlink" / FUSION).symlink_to(course / FUSION)
    (subs / "fifo").mkdir()
    os.mkfifo(subs / "fifo" / FUSION)
    received: list[bytes] = []
    server = listener(base / "host.sock", received)
    before = tree_state(checkout)
    course_before = tree_state(course)
    started = time.monotonic()
    env = {**os.environ, "TMPDIR": str(base / "tmp"), "LESSONLIB_GRADING_SANDBOX": mode,
           "PYTHONPATH": str(checkout)}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # so that any bytecode in the checkout afterwards is a submission's
    (base / "tmp").mkdir()
    result = subprocess.run([sys.executable, "-m", "lessonlib.grading", str(subs), "--out", str(out), "--course",
                             str(course), "--jobs", "2", "--cell-timeout", "120", "--output-cap", "100000",
                             "--scratch-mb", "64"], capture_output=True, env=env, timeout=1500, cwd=str(base))
    seconds = time.monotonic() - started
    written = (out / "grades.csv").read_bytes() if (out / "grades.csv").exists() else b""
    time.sleep(8)  # a detached forger waits 3 s after grades.csv appears
    server.close()
    return {"result": result, "out": out, "subs": subs, "base": base, "checkout": checkout, "before": before,
            "after": tree_state(checkout), "course_before": course_before, "course_after": tree_state(course),
            "received": received, "written": written, "seconds": seconds, "mode": mode}


def grades(run) -> dict[str, dict[str, str]]:
    with (run["out"] / "grades.csv").open() as f:
        table = list(csv.reader(f))
    return {row[0]: dict(zip(table[0][1:], row[1:])) for row in table[1:]}


def everything_written(run) -> str:
    """Every byte the grader wrote for the students (feedback, graded copies, raw logs) and printed."""
    parts = [run["result"].stdout.decode(errors="replace"), run["result"].stderr.decode(errors="replace")]
    for path in run["out"].rglob("*"):
        if path.is_file():
            parts.append(path.read_text(errors="replace"))
    return "\n".join(parts)


def test_the_run_finishes_in_its_sandbox_from_a_checkout_under_tmp(attacked):
    result = attacked["result"]
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-3000:]
    assert f"in sandbox {attacked['mode']}".encode() in result.stdout
    assert set(grades(attacked)) == {p.name for p in attacked["subs"].iterdir()}


def test_the_solved_copy_gets_full_marks_and_the_untouched_copy_nothing(attacked):
    got = grades(attacked)
    assert got["solved"]["total"] == "6", got["solved"]
    assert got["untouched"]["total"] == "0", got["untouched"]


ATTACKED_ITEMS = {  # submission -> the items it attacks (it is the untouched stubs otherwise: 0 everywhere)
    "stack_walker": ("swiglu", "swiglu_ratio", "add_rms_norm"),
    "gc_nonce": ("swiglu", "swiglu_ratio", "add_rms_norm"),
    "class_spoof": KERNELS, "isnan_mock": KERNELS, "exec_into_lessonlib": KERNELS, "compiled_as_lessonlib": KERNELS,
    "fake_kernel": KERNELS, "patched_jit": KERNELS, "overwrites_after_launch": KERNELS, "reads_solved": ("swiglu", "swiglu_ratio", "add_rms_norm"),
    "symlink": ("swiglu", "swiglu_ratio", "add_rms_norm"), "always_equal": ("physical_slot",),
    "tamper": ("swiglu", "swiglu_ratio", "add_rms_norm"), "fifo": ("swiglu", "swiglu_ratio", "add_rms_norm"),
}


@pytest.mark.parametrize("student", sorted(ATTACKED_ITEMS))
def test_each_attack_gets_nothing_for_what_it_attacks(attacked, student):
    got = grades(attacked)[student]
    assert {item: got[item] for item in ATTACKED_ITEMS[student]} == dict.fromkeys(ATTACKED_ITEMS[student], "0")
    assert got["total"] == "0", got


def test_files_that_are_not_regular_are_refused_with_a_line(attacked):
    fifo = (attacked["out"] / "feedback" / "fifo.txt").read_text()
    link = (attacked["out"] / "feedback" / "symlink.txt").read_text()
    assert "it is a FIFO" in fifo and "it is a symbolic link" in link


def printed(run, student: str) -> str:
    """What the graded copy's cells printed (not their sources)."""
    notebook = nbformat.read(run["out"] / "graded" / student / FUSION, as_version=4)
    return "".join(o.get("text", "") + o.get("evalue", "") for c in notebook.cells for o in c.get("outputs", []))


def test_host_files_and_sockets_are_out_of_reach(attacked):
    text = everything_written(attacked)
    assert SECRET not in text
    assert not attacked["received"], attacked["received"]
    graded = printed(attacked, "reads_solved")
    assert "SOLVED FROM HOST" not in graded and "NO HOST NOTEBOOK" in graded
    assert "CONNECTED" not in printed(attacked, "socket") and "NO SOCKET" in printed(attacked, "socket")
    hostname = Path("/etc/hostname").read_text().strip() if Path("/etc/hostname").exists() else ""
    if len(hostname) >= 6:
        assert f"READ {hostname}" not in text


def test_the_course_and_grades_csv_are_unchanged_and_nothing_survives(attacked):
    changed = sorted(k for k in set(attacked["before"]) | set(attacked["after"])
                     if attacked["before"].get(k) != attacked["after"].get(k))
    assert not changed, changed
    tamper = printed(attacked, "tamper")  # (a write it thinks it made landed in its own tmpfs: the tree is unchanged)
    assert "NO PYC" in tamper and "WROTE PYC" not in tamper, tamper[-2000:]
    assert attacked["course_before"] == attacked["course_after"]
    assert (attacked["out"] / "grades.csv").read_bytes() == attacked["written"]
    assert not survivors("detached-forger-marker", str(attacked["base"] / "tmp"))


def test_a_flood_is_capped_everywhere(attacked):
    out = attacked["out"]
    assert max(p.stat().st_size for p in out.rglob("*") if p.is_file()) < 2_000_000
    assert len(attacked["result"].stdout) < 50_000
