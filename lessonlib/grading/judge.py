"""Points decided where no submission can reach. Where each thing runs, every process in a sandbox of its own:

- The **runner** (``python -m lessonlib.grading.judge runner``) runs the student's set-up cells, solution cells and
  the definitions of the other cells (:func:`~lessonlib.grading.scoring.apart`), then answers calls: the judge sends a
  function's name and arguments, the runner calls the student's function and sends back its result and its
  arguments as they are afterwards (a function may fill a list or a tensor it was given), as plain data
  (:mod:`~lessonlib.grading.wire`). Started only where a check calls the student's code.
- The **validated runner** (:mod:`~lessonlib.grading.validated`) runs lessonlib's checker on an answer that is source
  text the grader took from the notebook with :mod:`ast` and validated, and on nothing else of the submission: a
  kernel exercise's ``@triton.jit`` source (:mod:`~lessonlib.grading.kernel_source`: Triton language only), and the
  function of a checker that must run it in its own process (:data:`IN_PROCESS`: ``torch.compile`` traces it, a CUDA
  graph captures it, a checker compares tensors' addresses) in a small PyTorch subset
  (:mod:`~lessonlib.grading.torch_source`). A notebook whose answer is outside these gets 0 with the reason and runs
  nothing. Each check's outcome goes to the judge as one JSON line. Where there is such a check, the judge forks it
  before running any check of its own, inside the judge's sandbox (:func:`~lessonlib.grading.validated.fork`).
- The **judge** (``python -m lessonlib.grading.judge judge``) imports lessonlib's checkers and runs each pristine
  checker cell with the student's function replaced by a :class:`Remote`, which forwards each call to the runner and
  returns what came back, checked; for a validated check it reads the validated runner's line, checks its form and
  reports it. The judge runs no code that came from the submission: walking the stack, ``gc``, monkeypatching,
  spoofed classes and always-equal objects reach only the runners, which decide nothing.

Each check's outcome goes to the grader as one JSON line on the judge's result pipe: (status, what the checker
printed, the error's name and text), capped.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import time
import signal
import subprocess
import sys
import threading
import traceback
import types

from lessonlib.grading import wire

# Checkers that must run the student's function in their own process: torch.compile traces it, a CUDA graph
# captures it, refresh_static_inputs's checker compares the tensors' identity and addresses (which plain data cannot
# carry). Their answer is the function's source in the PyTorch subset (torch_source.py), run by the validated runner.
IN_PROCESS = {"no_graph_break", "graph_safe_decode_step", "refresh_static_inputs"}


class CallTimeout(BaseException):
    """A call or check past the grader's limit (a BaseException: a checker's ``except Exception`` does not catch
    it, so the feedback says it timed out)."""


class Remote:
    """The student's function as the judge sees it: each call is sent to the runner; the result and the arguments'
    new contents come back as plain data (a list, dict or tensor argument is updated in place)."""

    calls = 0

    def __init__(self, name: str, request_fd: int, reply_fd: int, timeout: float):
        self.__name__ = self.name = name
        self._fds, self._timeout = (request_fd, reply_fd), timeout

    def __call__(self, *args, **kwargs):
        from lessonlib.exercises._checking import ExerciseFailed

        buffers: list[bytes] = []
        payload = wire.encode({"args": list(args), "kwargs": dict(kwargs)}, buffers)
        Remote.calls += 1
        try:
            wire.send(self._fds[0], {"call": self.name, "id": Remote.calls, "payload": payload}, buffers)
            header, buffers = wire.receive(self._fds[1], self._timeout)
            while header.get("id") != Remote.calls:  # a late answer to a call that timed out: not this one's
                header, buffers = wire.receive(self._fds[1], self._timeout)
            reply = wire.decode(header.get("reply"), buffers)
        except wire.WireError as e:
            if "in time" in str(e):
                raise CallTimeout(f"{self.name} did not return within {self._timeout:g} s") from None
            raise ExerciseFailed(f"{self.name}: no usable answer from your code ({e})") from None
        except (ValueError, KeyError, OSError) as e:
            raise ExerciseFailed(f"{self.name}: no usable answer from your code ({type(e).__name__})") from None
        if type(reply) is not dict:
            raise ExerciseFailed(f"{self.name}: no usable answer from your code")
        for old, new in zip(list(args) + list(kwargs.values()), list(reply.get("args", [])) + list(
                dict(reply.get("kwargs", {})).values())):
            _update(old, new)
        if "raised" in reply:  # a built-in exception as itself (a checker may expect ValueError), others by name
            ename, message = str(reply["raised"])[:100], str(reply.get("message", ""))[:300]
            builtin = getattr(builtins, ename, None)
            if isinstance(builtin, type) and issubclass(builtin, Exception):
                raise builtin(message)
            raise type(ename if ename.isidentifier() else "Exception", (Exception,), {})(message)
        result = reply.get("result")
        if isinstance(result, wire.Foreign):
            raise ExerciseFailed(f"{self.name} returned {result!r}: only numbers, strings, lists, tuples, dicts and "
                                 "tensors are graded")
        return result


def _update(old, new) -> None:
    """Put the runner's view of an argument after the call into the judge's object, where it is mutable."""
    import torch

    if type(old) is list and type(new) is list:
        old[:] = new
    elif type(old) is dict and type(new) is dict:
        old.clear()
        old.update(new)
    elif isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        if new.shape == old.shape and new.dtype == old.dtype:
            old.copy_(new)


def _runner_reached(reply_fd: int, index: int, timeout: float) -> bool:
    """Wait until the runner has run the student's cells up to check ``index`` (it says so), within ``timeout``."""
    try:
        while True:
            header, _ = wire.receive(reply_fd, timeout)
            if header.get("ready") == index:
                return True
    except wire.WireError:
        return False


