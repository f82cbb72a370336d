"""The layering the code promises (docs/architecture.md): imports point one way, one model
factory, no oversized modules, no module reaching into another's private names, and each
attention kind declared once."""

from __future__ import annotations

import ast
import inspect
import re
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
    `conf/attention/*.yaml` kinds, the names of `AttentionKind` (the choice of
    `AttentionConfig.kind`, which Hydra checks at composition), and the registry's keys are the
    same, and every registered module, function and probe resolves."""
    from models.attention.registry import VARIANTS, variant
    from models.schema import AttentionConfig, AttentionKind

    yaml_kinds = {doc["kind"] for p in (REPO / "conf" / "attention").glob("*.yaml")
                  if "kind" in (doc := yaml.safe_load(p.read_text()) or {})}
    kind_field = next(f for f in fields(AttentionConfig) if f.name == "kind")
    assert kind_field.type == "AttentionKind"
    assert list(VARIANTS) == [kind.value for kind in AttentionKind]
    assert set(VARIANTS) == yaml_kinds
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


def _loaded_by(module: str) -> set[str]:
    """The project modules that importing `module` loads: its module-level imports (any depth
    of `if`/`try`, not those inside functions), their packages' `__init__`s, transitively."""
    def path_of(name: str) -> Path | None:
        base = REPO.joinpath(*name.split("."))
        return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()),
                    None)

    def top_level(tree: ast.AST) -> list[ast.stmt]:
        found = []
        for node in getattr(tree, "body", []) + getattr(tree, "orelse", []) + [
                h for h in getattr(tree, "handlers", [])] + getattr(tree, "finalbody", []):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, (ast.If, ast.Try, ast.ExceptHandler)):
                found += top_level(node)
        return found

    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # a module's packages load first
            prefix = ".".join(parts[:i])
            if prefix in seen or path_of(prefix) is None:
                continue
            seen.add(prefix)
            for node in top_level(ast.parse(path_of(prefix).read_text())):
                if isinstance(node, ast.Import):
                    todo += [alias.name for alias in node.names]
                elif node.module and node.level == 0:
                    todo.append(node.module)
                    todo += [f"{node.module}.{alias.name}" for alias in node.names
                             if path_of(f"{node.module}.{alias.name}")]
    return seen


def test_the_model_config_loads_no_kernel_module() -> None:
    """`models.config` (every config check reads it) loads DCA's settings checks, not its
    kernels or its dispatcher: they load when a model runs them."""
    kernels = {m for m in _loaded_by("models.config") if m.startswith("models.attention.dca.")
               and m.rsplit(".", 1)[1] in ("grouped", "fa4_forward", "fa4_backward", "dq_parts",
                                           "fa4_parts", "graphs", "dispatch", "attention")}
    assert not kernels
    assert {"models.attention.dca.grouped", "models.attention.dca.dispatch"} <= _loaded_by(
        "models.attention.dca.module")  # the walk finds what a model's module loads


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


def test_the_dca_decision_table_names_the_dispatchers_paths() -> None:
    """docs/architecture.md's table of DCA paths has a row for each path the dispatcher
    returns (models/attention/dca/dispatch.py) and names no other."""
    from models.attention.dca.dispatch import DCAPath

    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Which DCA path runs\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(("| ---", "| condition"))]
    named = [re.match(r"\s*`(\w+)`", cell)[1] for cell in rows]
    assert sorted(named) == sorted(p.value for p in DCAPath)


def test_dcas_kernel_constants_are_declared_once() -> None:
    """The kernels' tile (128) and head dims are declared in models/attention/dca/plan.py and
    imported everywhere else: no second module-level tile or head-dim constant in models/."""
    found = []
    for path in _sources("models"):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.Assign) or not isinstance(node.targets[0], ast.Name):
                continue
            name, value = node.targets[0].id, node.value
            head_dims = isinstance(value, ast.Tuple) and [
                getattr(e, "value", None) for e in value.elts] == [64, 96, 128]
            tile = (isinstance(value, ast.Constant) and value.value == 128
                    and re.search(r"TILE|BLOCK|ROW_MULTIPLE", name))
            if head_dims or tile:
                found.append(f"{path.relative_to(REPO)}:{name}")
    assert found == ["models/attention/dca/plan.py:KERNEL_BLOCK",
                     "models/attention/dca/plan.py:KERNEL_HEAD_DIMS"], found
