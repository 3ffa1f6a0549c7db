"""Plans: an op's launches kept by the signature of its inputs, so that a repeated call skips the op's validation
and the launch key (issue 27: at decode sizes those steps were half of an op's host time).

The cached launch (``_launcher.py``) skips Triton's binder for a configuration it has launched before; it still
builds its key from every argument on each call, and the op still validates its inputs first. A plan goes one step
further for the ops whose calls repeat at decode sizes (swiglu, add_rms_norm): see :class:`Plans`. The launcher's
state is read through the module (``_launcher.<name>``) at every call, so that tests and ``plain_launches()`` act
on plans as they act on the cached launch.
"""

from __future__ import annotations

import torch

from lessonlib.ops import _launcher


class Plans:
    """One op's launches kept by the *signature* of its inputs, so that a call whose inputs have the signature of an
    earlier call skips the op's validation, its launch configuration and the launch key, and goes to the C launch
    function of Triton 3.6 with the new tensors' addresses (issue 27: at decode sizes those steps were half of an
    op's host time; benchmarks/experiments/per_call_parts.py times each).

    A signature is what the op's validation and its launch read from its inputs: per tensor its class, dtype,
    device, shape and strides, and the op's other arguments (each op's ``_signature``). Two calls with one
    signature pass or fail validation alike, and launch the same kernel with the same grid and the same ints; only
    the tensors' addresses differ. The launch key holds one more property of an address, its alignment to 16
    bytes: a plan is kept only for calls whose tensors are all aligned, and :meth:`launch` checks each new address
    (a fresh output's too). The op keeps the plan after its full path has launched through
    :func:`_launcher.launch` from the cache, so the plan's compiled kernel is the one that launch chose for these
    inputs.

    :meth:`launch` declines (the op then takes its full path, which decides as before) wherever
    :func:`_launcher.launch` would not take the cache: ``plain_launches()``, the cached path off, a launch hook or a
    pre-run hook, a global the kernel read has changed; and where the current device or an address's alignment is
    not the plan's. Only the C-function form is planned (Triton 3.6, Colab's); elsewhere the op's calls take
    :func:`_launcher.launch`'s cached path.
    """

    def __init__(self, kernel):
        self.kernel, self._plans = kernel, {}

    def get(self, signature) -> _Plan | None:
        """The plan of an earlier call with this signature, or None (also for None: a signature the op could not
        take, such as a non-tensor's)."""
        try:
            return self._plans.get(signature)
        except TypeError:  # an unhashable part: not inputs the op accepts
            return None

    def remember(self, signature, grid, args, meta) -> None:
        """After the op launched ``kernel[grid](*args, **meta)`` through :func:`_launcher.launch` for inputs with this
        signature: keep a plan when that launch's configuration is cached with the C function's form, ``args``
        are the tensors (all aligned to 16 bytes) then the other arguments, and every tensor is a plain tensor or
        a parameter (a subclass could answer the signature's questions otherwise than the kernel sees it)."""
        if (signature is None or signature in self._plans or len(self._plans) >= _MAX_PLANS
                or _launcher._forced_plain[0] or not _launcher.works_here() or grid.__class__ is not tuple):
            return
        n_tensors = 0
        while n_tensors < len(args) and isinstance(args[n_tensors], torch.Tensor):
            if args[n_tensors].__class__ not in _PLAIN_TENSORS or args[n_tensors].data_ptr() & 15:
                return
            n_tensors += 1
        if any(isinstance(a, torch.Tensor) for a in args[n_tensors:]):
            return
        device = _launcher._driver().get_current_device()
        key, arguments = _launcher.key_and_arguments(self.kernel, device, args, meta)
        entry = _launcher._compiled.get(key) if key is not None else None
        if entry is None or entry.c_launch is None:
            return
        grid = (*grid, 1, 1)[:3]
        self._plans[signature] = _Plan(entry, device, grid, (*arguments[n_tensors:], *entry.tail))

    def launch(self, plan: _Plan, *addresses: int) -> bool:
        """Launch ``plan`` for tensors at ``addresses`` (the kernel's tensor arguments in order); False, with nothing
        launched, where the op must take its full path (see the class docstring)."""
        entry = plan.entry
        decided = _launcher._decided
        if (_launcher._forced_plain[0] or not (decided[0] is None if decided else _launcher.works_here())
                or not _launcher._hooks_idle(self.kernel)
                or (entry.globals_read and _launcher._globals_changed(entry))):
            return False
        for address in addresses:
            if address & 15:
                return False
        driver = _launcher._driver()
        device = driver.get_current_device()
        if device != plan.device:
            return False
        grid = plan.grid
        entry.c_launch(grid[0], grid[1], grid[2], driver.get_current_stream(device), entry.function,
                       entry.cooperative, entry.pdl, None, None, entry.packed_metadata, None, None, None,
                       *addresses, *plan.rest)
        return True

    def clear(self) -> None:
        self._plans.clear()


class _Plan:
    """One signature's launch: the cache entry, the device it was launched on, the grid as three ints, and the
    arguments after the tensors (the op's ints and floats, then the constexprs)."""

    __slots__ = ("entry", "device", "grid", "rest")

    def __init__(self, entry, device, grid, rest):
        self.entry, self.device, self.grid, self.rest = entry, device, grid, rest


_MAX_PLANS = 1024  # per op: past that, new signatures take the op's full path (still the cached launch)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
