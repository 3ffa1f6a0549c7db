"""One launch of a student's kernel, observed: every ``tl.load`` and ``tl.store`` recorded, returned as plain data.

Every kernel exercise launches the student's kernel through :func:`launch_observed` (via
:meth:`~lessonlib.exercises._guards.Guards.launch`), and so does the address figure of lesson 00.

Contract of ``launch_observed(name, kernel, grid, *args, **meta) -> Observation``:

* ``kernel`` must be a genuine Triton kernel: of the exact type ``triton.jit`` makes in this mode
  (``InterpretedFunction`` in the interpreter, ``JITFunction`` on a GPU; no subclass, no duck type), made by an
  unpatched ``triton.jit``, with Triton's own methods and no pre-run hooks. ``student=True`` (the default) also
  requires its code to be defined outside lessonlib (the submission's, not a kernel imported from the course).
  Otherwise :class:`KernelRefused` (an ``ExerciseFailed``) is raised with a one-line message, before anything runs.
* It launches ``kernel[grid](*args, **meta)`` once. In Triton's interpreter every load and store is recorded
  (addresses, masks, ``other``, the program and the kernel's source line) and checked against the tensor arguments:
  a lane outside its tensor is not performed (the process's memory stays intact) and is recorded instead. If a
  masked load without ``other=`` left lanes unset, the launch is repeated with those lanes holding NaN (integers: a
  huge value); if any tensor then ends differently, those lanes reach the result (:attr:`Observation.unset_lanes`).
  The tensors are left as the first launch left them.
* It is a pure function of (kernel, grid, args, meta): no notebook globals, no lessonlib state; the
  :class:`Observation` holds only ints, strings, lists, dicts and CPU tensors, so a separate process can run it
  and send the result back. On a GPU nothing is recorded (``recorded=False``): the launch runs, and the caller's
  guard zones (:mod:`~lessonlib.exercises._guards`) are what catch a missing mask.

Reading an observation: :func:`findings` (the accesses outside a tensor, the unset lanes that matter, a tensor
changed other than by the kernel's stores) and :func:`certify_outputs` (the tensors a checker compares are the ones
launched on, holding exactly what the kernel's recorded stores wrote).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from lessonlib import runtime
from lessonlib.exercises._checking import ExerciseFailed
from lessonlib.exercises._recording import Recorder


class KernelRefused(ExerciseFailed):
    """The object passed as the kernel is not a genuine Triton kernel of the student's (one line says why)."""


@dataclass
class Outside:
    """Lanes of one tl.load or tl.store (one source line) that fell outside their tensor; offsets in elements from
    the tensor's first element, in storage order (negative: before it)."""
    line: int
    count: int
    first: int
    last: int


@dataclass
class TensorRecord:
    """What one launch did to one tensor argument (``name``: the kernel's parameter)."""
    name: str
    data_ptr: int
    shape: tuple
    stride: tuple
    dtype: str
    before: torch.Tensor  # its values when the launch started
    after: torch.Tensor  # when it ended
    stored: torch.Tensor  # ``before`` with every recorded tl.store applied in order (what the kernel wrote)
    written: torch.Tensor  # bool like the tensor: the elements some tl.store wrote
    reads: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.int64))  # (program, offset)
    writes: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.int64))  # unique pairs
    visited: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.int64))  # masked lanes too
    reads_outside: list = field(default_factory=list)  # [Outside]
    writes_outside: list = field(default_factory=list)


@dataclass
class Observation:
    """One launch, as plain data. ``programs``: the grid's programs in launch order (program index i is
    ``programs[i]``); ``unset_lanes``: source lines of masked loads without ``other=`` whose unset lanes changed
    a tensor's final values; ``recorded``: False on a GPU, where only ``before``/``after`` are known."""
    kernel: str
    grid: tuple
    recorded: bool
    programs: list
    tensors: dict  # name -> TensorRecord
    unset_lanes: list = field(default_factory=list)  # [(line, [tensor names that changed])]


def _triton_file(module) -> str:
    import os
    return os.path.realpath(module.__file__)


def _code_file(function) -> str:
    import os
    code = getattr(function, "__code__", None)
    return os.path.realpath(code.co_filename) if code is not None else ""


