"""Issue 13's size rules, so they stay true: no function in lessonlib/ or benchmarks/ over 80 lines, no file in
lessonlib/ over 400 lines (CONTRIBUTING.md: past that, split by job or by lesson)."""

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
