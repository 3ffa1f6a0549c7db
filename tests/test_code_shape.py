"""The size rules, so they stay true: no function in lessonlib/, benchmarks/ or tools/ over 80 lines, no file in
lessonlib/ or tools/ over 400 lines (CONTRIBUTING.md: past that, split by job or by lesson)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 400


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_no_function_over_80_lines():
    long = []
    for path in python_files("lessonlib", "benchmarks"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_no_lessonlib_file_over_400_lines():
    big = [f"{p.relative_to(ROOT)} ({n} lines)" for p in python_files("lessonlib")
           if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not big, "files over 400 lines:\n" + "\n".join(big)


ENGINE_MUST_NOT_IMPORT = ("lessonlib.plots", "lessonlib.results", "lessonlib.widgets", "lessonlib.serving")


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module an ``import`` or ``from ... import`` names, at any depth (a function's lazy import counts)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # from lessonlib import plots
    return names


def test_imported_modules_sees_lazy_and_from_imports():
    tree = ast.parse("import os\ndef f():\n    from lessonlib import plots\n    import lessonlib.results.x\n")
    assert {"os", "lessonlib.plots", "lessonlib.results.x"} <= imported_modules(tree)


def test_the_engine_is_the_engine_alone():
    """Issue 25: lesson 07's plots, simulator and live checks live outside engine/ (cases/, plots/ serving_engine.py);
    the engine imports no plots, recorded results, widgets or vLLM bridge."""
    bad = [f"{p.relative_to(ROOT)} imports {name}" for p in python_files("lessonlib/engine")
           for name in sorted(imported_modules(ast.parse(p.read_text())))
           if any(name == banned or name.startswith(banned + ".") for banned in ENGINE_MUST_NOT_IMPORT)]
    assert not bad, "the engine imports lesson code:\n" + "\n".join(bad)


def test_one_class_one_name():
    """Issue 25: a class name means one thing in lessonlib (``DecoderLayer`` is lesson 05's layer, the engine's is
    ``EngineLayer``; ``DecodeInputs`` is lesson 05's step inputs, the engine's staging buffers are ``DecodeBuffers``)."""
    where: dict[str, list[str]] = {}
    for path in python_files("lessonlib"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"one name, several classes: {twice}"


def test_the_package_map_names_every_module_and_nothing_else():
    """lessonlib/__init__.py's map is the package's table of contents: a module added or removed changes it."""
    import re

    import lessonlib

    named = set(re.findall(r"``lessonlib\.(\w+)``", lessonlib.__doc__))
    present = {p.stem for p in (ROOT / "lessonlib").iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert named == present, f"in the map only: {sorted(named - present)}; in the folder only: {sorted(present - named)}"


def test_no_tools_file_over_400_lines_and_no_tools_function_over_80():
    big = [f"{p.relative_to(ROOT)} ({n} lines)" for p in python_files("tools")
           if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    long = [f"{p.relative_to(ROOT)}:{node.lineno} {node.name}" for p in python_files("tools")
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not big and not long, f"too long: {big + long}"


def test_no_benchmark_edits_the_import_path():
    """benchmarks/ is a package run as modules from the repository's root (python -m benchmarks.bench_x)."""
    edits = [f"{p.relative_to(ROOT)}" for p in python_files("benchmarks") if "sys.path.insert" in p.read_text()]
    assert not edits, edits
