"""A kernel exercise's answer as the judge takes it: the source of the submission's ``@triton.jit`` function (and of
the ``@triton.jit`` helpers it calls), read from the notebook's cells with :mod:`ast`, and accepted only when it is
written in the Triton language alone: parameters, local names, arithmetic, comparisons, ``if``/``for``/``while``,
calls of ``tl.*``/``triton.*`` functions, of its helpers and of ``range``/``min``/``max``, and the public
attributes of Triton's tensors and dtypes. No import, no other name, no attribute starting with ``_``, no lambda,
class, ``try``, ``with``, ``global`` or nested function: what the judge then defines with ``triton.jit`` and
launches is a kernel and nothing else (an object computing in PyTorch, a subclass, a patched ``triton.jit`` never
reach it)."""

from __future__ import annotations

import ast
import re

from lessonlib.grading.scoring import AST_LOCK, MAGIC

BUILTINS = {"range", "min", "max", "abs", "float", "int", "bool", "len", "isinstance", "print"}
STATEMENTS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.While, ast.If, ast.Expr, ast.Return, ast.Pass,
              ast.Break, ast.Continue, ast.Assert)
EXPRESSIONS = (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Call, ast.Attribute, ast.Subscript, ast.Slice,
               ast.Tuple, ast.List, ast.Name, ast.Constant, ast.IfExp, ast.keyword, ast.Starred,
               ast.expr_context, ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.arguments, ast.arg)


class NotAKernel(ValueError):
    """The answer is not a Triton kernel written in the Triton language (the message says why, in one line)."""


def _is_jit(decorator: ast.expr) -> bool:
    return (isinstance(decorator, ast.Attribute) and decorator.attr == "jit" and isinstance(decorator.value, ast.Name)
            and decorator.value.id == "triton") or (isinstance(decorator, ast.Name) and decorator.id == "jit")


def definitions(cells: list[str]) -> dict[str, tuple[ast.FunctionDef, str]]:
    """{name: (its def, the cell's source)} of every top-level ``@triton.jit`` function of the cells; a later
    definition replaces an earlier one, as running the cells in order would. Any other top-level binding of the
    name (``my_kernel = Fake()``) removes it."""
    found: dict[str, tuple[ast.FunctionDef, str]] = {}
    for source in cells:
        try:
            with AST_LOCK:
                tree = ast.parse(MAGIC.sub(lambda m: f"{m.group(1)}pass", source))
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                found[node.name] = (node, source)
                continue
            for target in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [node]:
                name = getattr(target, "id", None) if isinstance(getattr(target, "ctx", None), ast.Store) else None
                name = name or (target.name if isinstance(target, (ast.FunctionDef, ast.ClassDef)) else None)
                found.pop(name, None)
    return found


def _attributes() -> set[str]:
    import triton.language as tl

    names = {"T", "dtype", "element_ty", "shape", "numel", "value", "type"}
    for kind in (tl.tensor, tl.dtype):
        names |= {n for n in dir(kind) if not n.startswith("_")}
    return names


def _check_library_path(node: ast.Attribute) -> None:
    """``tl.x.y`` / ``triton.x``: resolved in the real modules; it must name Triton's own function, type or dtype
    (``tl.core.os`` would be a module of the standard library)."""
    import types

    import triton
    import triton.language as tl

    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    obj = {"tl": tl, "triton": triton}[node.id]
    for name in reversed(chain):
        obj = getattr(obj, name, None)
        if obj is None:
            raise NotAKernel(f"{node.id}.{'.'.join(reversed(chain))} is not part of Triton")
    module = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
    if isinstance(obj, types.ModuleType) or not str(module).startswith("triton"):
        if not isinstance(obj, (int, float, bool, tl.dtype, tl.constexpr)):
            raise NotAKernel(f"{node.id}.{'.'.join(reversed(chain))} is not a Triton-language function or type")


def validate(node: ast.FunctionDef, helpers: set[str]) -> set[str]:
    """Raise :class:`NotAKernel` unless ``node`` is written in the Triton language alone; returns the helpers it
    calls."""
    if not all(_is_jit(d) for d in node.decorator_list) or node.args.vararg or node.args.kwarg:
        raise NotAKernel(f"{node.name}: a kernel takes plain parameters and has only the @triton.jit decorator")
    known = {a.arg for a in node.args.args + node.args.kwonlyargs} | {"tl", "triton"} | BUILTINS | helpers
    known |= {t.id for t in ast.walk(node) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
    attributes, called = _attributes(), set()
    for child in ast.walk(node):
        if child is node:
            continue
        if isinstance(child, ast.FunctionDef) or not isinstance(child, STATEMENTS + EXPRESSIONS):
            raise NotAKernel(f"{node.name}: line {getattr(child, 'lineno', '?')}: {type(child).__name__} is not "
                             "part of the Triton language")
        if isinstance(child, ast.Name) and child.id not in known:
            raise NotAKernel(f"{node.name}: line {child.lineno}: {child.id} is neither a parameter, a local name, "
                             "tl/triton nor a @triton.jit helper")
        if isinstance(child, ast.Attribute):
            root = child
            while isinstance(root, ast.Attribute):
                if root.attr.startswith("_"):
                    raise NotAKernel(f"{node.name}: line {child.lineno}: .{root.attr} is not part of the Triton "
                                     "language")
                root = root.value
            if isinstance(root, ast.Name) and root.id in ("tl", "triton"):
                _check_library_path(child)
            elif child.attr not in attributes:
                raise NotAKernel(f"{node.name}: line {child.lineno}: .{child.attr} is not an attribute of a Triton "
                                 "tensor or dtype")
        if isinstance(child, ast.Constant) and isinstance(child.value, (str, bytes)) and len(child.value) > 2000:
            raise NotAKernel(f"{node.name}: line {child.lineno}: a constant of {len(child.value)} characters")
        if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id in helpers:
            called.add(child.func.id)
    return called


def kernel_source(cells: list[str], name: str) -> str:
    """The source the judge defines for kernel ``name``: its ``@triton.jit`` helpers first, then the kernel, each
    validated. Raises :class:`NotAKernel` (one line) otherwise."""
    found = definitions(cells)
    if name not in found:
        raise NotAKernel(f"no @triton.jit function {name} in the notebook (a kernel exercise's answer is the "
                         "@triton.jit function itself)")
    order, todo = [], [name]
    while todo:
        current = todo.pop()
        if current in order:
            continue
        order.append(current)
        todo += sorted(validate(found[current][0], set(found) - {current}))
    parts = []
    for current in reversed(order):
        node, source = found[current]
        parts.append(ast.get_source_segment(source, node, padded=False) or "")
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        lines = source.splitlines()[first - 1: node.end_lineno]
        parts[-1] = "\n".join(lines)
    text = "\n\n\n".join(parts) + "\n"
    if re.search(r"^\s*(import|from)\s", text, re.M):
        raise NotAKernel(f"{name}: a kernel imports nothing")
    return text