def _genuine_kernel_type():
    """The class ``triton.jit`` makes in this mode, after checking that ``triton.jit`` is Triton's own."""
    import triton
    from triton.runtime import jit

    if triton.jit is not jit.jit or _code_file(jit.jit) != _triton_file(jit):
        return None, "triton.jit has been replaced: use Triton's own @triton.jit"
    if runtime.on_gpu():
        return jit.JITFunction, None
    from triton.runtime import interpreter
    return interpreter.InterpretedFunction, None


def certify_kernel(name: str, kernel, student: bool = True) -> None:
    """Raise :class:`KernelRefused` unless ``kernel`` is a genuine Triton kernel (see the module's contract)."""
    kind, problem = _genuine_kernel_type()
    what = f"{type(kernel).__name__} {getattr(kernel, '__name__', '')}".strip()
    if problem is None and type(kernel) is not kind:
        problem = (f"pass your @triton.jit kernel itself, not {what}: the checker launches the kernel and checks "
                   "what its own tl.store calls wrote")
    if problem is None:
        problem = _tampered(kernel, kind)
    fn = getattr(kernel, "fn", None)
    if problem is None and student:
        import lessonlib
        from pathlib import Path

        course = str(Path(lessonlib.__file__).resolve().parent)
        if _code_file(fn).startswith(course):
            problem = (f"{fn.__name__} is lessonlib's kernel, not yours: define your own @triton.jit kernel in the "
                       "notebook")
    if problem is not None:
        raise KernelRefused(f"{name}: {problem}.")


def _tampered(kernel, kind) -> str | None:
    import types

    fn = getattr(kernel, "fn", None)
    if type(fn) is not types.FunctionType:
        return f"the kernel's function is a {type(fn).__name__}, not a Python function under @triton.jit"
    module = sys.modules[kind.__module__]
    for attribute in ("run", "__call__", "rewrite", "__init__"):
        method = kind.__dict__.get(attribute)
        if method is not None and _code_file(method) != _triton_file(module):
            return f"Triton's {kind.__name__}.{attribute} has been replaced"
    # Triton sets data on the instance, some of it lazily (a JITFunction's compile, at its first launch); a method
    # set on the instance would run instead of Triton's.
    shadowing = sorted(k for k in vars(kernel) if callable(getattr(kind, k, None)))
    if shadowing:
        return f"the kernel object's {', '.join(shadowing)} replaced Triton's"
    if getattr(kernel, "pre_run_hooks", None):
        return "the kernel has pre-run hooks: launch a plain @triton.jit kernel"
    rewriter = getattr(kernel, "rewriter", None)
    if rewriter is not None and (type(rewriter) is not getattr(module, "FunctionRewriter", None)
                                 or getattr(rewriter, "fn", None) is not fn):
        return "the kernel's source rewriter is not Triton's, for this function"
    return None


def launch_observed(name: str, kernel, grid, *args, student: bool = True, **meta) -> Observation:
    """Certify ``kernel``, launch ``kernel[grid](*args, **meta)`` once and return what it did (module docstring)."""
    certify_kernel(name, kernel, student)
    grid = tuple(int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,)))
    names = list(getattr(kernel, "arg_names", None) or [])
    # A tensor is named by its parameter without "_ptr" (out_ptr: "out"), as the lessons name it.
    tensors = {(names[i] if i < len(names) else f"arg{i}").removesuffix("_ptr"): a for i, a in enumerate(args)
               if isinstance(a, torch.Tensor)}
    tensors.update({k.removesuffix("_ptr"): v for k, v in meta.items() if isinstance(v, torch.Tensor)})
    if runtime.on_gpu():
        from lessonlib.ops._common import launch

        before = {k: t.detach().cpu().clone() for k, t in tensors.items()}
        launch(kernel, grid, *args, **meta)
        records = {k: _plain_record(k, t, before[k]) for k, t in tensors.items()}
        return Observation(kernel.fn.__name__, grid, False, [], records)
    recorder = Recorder(tensors, kernel.fn.__code__.co_filename)
    _run_recorded(kernel, grid, args, meta, recorder)
    first = recorder.result()
    unset = []
    if recorder.unset_sites:
        unset = _unset_lanes_that_matter(kernel, grid, args, meta, tensors, recorder, first)
    records = {k: recorder.tensor_record(k, first[k], TensorRecord, Outside) for k in tensors}
    return Observation(kernel.fn.__name__, grid, True, recorder.programs(grid), records, unset)


def _plain_record(name: str, t: torch.Tensor, before: torch.Tensor) -> TensorRecord:
    after = t.detach().cpu().clone()
    return TensorRecord(name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."),
                        before, after, after.clone(), torch.zeros(t.shape, dtype=torch.bool))


