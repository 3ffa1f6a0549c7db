"""A PyTorch-function exercise's answer as the grader takes it, where the checker must run the function in its own
process (lesson 04's ``torch.compile`` traces it, lesson 05's CUDA graph captures it): the source of the
submission's function (and of the plain functions it calls), read from the notebook's cells with :mod:`ast`, and
accepted only when it is written in a small PyTorch-tensor subset: parameters, local names, arithmetic,
comparisons, ``if``/``for``/``while``, subscripts (read and written), comprehensions, calls of the public functions of
``torch``, ``torch.nn.functional`` (``F``), ``math`` and ``lessonlib.reference``, of a few built-ins (``range``,
``len``, ``min``, ``max``, ``float``...), of its helpers, and public tensor methods and attributes. No import, no
attribute assignment, no ``global``/``nonlocal``, no lambda, class, ``try``, ``with`` or nested function, no name or
attribute starting with ``_``, and none of ``sys``, ``gc``, ``inspect``, ``builtins``, ``open``, ``exec``, ``eval``,
``getattr``, ``setattr``, ``globals``: what the validated runner (:mod:`~lessonlib.grading.validated`) then defines
and hands to the checker computes on tensors and reaches nothing of the checker's."""

from __future__ import annotations

import ast
import re

from lessonlib.grading.scoring import AST_LOCK, MAGIC

# The names the validated runner binds for the function (validated.MODULES), and the built-ins it may call.
MODULES = ("torch", "F", "math", "reference")
BUILTINS = {"range", "len", "min", "max", "abs", "float", "int", "bool", "tuple", "list", "dict", "enumerate", "zip",
            "sum", "round", "isinstance", "slice", "reversed", "sorted", "any", "all", "print", "NotImplementedError",
            "ValueError", "TypeError", "RuntimeError", "IndexError", "AssertionError"}
# Names refused wherever they appear: they reach the interpreter, the process or the checker's frames.
FORBIDDEN = {"sys", "gc", "inspect", "builtins", "open", "exec", "eval", "compile", "getattr", "setattr", "delattr",
             "hasattr", "globals", "locals", "vars", "type", "object", "super", "os", "ctypes", "importlib",
             "breakpoint", "input", "memoryview", "id", "dir", "help"}
# Modules and functions of torch that reach past tensors: files, pickles, compilers, hooks, process-wide settings.
DENIED = {"load", "save", "from_file", "compile", "jit", "hub", "utils", "library", "ops", "classes", "package", "fx",
          "export", "overrides", "multiprocessing", "distributed", "backends", "serialization", "compiler", "cuda",
          "autograd", "set_default_dtype", "set_default_device", "set_default_tensor_type", "manual_seed", "seed",
          "set_rng_state", "use_deterministic_algorithms", "set_grad_enabled", "set_num_threads",
          "set_printoptions", "set_warn_always", "set_flush_denormal", "set_float32_matmul_precision",
          "register_hook", "register_post_accumulate_grad_hook"}
TENSOR_DENIED = {"register_hook", "register_post_accumulate_grad_hook", "storage", "untyped_storage",
                 "share_memory_", "from_file", "grad_fn"}
STATEMENTS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.While, ast.If, ast.Expr, ast.Return, ast.Pass,
              ast.Break, ast.Continue, ast.Assert, ast.Raise)
EXPRESSIONS = (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Call, ast.Attribute, ast.Subscript, ast.Slice,
               ast.Tuple, ast.List, ast.Dict, ast.Name, ast.Constant, ast.IfExp, ast.keyword, ast.Starred,
               ast.ListComp, ast.GeneratorExp, ast.comprehension, ast.JoinedStr, ast.FormattedValue,
               ast.expr_context, ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.arguments, ast.arg)


class NotInSubset(ValueError):
    """The answer is not a function in the grader's PyTorch subset (the message says why, in one line)."""


