"""The layering the code promises (docs/architecture.md): imports point one way, one model
factory, no oversized modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

# Each package and the packages of ours it may import (besides itself).
ALLOWED = {
    "models": set(),
    "parallel": set(),
    "ckpt": {"models", "parallel"},
    "trainer": {"models", "parallel", "ckpt"},
}
MAX_LINES = 400


def _sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _imported_packages(path: Path) -> set[str]:
    """Top-level names of every import in a file, function-level imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package: str) -> None:
    ours = set(ALLOWED)
    wrong = {
        f"{path.relative_to(REPO)} imports {sorted(bad)}"
        for path in _sources(package)
        if (bad := (_imported_packages(path) & ours) - ALLOWED[package] - {package})
    }
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package])}: {sorted(wrong)}"


def test_the_gpt_is_built_in_one_place() -> None:
    """`GPTModel` is built by `build_gpt`, and `build_gpt` called by `build_model` alone: every
    caller (trainer, trainer.eval, ckpt) goes through the one factory in `models/gpt.py`."""
    calls = []
    for package in ALLOWED:
        for path in _sources(package):
            calls += [(str(path.relative_to(REPO)), node.func.id)
                      for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                      and node.func.id in ("build_gpt", "GPTModel")]
    assert sorted(calls) == [("models/gpt.py", "GPTModel"), ("models/gpt.py", "build_gpt")]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_module_is_oversized(package: str) -> None:
    big = [f"{p.relative_to(REPO)} ({n} lines)" for p in _sources(package)
           if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, f"split these modules (limit {MAX_LINES} lines): {big}"