def check_outcome(entry: dict, answer, timeout: float) -> dict:
    """Run ``entry``'s pristine checker, within ``timeout`` seconds, with ``answer()`` as the student's function
    (called inside the check: what it raises is the check's outcome); the outcome as the grader reads it, one line of
    plain data (what the checker printed, the error's name and text, each capped)."""
    from lessonlib import exercises

    def alarm(signum, frame):
        raise CallTimeout(f"the check ran past the grader's limit of {timeout:g} s")

    captured, status, ename, evalue = io.StringIO(), "ok", "", ""
    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    saved = sys.stdout
    sys.stdout = captured
    try:
        scope = {name: getattr(exercises, name) for name in dir(exercises) if name.startswith("check_")}
        scope[entry["solution_id"]] = answer()
        exec(compile(entry["checker_source"], f"<checker of {entry['name']}>", "exec"), scope)
    except BaseException as e:  # noqa: BLE001 - report every failure as the check's outcome
        status, ename, evalue = "error", type(e).__name__, str(e)
        if ename == "CallTimeout":
            ename = "CellTimeout"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdout = saved
    return {"index": entry["index"], "status": status, "stdout": captured.getvalue()[-20_000:], "ename": ename[:100],
            "evalue": evalue[:4000]}


def run_judge(request_fd: int, reply_fd: int, result_fd: int) -> None:
    request = json.loads(sys.stdin.read())
    sys.stdin.close()
    timeout = float(request["cell_timeout"])
    from lessonlib import runtime

    runtime.mode()  # the Triton mode (TRITON_INTERPRET on a CPU) chosen before triton.language is imported
    from lessonlib.exercises._checking import ExerciseFailed
    from lessonlib.grading import validated as validated_runner

    valid = [e for e in request["checks"] if e.get("validated")]
    fd, pid = validated_runner.fork(valid, timeout) if valid else (-1, 0)
    validated = wire.Lines(fd, time.monotonic() + float(request["wait_timeout"]))
    for entry in request["checks"]:
        if entry.get("validated"):  # checked by the validated runner: its outcome, read as plain data
            line = validated.outcome(entry["index"])
            os.write(result_fd, json.dumps(line).encode() + b"\n")
            continue
        remote = not entry.get("refused")  # an answer the runner computes
        reached = not remote or _runner_reached(reply_fd, entry["index"], float(request["wait_timeout"]))

        def answer(entry=entry, reached=reached):
            if not reached:
                raise ExerciseFailed("not graded: your code stopped before this check (it raised, exited or ran "
                                     "past the time limit: see the notes)")
            if entry.get("refused"):
                raise ExerciseFailed(entry["refused"])
            return Remote(entry["solution_id"], request_fd, reply_fd, timeout)

        outcome = check_outcome(entry, answer, timeout)
        if remote and reached:
            try:
                wire.send(request_fd, {"done": entry["index"]})
            except OSError:
                pass
        os.write(result_fd, json.dumps(outcome).encode() + b"\n")
    if pid:  # every outcome read (or past the deadline): the validated runner is done
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    os._exit(0)


