"""Guard zones around the tensors a checker hands to a student's kernel, and the one way a lesson launches a
student's kernel (:meth:`Guards.launch`), so that a missing mask is caught and named instead of corrupting memory.

In Triton's interpreter (CPU) every launch of a student's kernel is observed
(:func:`~lessonlib.exercises._observe.launch_observed`): each load and store is recorded, a lane outside its
tensor is named (performed only inside memory the tensor's own buffer owns: a guard zone below), and the outputs
compared are certified to hold what the kernel's own stores wrote (:meth:`Guards.certify`). On a GPU nothing can
be recorded, and the guard zones below are what catch a missing mask (:data:`GPU_NOTE` says so once):

a store past a tensor's end writes into whatever the process keeps there (in the interpreter, without the
recorder, the notebook's kernel would die: ``free(): invalid pointer``). So every tensor a kernel exercise's kernel
touches is placed in the middle of a larger buffer, ``[guard | tensor | guard]``, each guard at
least as large as the tensor plus one tile (:data:`MARGIN`): an access that a missing mask lets run up to a tile
past either end stays inside memory the buffer owns. Afterwards:

* writes: every guard must still hold what it was filled with; the first and last element changed are named;
* reads: inputs' guards hold NaN, so an unmasked load whose value reaches the output makes it NaN. When an output
  holds NaN, the launch is repeated with one tensor's guards holding 0 instead: if the output changes, the kernel
  read outside that tensor.

Outputs' guards hold a finite sentinel, not NaN: an unmasked load past an input's end gives NaN, and storing that
NaN past the output's end must still count as a write.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from lessonlib import runtime
from lessonlib.exercises import _observe
from lessonlib.exercises._checking import ExerciseFailed, passed

GPU_NOTE = ("(On a GPU the checker cannot record your kernel's loads and stores: it sees a store into the guard "
            "zone around a tensor, and a read past an input's end whose value reaches the output. A read whose value "
            "goes unused, and masked lanes without other=, are named only in the Triton interpreter, on a CPU.)")
_gpu_note_shown = []

# Elements of slack beyond the tensor's own size on each side: the largest tile an exercise launcher uses (a
# FlashAttention tile of 32 keys x 128 dims on a GPU; 1,024 elements for swiglu's blocks; rows of up to 1,024).
MARGIN = 4096
OUTPUT_SENTINEL = -12345.0  # exact in float16, bfloat16 and float32; no exercise's output takes this value
INT_FILL = -1  # an index guard: a table or slot read past its end gives -1, which lands in another tensor's guard


def _fill_for(dtype: torch.dtype, output: bool):
    if not dtype.is_floating_point:
        return INT_FILL
    return OUTPUT_SENTINEL if output else float("nan")


class Guards:
    """The guarded tensors of one launch: :meth:`place` copies an input into a guarded buffer, :meth:`empty`
    allocates an output there (NaN-poisoned, as ``testing.poisoned_outputs`` does), :meth:`check_writes` and
    :meth:`run` find accesses outside them."""

    def __init__(self, name: str, computes: str = "", advice: dict | None = None):
        self.name = name
        self.computes = computes  # what each program must store: named to a stub that stores nothing
        self.advice = advice or {}  # tensor -> what its accesses need, added to a finding that names it
        self.zones = []  # (what, buffer, start, numel, fill, output)
        self.tracked = []  # the tensors this check made: certified against the launch's record
        self.observations = []  # one Observation per launch
        self.deferred = []  # reads outside a tensor: named once the values are judged (judged)

    def track(self, t: torch.Tensor, output: bool = False) -> torch.Tensor:
        """A tensor made for this check (lesson 00's own guarded views too): certified after the launch; an
        ``output`` must have been given to the launch."""
        if output:
            t._lessonlib_output = True
        self.tracked.append(t)
        return t

    def launch(self, kernel, grid, *args, **meta):
        """Launch the student's ``kernel[grid](*args, **meta)``, observed (:mod:`~lessonlib.exercises._observe`):
        a refused kernel, an access outside a tensor, unset lanes that reach a result, or a tensor changed other
        than by the kernel's stores raise :class:`ExerciseFailed` naming it."""
        if runtime.on_gpu() and not _gpu_note_shown:
            _gpu_note_shown.append(passed(GPU_NOTE))
        obs = _observe.launch_observed(self.name, kernel, grid, *args, **meta)
        self.observations.append(obs)
        problems = _observe.findings(obs)
        # A read outside a tensor is named after the values are judged (see judged): a wrong stride that reads the
        # padding is better named by the checker's diagnosis; everything else is named now.
        now = [p for p in problems if " were read " not in p]
        if obs.recorded and self.computes and not now and not any(r.written.any() for r in obs.tensors.values()):
            raise ExerciseFailed(f"{self.name}: not implemented yet: {obs.kernel} stored nothing. Write its body "
                                 f"where it says YOUR CODE HERE: each program must {self.computes}.")
        self.deferred.extend(p for p in problems if " were read " in p)
        if now:
            raise ExerciseFailed(f"{self.name}: {self._advised(now[0])}")
        return obs

    def _advised(self, finding: str) -> str:
        import re

        named = re.match(r"elements \S+ outside (\w+)", finding)
        extra = self.advice.get(named.group(1)) if named else None
        return f"{finding} {extra}" if extra else finding

    @contextmanager
    def judged(self):
        """Around a check's comparison of values: a read outside a tensor, recorded by the launch, is named if the
        values pass, or fail without naming a known mistake (NaN from the read, say); a known mistake named by the
        checker is named first."""
        try:
            yield
        except ExerciseFailed as failure:
            if not failure.named and self.deferred:
                raise ExerciseFailed(f"{self.name}: {self._advised(self.deferred[0])}") from None
            raise
        if self.deferred:
            raise ExerciseFailed(f"{self.name}: {self._advised(self.deferred[0])}")

    def certify(self, *results) -> None:
        """After the check's launch: each tensor this check made that the launch was given still holds exactly
        what the kernel's stores wrote; each output made here and each tensor in ``results`` (what the launcher
        returned) was given to the launch."""
        outputs = [t for t in self.tracked if getattr(t, "_lessonlib_output", False)]
        must = [t for t in [*outputs, *results] if isinstance(t, torch.Tensor) and t.numel()]
        if not self.observations:
            if must:
                raise _observe.KernelRefused(f"{self.name}: the checker's launch of your kernel never ran")
            return
        obs = self.observations[-1]
        launched = {record.data_ptr: name for name, record in obs.tensors.items()}
        for t in [*must, *self.tracked]:
            if t.numel() and (t.data_ptr() in launched or any(t is m for m in must)):
                _observe.certify_outputs(self.name, obs, {launched.get(t.data_ptr(), "output"): t})

    def _allocate(self, what: str, shape, dtype, device, output: bool) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= int(size)
        guard = numel + MARGIN
        fill = _fill_for(dtype, output)
        buffer = torch.full((guard + numel + guard,), fill, dtype=dtype, device=device)
        self.zones.append((what, buffer, guard, numel, fill, output))
        return buffer[guard:guard + numel].view(shape)

    def place(self, what: str, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of input ``t`` inside a guarded buffer."""
        view = self._allocate(what, t.shape, t.dtype, t.device, output=False)
        return self.track(view.copy_(t))

    def empty(self, what: str, like: torch.Tensor) -> torch.Tensor:
        """An output shaped like ``like``, NaN-filled (integers: 0), inside a guarded buffer."""
        view = self._allocate(what, like.shape, like.dtype, like.device, output=True)
        view.fill_(float("nan") if like.is_floating_point() else 0)
        return self.track(view, output=True)

    def check_writes(self) -> None:
        """Raise ExerciseFailed naming the first tensor whose guard was written, and the elements written."""
        for what, buffer, start, numel, fill, _ in self.zones:
            for zone, offset in ((buffer[:start], -start), (buffer[start + numel:], numel)):
                kept = zone.isnan() if isinstance(fill, float) and fill != fill else zone == fill
                if not bool(kept.all()):
                    changed = (~kept).nonzero().flatten()
                    first, last = int(changed[0]) + offset, int(changed[-1]) + offset
                    raise ExerciseFailed(
                        f"{self.name}: elements {first}..{last} outside {what} were written ({what} has {numel} "
                        f"elements, 0..{numel - 1}): a missing mask? A tl.store of a block that can run past the "
                        "end needs mask=offsets < n.")

    @contextmanager
    def _input_guards(self, names, value: float):
        """Inside: the guards of the inputs ``names`` hold ``value``; afterwards, what they held before."""
        zones = [(buffer[:start], buffer[start + numel:]) for what, buffer, start, numel, _, _ in self.zones
                 if what in names]
        saved = [(before.clone(), after.clone()) for before, after in zones]
        for before, after in zones:
            before.fill_(value)
            after.fill_(value)
        try:
            yield
        finally:
            for (before, after), (old_before, old_after) in zip(zones, saved):
                before.copy_(old_before)
                after.copy_(old_after)

    def run(self, launch, outputs=lambda result: result):
        """``launch()`` (the call under check), then check the guards; in the interpreter, certify the launch
        (the recorder named any access outside a tensor already). On a GPU: ``outputs(result)``: the tensors it
        produced (a tensor or a tuple; in-place outputs included). If they hold NaN, repeat the launch with every float
        input's guards at 0: if the output changes, the kernel read outside an input, and one more launch per input
        (its guards NaN again, the others' 0) names which. A stub's untouched NaN output costs one more launch."""

        def produced(result):
            made = outputs(result)
            return [t.clone() for t in (made if isinstance(made, (tuple, list)) else (made,))
                    if isinstance(t, torch.Tensor) and t.is_floating_point()]

        def differ(a, b):
            return any(not torch.equal(x.isnan(), y.isnan()) or not torch.equal(x.nan_to_num(), y.nan_to_num())
                       for x, y in zip(a, b))

        result = launch()
        self.check_writes()
        if not runtime.on_gpu():  # observed: an access outside a tensor was named by the launch itself
            self.certify(*(result if isinstance(result, (tuple, list)) else (result,)))
            return result
        first = produced(result)
        if not any(bool(t.isnan().any()) for t in first):
            return result
        inputs = list(dict.fromkeys(z[0] for z in self.zones if not z[5] and isinstance(z[4], float)))
        with self._input_guards(inputs, 0.0):
            zeroed = produced(launch())
            if not differ(first, zeroed):
                return result
            read = []
            for what in inputs:
                with self._input_guards([what], float("nan")):
                    if differ(zeroed, produced(launch())):
                        read.append(what)
        where = " and ".join(read) or " and ".join(inputs)
        raise ExerciseFailed(
            f"{self.name}: elements outside {where} were read: the output changed when only the memory just before "
            f"and after {'them' if len(read) > 1 else 'it'} changed. A missing mask? A tl.load of a block that can "
            "run past the end needs mask=offsets < n (and other=0.0 where the value is used).")


@contextmanager
def launch_guards(name: str, guards: Guards | None):
    """The guards a launcher allocates its outputs in: the checker's; else, in the interpreter, its own (a store
    past the end there corrupts the process's memory and kills the notebook's kernel), checked after the launch;
    else (a GPU, timing) none, so a timed launch allocates and checks nothing extra."""
    if guards is not None or runtime.on_gpu():
        yield guards
        return
    own = Guards(name)
    yield own
    own.check_writes()
    own.certify()
    if own.deferred:
        raise ExerciseFailed(f"{name}: {own.deferred[0]}")


def launch_kernel(guards: Guards | None, name: str, kernel, grid, *args, **meta):
    """How every exercise launcher launches the student's kernel: through ``guards`` (observed in the interpreter,
    :meth:`Guards.launch`); without guards (on a GPU, a timed launch) the kernel is certified, then launched bare."""
    if guards is not None:
        return guards.launch(kernel, grid, *args, **meta)
    from lessonlib.ops._common import launch

    _observe.certify_kernel(name, kernel)
    return launch(kernel, grid, *args, **meta)


def output_like(guards: Guards | None, what: str, like: torch.Tensor) -> torch.Tensor:
    """An output shaped like ``like``: guarded when there are guards, else ``torch.empty_like``."""
    return torch.empty_like(like) if guards is None else guards.empty(what, like)
