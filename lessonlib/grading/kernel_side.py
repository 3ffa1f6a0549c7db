"""What runs inside the scoring process (:mod:`lessonlib.grading.scoring`) with the student's code: the prelude that
snapshots what the checks rely on, and the cell that runs the instructor's pristine checker with lessonlib's checking
modules imported fresh (see :mod:`lessonlib.grading`).

Written out as source: it runs in another process, and the grader must not depend on anything the student's code
can replace before it runs (the prelude runs before any student cell).
"""

from __future__ import annotations

from lessonlib.grading.exercise_format import Exercise

KERNEL_SIDE = r'''
import builtins, functools, importlib, math, os, random, sys, types

import torch
import torch.nn.functional
import torch.testing
import torch.linalg

WATCHED = ("builtins", "math", "random", "torch", "torch.nn.functional", "torch.testing", "torch.linalg")
# lessonlib's checking modules: imported fresh for every check. The others (ops, serving...) own process-wide
# state (compiled kernels, registered custom ops, a vLLM engine) and are only watched for replaced functions.
FRESH = ("runtime", "reference", "testing", "exercises", "kv_cache", "compiler")
SCRATCH = os.path.realpath(os.environ["LESSONLIB_GRADING_SCRATCH"])
LIBRARIES = tuple(sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path)
                          if p and os.path.isdir(p) and not os.path.realpath(p).startswith(SCRATCH)}))


class GradingRefused(Exception):
    """The notebook replaced something the checks rely on: no points for this check."""


def _file_of(obj):
    code = getattr(obj, "__code__", None) or getattr(getattr(obj, "__func__", None), "__code__", None)
    if code is not None:
        return code.co_filename
    if isinstance(obj, type):
        return getattr(sys.modules.get(obj.__module__), "__file__", None)
    return None


C_CODE = (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType, types.MethodWrapperType,
          types.MethodDescriptorType, types.ClassMethodDescriptorType)


def _is_library(obj):
    """Defined in a file of an installed library (or lessonlib itself), not in a notebook cell or the scratch.
    C functions count as a library's (a notebook cannot write one); a partial by what it wraps; any other callable
    object by its class."""
    if isinstance(obj, C_CODE):
        return True
    if isinstance(obj, functools.partial):
        return _is_library(obj.func)
    if not isinstance(obj, (type, types.FunctionType, types.MethodType)):
        return _is_library(type(obj))
    if _is_library_file(_file_of(obj)):
        return True
    # Code that a library made with exec (dataclasses' __init__, namedtuple's __new__): file "<string>", globals
    # those of the library's module. exec in a notebook cell has the notebook's globals (__main__).
    function = getattr(obj, "__func__", obj)
    code, module = getattr(function, "__code__", None), sys.modules.get(getattr(function, "__module__", None) or "")
    return (code is not None and code.co_filename.startswith("<") and module is not None
            and module.__name__ != "__main__" and getattr(function, "__globals__", None) is vars(module)
            and _is_library_file(getattr(module, "__file__", None)))


def _is_library_file(path):
    if not path or not os.path.isfile(path):
        return False
    path = os.path.realpath(path)
    return not path.startswith(SCRATCH) and path.startswith(LIBRARIES)


def _state():
    modules = {name: sys.modules.get(name) for name in WATCHED}
    values = {name: dict(vars(module)) for name, module in modules.items() if module is not None}
    values["torch.Tensor"] = dict(vars(torch.Tensor))
    return modules, values, list(sys.meta_path), list(sys.path_hooks)


_SNAPSHOT = _state()


def _lessonlib_changes():
    changes = []
    for name, module in list(sys.modules.items()):
        if name != "lessonlib" and not name.startswith("lessonlib."):
            continue
        if not isinstance(module, types.ModuleType) or not _is_library_file(getattr(module, "__file__", None)):
            changes.append(f"sys.modules[{name!r}]")
            continue
        for key, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType) and not _is_library(value):
                changes.append(f"{name}.{key}")
            elif isinstance(value, type) and value.__module__ == name:
                for attr, member in list(vars(value).items()):
                    member = getattr(member, "__func__", None) or getattr(member, "fget", None) or member
                    if isinstance(member, types.FunctionType) and not _is_library(member):
                        changes.append(f"{name}.{key}.{attr}")
    return changes


def changes():
    """What was replaced since the prelude by code that is not a library's."""
    modules, values, meta_path, path_hooks = _SNAPSHOT
    found = _lessonlib_changes()
    for name, module in modules.items():
        if module is not None and sys.modules.get(name) is not module:
            found.append(f"sys.modules[{name!r}]")
    current = {name: vars(module) for name, module in modules.items() if module is not None}
    current["torch.Tensor"] = vars(torch.Tensor)
    for name, before in values.items():
        now = current[name]
        for key, old in before.items():
            new = now.get(key, GradingRefused)
            if new is not old and (callable(old) or callable(new)) and not _is_library(new):
                found.append(f"{name}.{key}")
    for hooks, before in ((sys.meta_path, meta_path), (sys.path_hooks, path_hooks)):
        found += [f"import hook {type(h).__name__}" for h in hooks if h not in before and not _is_library(type(h))]
    return found


def _fresh(name):
    return name == "lessonlib" or (name.startswith("lessonlib.") and name.split(".")[1] in FRESH)


def _of_exercises(obj):
    """Defined in lessonlib.exercises (one of its lesson modules)."""
    return (getattr(obj, "__module__", None) or "").startswith("lessonlib.exercises.")


def check(exercise, source, namespace):
    """Run the pristine checker cell ``source`` against the student's names, with lessonlib's checkers fresh."""
    replaced = changes()
    if replaced:
        raise GradingRefused(f"no points for {exercise}: the notebook replaced what the checks rely on: "
                             + ", ".join(replaced[:8]) + (" ..." if len(replaced) > 8 else ""))
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if _fresh(name)}
    try:
        exercises = importlib.import_module("lessonlib.exercises")
        scope = dict(namespace)
        for name in dir(exercises):
            checker = getattr(exercises, name)
            if name.startswith("check_") and _of_exercises(checker):
                if name in namespace and not _of_exercises(namespace[name]):
                    print(f"(note: {name} was redefined in the notebook; lessonlib's own {name} ran)")
                scope[name] = checker
        exec(compile(source, f"<checker of {exercise}>", "exec"), scope)
    finally:
        for name in [name for name in sys.modules if _fresh(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
'''

PRELUDE = f"""\
# lessonlib.grading: set up before the student's first cell (snapshot of what the checks rely on)
import sys as _s, types as _t
_s.modules["_lessonlib_grading"] = _m = _t.ModuleType("_lessonlib_grading")
exec({KERNEL_SIDE!r}, _m.__dict__)
del _s, _t, _m
"""


def checker_cell(exercise: Exercise) -> str:
    return (f"# lessonlib.grading: the instructor's checker for {exercise.name}, with lessonlib's checkers fresh\n"
            f"__import__('sys').modules['_lessonlib_grading'].check({exercise.name!r}, "
            f"{exercise.checker_source!r}, globals())")