def run_runner(request_fd: int, reply_fd: int) -> None:
    """Run the student's cells in order, then answer the judge's calls at each check until it is done with it."""
    from lessonlib.grading.scoring import _source

    request = json.loads(sys.stdin.read())
    sys.stdin.close()
    folder = os.environ["LESSONLIB_GRADING_SCRATCH"]
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    namespace = main_module.__dict__
    namespace["display"] = lambda *args, **kwargs: None
    timeout = float(request["cell_timeout"])

    def alarm(signum, frame):
        raise CallTimeout(f"ran past the grader's limit of {timeout:g} s per cell")

    for index, cell in enumerate(request["cells"]):
        if "check" in cell:  # the judge checks here: answer its calls until it is done
            wire.send(reply_fd, {"ready": cell["check"]})
            _serve(namespace, request_fd, reply_fd)
            continue
        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            name, source = _source(index, cell["source"], folder)
            exec(compile(source, name, "exec"), namespace)
        except BaseException:  # noqa: BLE001 - a student's cell may raise anything
            traceback.print_exc()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    os._exit(0)


def _serve(namespace: dict, request_fd: int, reply_fd: int) -> None:
    while True:
        try:
            header, buffers = wire.receive(request_fd, 24 * 3600)
        except wire.WireError:
            os._exit(0)
        if "done" in header:
            return
        out: list[bytes] = []
        call = {"args": [], "kwargs": {}}
        try:
            call = wire.decode(header["payload"], buffers)
            fn = namespace.get(str(header["call"]))
            if fn is None:
                raise NameError(f"name {header['call']!r} is not defined")
            result = fn(*call["args"], **call["kwargs"])
            reply = wire.encode({"result": result, "args": call["args"], "kwargs": call["kwargs"]}, out)
        except BaseException as e:  # noqa: BLE001 - the student's exception, as plain text, and the arguments
            out = []
            name = type(e).__name__
            try:
                reply = wire.encode({"args": call["args"], "kwargs": call["kwargs"]}, out)
            except BaseException:  # noqa: BLE001 - arguments that cannot be sent: the exception alone
                out, reply = [], {"__dict__": {}}
            reply["__dict__"].update(raised=str.__str__(name)[:100] if isinstance(name, str) else "Exception",
                                     message=_text(e))
        wire.send(reply_fd, {"reply": reply, "id": header.get("id")}, out)


def _text(e: BaseException) -> str:
    try:
        return str.__str__(str(e))[:300]
    except BaseException:  # noqa: BLE001 - a __str__ that raises
        return ""


# ---------------------------------------------------------------------------------------------------------------
# The grader's side: what each process gets, starting both in their sandboxes, reading the judge's outcomes.


def is_kernel(exercise) -> bool:
    """A kernel exercise: its answer is a @triton.jit function (the course names them my_..._kernel; a test checks
    that the instructor notebooks agree)."""
    return exercise.solution_id.endswith("_kernel")


def validated_kind(exercise) -> str | None:
    """"kernel" or "function" where the exercise's answer is source text the validated runner defines; None where
    the runner computes it."""
    return "kernel" if is_kernel(exercise) else "function" if exercise.name in IN_PROCESS else None


def plan_checks(sources: list[str], checks: dict, exercises_: list) -> list[dict]:
    """The judge's checks: each exercise's checker source and answer (validated source for the validated runner, a
    refusal, or a call to the runner)."""
    from lessonlib.grading.kernel_source import NotAKernel, kernel_source
    from lessonlib.grading.torch_source import NotInSubset, function_source

    student = [s for i, s in enumerate(sources) if i and i not in checks]
    planned = []
    for index, exercise in sorted(checks.items()):
        entry = {"index": index, "name": exercise.name, "solution_id": exercise.solution_id,
                 "checker_source": exercise.checker_source}
        kind = validated_kind(exercise)
        if kind is not None:
            try:
                take = kernel_source if kind == "kernel" else function_source
                entry.update(validated=kind, source=take(student, exercise.solution_id))
            except (NotAKernel, NotInSubset) as e:
                entry["refused"] = f"{exercise.name}: {e}"[:300]
        planned.append(entry)
    return planned


