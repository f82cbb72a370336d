"""The layering the code promises (docs/architecture.md): imports point one way, one model
factory, no oversized modules, no module reaching into another's private names, and each
attention kind declared once."""

from __future__ import annotations

import ast
import inspect
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

# Each package and the packages of ours it may import (besides itself).
ALLOWED = {
    "models": set(),
    "parallel": set(),
    "ckpt": {"models", "parallel"},
    "trainer": {"models", "parallel", "ckpt"},
    "bench": {"models", "parallel", "ckpt", "trainer"},  # nothing imports bench
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


@pytest.mark.parametrize("package", sorted(set(ALLOWED) - {"bench"}))  # bench: scripts
def test_no_module_is_oversized(package: str) -> None:
    big = [f"{p.relative_to(REPO)} ({n} lines)" for p in _sources(package)
           if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, f"split these modules (limit {MAX_LINES} lines): {big}"


def _private_imports(path: Path) -> list[str]:
    """`from <ours> import _name` and `<alias of ours>._name` in one file (`__dunder__` aside)."""
    tree = ast.parse(path.read_text())
    found, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in ALLOWED:
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"from {node.module} import {alias.name}")
                else:  # maybe a module: its private attributes count too
                    aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names
                        if a.name.split(".")[0] in ALLOWED}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__") and ast.unparse(node.value) in aliases:
            found.append(f"{ast.unparse(node.value)}.{node.attr}")
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_module_imports_a_private_name(package: str) -> None:
    """A `_name` is its module's own: another module that needs it gets a public name instead
    (tests may reach in; code may not)."""
    wrong = [f"{path.relative_to(REPO)}: {name}" for path in _sources(package)
             for name in _private_imports(path)]
    assert not wrong, f"private names used across modules: {wrong}"


def test_each_attention_kind_is_declared_once() -> None:
    """The registry (models/attention/registry.py) is the one list of attention kinds: the
    `conf/attention/*.yaml` kinds, the kinds `AttentionConfig` documents, and the registry's
    keys are the same, and every registered module, function and probe resolves."""
    from models.attention.registry import VARIANTS, variant
    from models.schema import AttentionConfig

    yaml_kinds = {doc["kind"] for p in (REPO / "conf" / "attention").glob("*.yaml")
                  if "kind" in (doc := yaml.safe_load(p.read_text()) or {})}
    kind_field = next(f for f in fields(AttentionConfig) if f.name == "kind")
    source = (REPO / "models" / "schema.py").read_text()
    comment = next(line for line in source.splitlines() if line.strip().startswith("kind: str"))
    documented = set(comment.split("#", 1)[1].replace("|", " ").split())
    assert set(VARIANTS) == yaml_kinds == documented
    assert kind_field.default in VARIANTS
    for name in VARIANTS:
        v = variant(name)
        assert v.name == name
        core = v.core_attention()
        # The core module is what calls the function, its CP form and its probe: the ones named.
        called = {node.func.id for node in ast.walk(ast.parse(inspect.getsource(core)))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        for function in (v.attention_function(), v.cp_function(), v.probe_function()):
            assert function.__name__ in called, f"{core.__name__} does not call {function}"
    # No second list: no other module of models/ spells out the kinds as a tuple/dict literal.
    others = []
    for path in _sources("models"):
        if path.name == "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            elif isinstance(node, ast.Dict):
                values = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            else:
                continue
            if len(values & set(VARIANTS)) >= 2:
                others.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not others, f"attention kinds listed outside the registry: {others}"


def test_the_model_config_loads_no_kernel_module() -> None:
    """`models.config` (every config check reads it) loads DCA's settings checks, not its
    kernels: they load when a model runs them."""
    import subprocess
    import sys

    code = ("import sys, models.config; print(','.join(m for m in sys.modules if m.startswith("
            "'models.attention.dca.') and m.rsplit('.', 1)[1] in ('grouped', 'fa4_forward', "
            "'fa4_backward', 'dq_parts', 'fa4_parts', 'graphs')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == ""


def test_no_two_modules_import_each_other() -> None:
    """No import cycle among the project's modules, lazy (function-level) imports included: a
    circle means two modules are one concept split in two, or a piece is in the wrong one."""
    import ast

    from tests.conftest import REPO

    graph: dict[str, set[str]] = {}
    for package in ("models", "parallel", "ckpt", "trainer"):
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(
                ".__init__")
            deps = graph.setdefault(name, set())
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    deps.add(node.module)
                elif isinstance(node, ast.Import):
                    deps.update(alias.name for alias in node.names)
    cycles = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps
                     if b in graph and b != a and a in graph[b]})
    assert not cycles, f"modules importing each other: {cycles}"