def _run_recorded(kernel, grid, args, meta, recorder) -> None:
    kind = type(kernel)
    kind.rewritten_fn.pop(kernel.fn, None)  # rewrite from the kernel's own source, not a cached function
    with recorder.recording():
        kind.run(kernel, *args, grid=grid, warmup=False, **meta)


def _unset_lanes_that_matter(kernel, grid, args, meta, tensors, recorder, first) -> list:
    """Relaunch with the unset lanes of each masked load without ``other=`` poisoned, from the same starting
    values: the sites whose poison changes a tensor's final values. All sites at once first (the common case: none
    matters); then one at a time, to name the lines. The tensors end as the first launch left them."""

    def changed_with(sites) -> list[str]:
        for k, t in tensors.items():
            t.copy_(recorder.before[k])
        probe = recorder.poisoned_copy(sites)
        _run_recorded(kernel, grid, args, meta, probe)
        return [k for k, t in tensors.items() if not _same_bits(t, first[k])]

    sites = sorted(recorder.unset_sites)
    try:
        changed = changed_with(sites)
        if not changed:
            return []
        if len(sites) == 1:
            return [(sites[0], changed)]
        found = [(line, what) for line in sites for what in [changed_with([line])] if what]
        return found or [(sites[0], changed)]  # only together (each alone changes nothing): name the first
    finally:
        for k, t in tensors.items():
            t.copy_(first[k])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(a.view(-1).view(torch.uint8).numpy(), b.view(-1).view(torch.uint8).numpy()))


# --- Reading an observation ------------------------------------------------------------------------------------


def findings(obs: Observation) -> list[str]:
    """One line per thing the launch did wrong that no output comparison could show: reads and writes outside a
    tensor (even when the value is unused), unset lanes that reach a result, a tensor changed by something other
    than the kernel's stores. Empty for a clean launch (and on a GPU, which records nothing)."""
    lines = []
    for what, kind, verb, advice in (("writes_outside", "tl.store", "written", "A tl.store of a block that can "
                                      "run past the end needs mask=offsets < n."),
                                     ("reads_outside", "tl.load", "read", "A tl.load of a block that can run past "
                                      "the end needs mask=offsets < n, even where its value ends up unused.")):
        bad = [r for r in obs.tensors.values() if getattr(r, what)]
        if bad:
            names = " and ".join(r.name for r in bad)
            first = getattr(bad[0], what)[0]
            numel = int(np.prod(bad[0].shape)) if bad[0].shape else 1
            lines.append(f"elements {first.first}..{first.last} outside {names} were {verb} ({bad[0].name} has "
                         f"{numel} elements, 0..{numel - 1}; the {kind} at line {first.line} of {obs.kernel}): a "
                         f"missing mask? {advice}")
    for line, changed in obs.unset_lanes:
        lines.append(f"the masked tl.load at line {line} of {obs.kernel} has no other=, and its masked-off lanes "
                     f"reach {' and '.join(changed)}: on a GPU those lanes hold whatever was in the registers (the "
                     "interpreter gives 0). Give the load the value the lanes must contribute, e.g. other=0.0 for "
                     "a sum, or keep them out with tl.where.")
    for r in obs.tensors.values():
        if obs.recorded and not _same_bits(r.after, r.stored):
            lines.append(f"{r.name} changed during the launch other than through {obs.kernel}'s tl.store calls: "
                         "only what the kernel's own stores write is checked")
    return lines


def certify_outputs(name: str, obs: Observation, outputs: dict) -> None:
    """Raise :class:`KernelRefused` unless each tensor in ``outputs`` ({parameter name: the checker's tensor}) is
    the very tensor the observed launch was given and still holds exactly what the kernel's stores wrote there."""
    for what, t in outputs.items():
        record = obs.tensors.get(what)
        if record is None or record.data_ptr != t.data_ptr() or tuple(t.shape) != record.shape:
            raise KernelRefused(f"{name}: the kernel was not launched on the checker's {what}: only a launch on the "
                                "tensors the checker made counts.")
        if obs.recorded and not _same_bits(t, record.stored):
            raise KernelRefused(f"{name}: {what} was changed after your kernel's launch (it no longer holds what "
                                f"{obs.kernel}'s tl.store calls wrote): only the kernel's own stores count.")
