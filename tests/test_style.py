"""The machine-checkable habits of `shared/style.md`, run on every package in the suite.

Covers: ruff (including no blanket excepts, habit 8), the exported API of each package root (habit 1),
module names (habit 2), the size budget with its listed exceptions (habit 3), module docstrings
(habit 5). Import isolation between packages lives in `test_imports.py`.
"""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["rollout", "packing", "attention", "sync", "trainer"]
SOURCE_DIRS = [ROOT / "packages" / f"agrpo-{name}" / "src" for name in PACKAGES] + [ROOT / "tools"]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_CONSTRUCTOR_LINES = 40
BANNED_MODULE_NAMES = {"utils", "util", "common", "helpers", "helper", "misc"}


def _source_files() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in d.rglob("*.py"))


def _size_exceptions() -> dict[str, str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["agrpo"]["size-exceptions"]


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    result = subprocess.run([ruff, "check", "--no-cache", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, f"ruff found problems (run `uv run ruff check --fix`):\n{result.stdout}"


@pytest.mark.parametrize("name", PACKAGES)
def test_package_root_exports_a_sorted_complete_api(name):
    package = importlib.import_module(f"agrpo_{name}")
    exported = package.__all__
    assert exported == sorted(exported), f"agrpo_{name}.__all__ must be sorted"
    for symbol in exported:
        assert hasattr(package, symbol), f"agrpo_{name}.__all__ lists {symbol!r}, which the package lacks"
    public = {
        n for n, v in vars(package).items() if not n.startswith("_") and not isinstance(v, type(importlib))
    }
    missing = public - set(exported)
    assert not missing, f"agrpo_{name} has public names missing from __all__: {sorted(missing)}"


@pytest.mark.parametrize("path", _source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_named_after_a_domain_object(path):
    assert path.stem.lstrip("_") not in BANNED_MODULE_NAMES, (
        f"{path.relative_to(ROOT)}: name a module after the domain object it owns, not {path.stem!r}"
    )


@pytest.mark.parametrize("path", _source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_has_a_docstring(path):
    tree = ast.parse(path.read_text())
    if not tree.body:  # an empty __init__.py marks a namespace, nothing to describe
        return
    assert ast.get_docstring(tree), (
        f"{path.relative_to(ROOT)}: start with a docstring saying what the module owns and what it does not know"
    )


def _oversized(path: Path) -> list[str]:
    source = path.read_text()
    problems = []
    num_lines = len(source.splitlines())
    if num_lines > MAX_MODULE_LINES:
        problems.append(f"module has {num_lines} lines > {MAX_MODULE_LINES}")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            limit = MAX_CONSTRUCTOR_LINES if node.name == "__init__" else MAX_FUNCTION_LINES
            if length > limit:
                problems.append(f"{node.name} (line {node.lineno}) has {length} lines > {limit}")
    return problems


def test_size_budget_holds_except_listed_reasoned_exceptions():
    exceptions = _size_exceptions()
    for listed, reason in exceptions.items():
        assert (ROOT / listed).exists(), f"[tool.agrpo.size-exceptions] lists {listed}, which does not exist"
        assert len(reason.split()) >= 4, f"size exception {listed} needs a one-line reason, got {reason!r}"
    over = {}
    for path in _source_files():
        rel = str(path.relative_to(ROOT))
        if rel not in exceptions and (problems := _oversized(path)):
            over[rel] = problems
    assert not over, (
        "over the size budget of style.md habit 3 (split the code, or list the file in pyproject.toml "
        f"[tool.agrpo.size-exceptions] with a reason): {over}"
    )


def test_median_function_stays_short():
    lengths = sorted(
        node.end_lineno - node.lineno + 1
        for path in _source_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    )
    assert lengths, "no functions found: the source directories moved?"
    assert lengths[len(lengths) // 2] <= 15, (
        f"median function is {lengths[len(lengths) // 2]} lines; aim 10-15"
    )