def _start(role: str, box, env: dict, fds: tuple, log, request: dict):
    """``role``'s process in ``box``: its raw output capped into ``log``, ``request`` on its stdin."""
    from lessonlib.grading import sandbox

    entry = "import sys; from lessonlib.grading.judge import main; main(sys.argv[1:])"
    sink = sandbox.CappedSink(log, 1_000_000)
    argv = sandbox.wrap(box, [sys.executable, "-c", entry, role, *map(str, fds)], env)
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=sink.fd, stderr=sink.fd, pass_fds=fds,
                               env=env if box.mode == "none" else {"PATH": os.environ.get("PATH", "")},
                               cwd=box.work, start_new_session=True)
    try:
        process.stdin.write(json.dumps(request).encode())
        process.stdin.close()
    except BrokenPipeError:
        pass
    sink.close_writer()
    return process, sink


def score(sources: list[str], checks: dict, exercises_: list, boxes: dict, timeout: float, cell_timeout: float,
          logs: dict) -> tuple[dict[int, tuple], list[str]]:
    """Run the runner (where a check calls the student's code) and the judge, which forks the validated runner
    where there is a validated check (see the module docstring); returns ({index: (status, stdout, ename, evalue)},
    notes). ``boxes``: {"runner", "judge": (its sandbox, its environment)}; ``logs``: {role: its output file}."""
    from lessonlib.grading import sandbox, scoring

    planned = plan_checks(sources, checks, exercises_)
    remote = {e["index"] for e in planned if not e.get("validated") and not e.get("refused")}
    runner_cells = [{"source": c["source"]} if c["exercise"] is None else {"check": c["index"]}
                    for c in scoring.apart(sources, checks, exercises_)
                    if c["index"] > 0 and (c["exercise"] is None or c["index"] in remote)]
    calls_read, calls_write = os.pipe()  # the judge's calls, to the runner
    replies_read, replies_write = os.pipe()  # the runner's answers, to the judge
    results_read, results_write = os.pipe()  # the judge's outcomes, to the grader
    started = []
    if remote:
        started.append(_start("runner", *boxes["runner"], (calls_read, replies_write), logs["runner"],
                              {"cells": runner_cells, "cell_timeout": cell_timeout}))
    judge = _start("judge", *boxes["judge"], (calls_write, replies_read, results_write), logs["judge"],
                   {"cell_timeout": cell_timeout, "wait_timeout": timeout, "checks": planned})
    for fd in (calls_read, calls_write, replies_read, replies_write, results_write):
        os.close(fd)
    chunks: list[bytes] = []

    def drain():
        kept = 0
        while chunk := os.read(results_read, 1 << 16):
            if kept < 4 << 20:
                chunks.append(chunk)
                kept += len(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    notes = []
    try:
        judge[0].wait(timeout)
    except subprocess.TimeoutExpired:
        notes.append(f"stopped: the checks ran past the grader's limit of {timeout:g} s")
    for process, sink in started + [judge]:
        sandbox.stop(process)
        sink.join()
    reader.join(10)
    os.close(results_read)
    return _outcomes(b"".join(chunks), set(checks)), notes


def _outcomes(data: bytes, indices: set[int]) -> dict[int, tuple]:
    found: dict[int, tuple] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if (type(entry) is dict and entry.get("index") in indices and entry.get("status") in ("ok", "error")
                and all(type(entry.get(k)) is str for k in ("stdout", "ename", "evalue"))):
            found.setdefault(entry["index"], (entry["status"], entry["stdout"][-20_000:], entry["ename"][:100],
                                              entry["evalue"][:4000]))
    return found


def main(argv: list[str]) -> None:
    role, fds = argv[0], [int(a) for a in argv[1:]]
    (run_judge if role == "judge" else run_runner)(*fds)


if __name__ == "__main__":
    main(sys.argv[1:])
