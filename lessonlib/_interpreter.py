"""Triton's interpreter without one repeated cost: the language re-patched at every helper call.

To run a kernel on the CPU, Triton's interpreter (3.6 to 3.9) replaces triton.language's builtins with NumPy versions
(``_patch_lang``) when a launch starts, and undoes it when the launch ends. It also calls ``_patch_lang`` at *every
call* of a ``@triton.jit`` helper from the kernel (``_rotate_heads``, ``pdl_wait_then_trigger``, ``tl.sigmoid``...),
once per program: each time it scans the language modules (``inspect.getmembers``) to replace what the launch has
already replaced. In kernels that call helpers that scan was most of the interpreter's time: add_rms_norm on 300
rows of 512 took 1.5 s of CPU, 0.5 s without it (Triton 3.9).

:func:`install` skips a helper's ``_patch_lang`` when the language modules its function sees (``tl``,
``tl.core``) were already patched by the launch in progress; a helper that sees one not yet patched (Triton's own
functions see ``triton.language.core``) still gets Triton's call, once per launch. The launch's own patch and its
undoing are Triton's, unchanged, and so is every result (tests/ops/test_interpreter.py runs kernels both ways and
compares the bits). :func:`lessonlib.runtime.mode` installs it in interpreter mode; nothing changes on a GPU. Where
the interpreter is not built this way (another Triton), nothing is installed and kernels run as before, slower.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager


def install() -> bool:
    """Skip the helpers' repeated patching in Triton's interpreter; True if installed (now or before)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    if getattr(interpreter, "_lessonlib_originals", None):
        return True
    if not all(hasattr(interpreter, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor", "tl")):
        return False
    patch_lang, run_grid = interpreter._patch_lang, interpreter.GridExecutor.__call__
    languages = (interpreter.tl, interpreter.tl.core)
    seen_by: dict[object, frozenset[int]] = {}  # a jit function -> ids of the language modules its globals hold
    patched: list[set[int]] = []  # per launch in progress: the language modules patched for it so far

    def patch_lang_once_per_launch(fn):
        if fn not in seen_by:
            seen_by[fn] = frozenset(id(value) for value in fn.__globals__.values()
                                    if inspect.ismodule(value) and value in languages)
        if patched and seen_by[fn] <= patched[-1]:
            return interpreter._LangPatchScope()  # patched already: nothing to do, nothing to undo
        scope = patch_lang(fn)
        if patched:
            patched[-1].update(seen_by[fn])
        return scope

    def run_grid_tracking_patches(self, *args, **kwargs):
        patched.append(set())
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = patch_lang_once_per_launch
    interpreter.GridExecutor.__call__ = run_grid_tracking_patches
    interpreter._lessonlib_originals = (patch_lang, run_grid)
    return True


def installed() -> bool:
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    return bool(getattr(interpreter, "_lessonlib_originals", None))


@contextmanager
def plain_interpreter():
    """Triton's interpreter as Triton ships it, for the duration (the tests compare results both ways)."""
    from triton.runtime import interpreter

    originals = getattr(interpreter, "_lessonlib_originals", None)
    if not originals:
        yield
        return
    faster = interpreter._patch_lang, interpreter.GridExecutor.__call__
    interpreter._patch_lang, interpreter.GridExecutor.__call__ = originals
    try:
        yield
    finally:
        interpreter._patch_lang, interpreter.GridExecutor.__call__ = faster
