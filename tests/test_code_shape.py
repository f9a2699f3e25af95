# tests/test_code_shape.py: the size rules of the Python code (docs/architecture.md): modules of at most 400
# lines, functions of at most 80, lines of at most 120 characters, and a header comment opening every
# module.
# Not for: the C files (tests/test_c_layout.py) or the import rules (tests/test_layers.py).
from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "accelerate_c"
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_LINE = 400, 80, 120


def _modules() -> list[pathlib.Path]:
    return sorted(PKG.rglob("*.py"))


def _rel(p: pathlib.Path) -> str:
    return str(p.relative_to(PKG.parent))


def test_modules_are_small():
    big = [f"{_rel(p)}: {n}" for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_functions_are_small():
    big = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    big.append(f"{_rel(p)}:{node.lineno} {node.name}: {n}")
    assert not big, f"functions over {MAX_FUNCTION_LINES} lines: {big}"


def test_lines_fit():
    long = [f"{_rel(p)}:{i}: {len(line)}" for p in _modules()
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    assert not long, f"lines over {MAX_LINE} characters: {long}"


def test_every_module_has_a_header():
    """Every non-empty module opens with a comment saying what it is for."""
    missing = [_rel(p) for p in _modules() if p.read_text() and not p.read_text().startswith("# ")]
    assert not missing, f"modules without a header comment: {missing}"