def definitions(cells: list[str]) -> dict[str, tuple[ast.FunctionDef, str]]:
    """{name: (its def, the cell's source)} of every top-level function of the cells; a later definition replaces an
    earlier one, as running the cells in order would; any other top-level binding of the name (an assignment, an
    import, a class) removes it."""
    found: dict[str, tuple[ast.FunctionDef, str]] = {}
    for source in cells:
        source = MAGIC.sub(lambda m: f"{m.group(1)}pass", source)
        try:
            with AST_LOCK:
                tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                found[node.name] = (node, source)
                continue
            bound = {node.name} if isinstance(node, (ast.AsyncFunctionDef, ast.ClassDef)) else set()
            bound |= {(a.asname or a.name).split(".")[0] for a in getattr(node, "names", [])
                      if isinstance(a, ast.alias)}
            bound |= {t.id for t in ast.walk(node) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
            for name in bound:
                found.pop(name, None)
    return found


def _attributes() -> set[str]:
    """Public attributes of what a tensor expression can hold: tensors, dtypes, devices, sizes, and the methods of
    a dict or list of them (lesson 05's answers walk a dict of tensors; ``static.update(new)`` is a mistake its
    checker explains)."""
    import torch

    names = {"items", "keys", "values", "get", "update", "append"}
    for kind in (torch.Tensor, torch.dtype, torch.device, torch.Size):
        names |= {n for n in dir(kind) if not n.startswith("_")}
    return names - TENSOR_DENIED


def _check_library_path(node: ast.Attribute, where: str) -> None:
    """``torch.x.y`` / ``F.x`` / ``math.x`` / ``reference.x``: resolved in the real modules; it must name a public
    function, type or constant of torch, math or lessonlib.reference, not a module outside those or a denied one."""
    import math
    import types

    import torch
    import torch.nn.functional

    from lessonlib import reference

    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    path = f"{node.id}.{'.'.join(reversed(chain))}"
    obj = {"torch": torch, "F": torch.nn.functional, "math": math, "reference": reference}[node.id]
    for name in reversed(chain):
        if name in DENIED:
            raise NotInSubset(f"{where}: {path}: {name} reaches past tensors (not in the grader's PyTorch subset)")
        obj = getattr(obj, name, None)
        if obj is None:
            raise NotInSubset(f"{where}: {path} is not part of {node.id}")
    if isinstance(obj, types.ModuleType):
        if not obj.__name__.startswith("torch.") or obj.__name__.count(".") > 2:
            raise NotInSubset(f"{where}: {path} is a module, not a function")
        return
    module = str(getattr(obj, "__module__", None) or "")
    if node.id == "reference" and not module.startswith("lessonlib.reference"):
        raise NotInSubset(f"{where}: {path} is not one of lessonlib.reference's own functions")
    if node.id in ("torch", "F") and not (module.startswith("torch") or module == "builtins"
                                          or isinstance(obj, (int, float, bool, torch.dtype))):
        raise NotInSubset(f"{where}: {path} is not a PyTorch function or type")


def validate(node: ast.FunctionDef, helpers: set[str]) -> set[str]:
    """Raise :class:`NotInSubset` unless ``node`` is written in the PyTorch subset; returns the helpers it calls."""
    if node.decorator_list or node.args.vararg or node.args.kwarg:
        raise NotInSubset(f"{node.name}: a graded function takes plain parameters and has no decorator")
    known = {a.arg for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs}
    known |= {t.id for t in ast.walk(node) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
    known |= set(MODULES) | BUILTINS | helpers
    attributes, called = _attributes(), set()
    for child in ast.walk(node):
        if child is node:
            continue
        where = f"{node.name}: line {getattr(child, 'lineno', '?')}"
        if isinstance(child, ast.FunctionDef) or not isinstance(child, STATEMENTS + EXPRESSIONS):
            raise NotInSubset(f"{where}: {type(child).__name__} is not in the grader's PyTorch subset")
        if isinstance(child, ast.Name) and (child.id in FORBIDDEN or child.id.startswith("_")):
            raise NotInSubset(f"{where}: {child.id} is refused (it reaches past tensors: not in the grader's PyTorch "
                              "subset)")
        if isinstance(child, ast.Name) and child.id not in known:
            raise NotInSubset(f"{where}: {child.id} is neither a parameter, a local name, torch/F/math/reference, "
                              "an allowed built-in nor a function of the notebook")
        if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store) and child.id in set(MODULES) | BUILTINS:
            raise NotInSubset(f"{where}: {child.id} is rebound")
        if isinstance(child, ast.Attribute):
            if not isinstance(child.ctx, ast.Load):
                raise NotInSubset(f"{where}: assigning to .{child.attr} (no attribute is assigned)")
            root = child
            while isinstance(root, ast.Attribute):
                if root.attr.startswith("_"):
                    raise NotInSubset(f"{where}: .{root.attr} starts with _ (not in the grader's PyTorch subset)")
                root = root.value
            if isinstance(root, ast.Name) and root.id in MODULES:
                _check_library_path(child, where)
            elif child.attr not in attributes:
                raise NotInSubset(f"{where}: .{child.attr} is not a public attribute of a tensor, dtype or device")
        if isinstance(child, ast.Constant) and isinstance(child.value, (str, bytes)) and len(child.value) > 2000:
            raise NotInSubset(f"{where}: a constant of {len(child.value)} characters")
        if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id in helpers:
            called.add(child.func.id)
    return called


def function_source(cells: list[str], name: str) -> str:
    """The source the validated runner defines for function ``name``: the notebook's functions it calls first, then
    it, each validated. Raises :class:`NotInSubset` (one line) otherwise."""
    found = definitions(cells)
    if name not in found:
        raise NotInSubset(f"no function {name} defined with def in the notebook")
    order, todo = [], [name]
    while todo:
        current = todo.pop()
        if current in order:
            continue
        order.append(current)
        todo += sorted(validate(found[current][0], set(found) - {current} - set(MODULES) - BUILTINS))
    parts = []
    for current in reversed(order):
        node, source = found[current]
        parts.append("\n".join(source.splitlines()[node.lineno - 1: node.end_lineno]))  # (magic lines: pass)
    text = "\n\n\n".join(parts) + "\n"
    if re.search(r"^\s*(import|from)\s", text, re.M):
        raise NotInSubset(f"{name}: a graded function imports nothing")
    return text
