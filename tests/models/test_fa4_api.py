"""The FA4 internals DCA's kernels use (models/attention/fa4_api.py) exist in the pinned
flash-attn-4 and quack-kernels releases, read from their sources (no import: the CuTe DSL needs
a GPU stack), and the list is the whole of what the code takes from them.

The sources come from the release wheels in $LONGCTX_FA4_WHEELS (.ci/run downloads the pinned
ones there), else from the installed packages, so an FA4 upgrade that moves a name fails
here, on the CPU."""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import zipfile
from pathlib import Path

import pytest

from models.attention import fa4_api
from tests.conftest import REPO


class Sources:
    """Python sources of the flash_attn and quack packages, by dotted module name."""

    def __init__(self) -> None:
        self.wheels = sorted(Path(os.environ.get("LONGCTX_FA4_WHEELS", "/nonexistent"))
                             .glob("*.whl"))

    def available(self) -> bool:
        return all(self._installed(top) or self._wheel(top) for top in ("flash_attn", "quack"))

    def _installed(self, top: str) -> Path | None:
        spec = importlib.util.find_spec(top)  # a top-level package: found, not imported
        return Path(next(iter(spec.submodule_search_locations))) if spec else None

    def _wheel(self, top: str) -> Path | None:
        prefix = {"flash_attn": "flash_attn_4-", "quack": "quack_kernels-"}[top]
        return next((w for w in self.wheels if w.name.startswith(prefix)), None)

    def package_texts(self, top: str, folder: str) -> list[str]:
        """Every Python source under `top`/`folder` (the pinned wheel's, when given)."""
        if (wheel_path := self._wheel(top)) is not None:
            with zipfile.ZipFile(wheel_path) as wheel:
                return [wheel.read(n).decode() for n in wheel.namelist()
                        if n.startswith(f"{top}/{folder}/") and n.endswith(".py")]
        return [p.read_text() for p in (self._installed(top) / folder).rglob("*.py")]

    @functools.cache  # noqa: B019 (one Sources for the whole test run)
    def tree(self, module: str) -> ast.Module:
        top, *rest = module.split(".")
        relative = "/".join(rest) + ".py"
        if (wheel_path := self._wheel(top)) is not None:  # the pinned release, when given
            with zipfile.ZipFile(wheel_path) as wheel:
                return ast.parse(wheel.read(f"{top}/{relative}").decode())
        return ast.parse((self._installed(top) / relative).read_text())


SOURCES = Sources()
needs_sources = pytest.mark.skipif(
    not SOURCES.available(), reason="flash-attn-4 / quack sources absent (CI fetches the wheels "
    "into $LONGCTX_FA4_WHEELS)")


def _top_level_names(tree: ast.Module) -> dict[str, ast.AST]:
    """Names a module defines or imports at its top level (and in top-level if/try blocks)."""
    names: dict[str, ast.AST] = {}
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, (ast.If, ast.Try)):
            body.extend(node.body + node.orelse + getattr(node, "finalbody", []))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
    return names


def _methods(module: str, cls: str) -> set[str]:
    """A class's methods with those of its bases that come from flash_attn or quack."""
    names = _top_level_names(SOURCES.tree(module))
    node = names[cls]
    assert isinstance(node, ast.ClassDef), f"{module}.{cls} is not a class"
    found = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for base in node.bases:
        if isinstance(base, ast.Name) and isinstance(names.get(base.id), ast.ImportFrom):
            origin = names[base.id].module or ""
            if origin.split(".")[0] in ("flash_attn", "quack"):
                found |= _methods(origin, base.id)
        elif isinstance(base, ast.Name) and isinstance(names.get(base.id), ast.ClassDef):
            found |= _methods(module, base.id)
    return found


def test_the_pins_are_the_fa4_extra_of_pyproject() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    extra = re.search(r"^fa4 = \[(.*)\]$", pyproject, re.M).group(1)
    assert f'"{fa4_api.FA4_DISTRIBUTION}=={fa4_api.FA4_VERSION}"' in extra
    assert f'"{fa4_api.QUACK_DISTRIBUTION}=={fa4_api.QUACK_VERSION}"' in extra


@needs_sources
@pytest.mark.parametrize("module", sorted(fa4_api.NAMES))
def test_every_listed_name_is_in_the_pinned_sources(module: str) -> None:
    defined = _top_level_names(SOURCES.tree(module))
    missing = [name for name in fa4_api.NAMES[module] if name not in defined]
    assert not missing, f"{module} no longer has {missing}"


@needs_sources
@pytest.mark.parametrize("key", sorted(fa4_api.METHODS), ids=lambda key: key[1])
def test_every_listed_method_is_in_the_pinned_kernel_classes(key: tuple[str, str]) -> None:
    methods = _methods(*key)
    missing = sorted(set(fa4_api.METHODS[key]) - methods)
    assert not missing, f"{key[1]} no longer has {missing}"


def _uses(path: Path) -> set[tuple[str, str]]:
    """(module, name) pairs a file takes from flash_attn / quack: `from M import name`, and
    `alias.name` where `from P import M [as alias]` bound a module listed in fa4_api.NAMES."""
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}
    uses = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
                "flash_attn", "quack"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                if candidate in fa4_api.NAMES:
                    aliases[alias.asname or alias.name] = candidate
                else:
                    uses.add((node.module, alias.name))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            uses.add((aliases[node.value.id], node.attr))
    return uses


def test_the_list_is_what_the_code_uses() -> None:
    files = sorted((REPO / "models" / "attention").rglob("*.py"))
    used = set().union(*(_uses(f) for f in files))
    listed = {(m, name) for m, names in fa4_api.NAMES.items() for name in names}
    assert used - listed == set(), "used but not listed in fa4_api.NAMES"
    text = "\n".join(f.read_text() for f in files if f.name != "fa4_api.py")
    unused = sorted(f"{m}.{name}" for m, name in listed if not re.search(rf"\b{name}\b", text))
    assert not unused, f"listed in fa4_api.NAMES but used nowhere: {unused}"


def test_an_fa4_release_other_than_the_pin_is_reported_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(fa4_api.metadata, "version", lambda name: "9.9.9")
    monkeypatch.setattr(fa4_api, "_checked", [])
    with caplog.at_level("WARNING"):
        assert fa4_api.check_version() == "9.9.9"
        assert fa4_api.check_version() == "9.9.9"
    assert [r.message.count("9.9.9") for r in caplog.records] == [1]
    monkeypatch.setattr(fa4_api.metadata, "version", lambda name: fa4_api.FA4_VERSION)
    assert fa4_api.check_version() is None


def _code_lines(text: str) -> list[str]:
    """A file's code lines, whitespace collapsed; blank lines, comments and docstring quotes
    out (lines of three characters or fewer, such as `)` or `],`, too)."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if len(line) > 3 and not line.startswith(("#", '"""')):
            lines.append(re.sub(r"\s+", " ", line))
    return lines


@needs_sources
def test_no_four_lines_in_a_row_are_fa4s() -> None:
    """The project's attention code is its own: no run of four code lines equal to a run in
    FA4's cute sources (code alike in shape, the same API calls, is fine)."""
    runs = 4
    theirs = set()
    texts = SOURCES.package_texts("flash_attn", "cute")
    for text in texts:
        lines = _code_lines(text)
        theirs |= {tuple(lines[i:i + runs]) for i in range(len(lines) - runs + 1)}
    shared = []
    for path in sorted((REPO / "models" / "attention").rglob("*.py")):
        lines = _code_lines(path.read_text())
        shared += [f"{path.name}: {lines[i]}" for i in range(len(lines) - runs + 1)
                   if tuple(lines[i:i + runs]) in theirs]
    assert not shared, f"runs of {runs} lines equal to FA4's, starting at: {shared}"
