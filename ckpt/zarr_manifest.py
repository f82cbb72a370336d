"""Checks of a zarr export's `manifest.json` before `python -m ckpt import` writes anything.

The manifest steers the import (the TP size decides how each tensor is cut into the chunks
megatron saves, the step names the checkpoint), and it is a text file anyone may edit: a
`"tp": 0` used to cut every TP-split tensor into no chunk at all, dropping it silently.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from ckpt.errors import ExportError
from ckpt.layout import TPLayout

# The file an export's arrays are described in, at its top.
MANIFEST = "manifest.json"
# The dtypes a training checkpoint holds (and `_to_torch` turns back into tensors): their sizes.
DTYPES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
          "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


def manifest_path(export_dir: str | Path) -> Path:
    """The manifest of the export `export_dir`; ExportError when there is none."""
    path = Path(export_dir) / MANIFEST
    if not path.is_file():
        raise ExportError(f"{path} is missing: {export_dir} is not a `python -m ckpt export` "
                          "output")
    return path


def _count(value: Any, least: int) -> bool:
    """An int (not a bool) >= `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def manifest_problems(manifest: Any, export_dir: Path) -> list[str]:
    """Everything wrong with `manifest` (parsed JSON of `export_dir`); empty when usable."""
    if not isinstance(manifest, dict):
        return ["the manifest is not a JSON object"]
    problems = []
    if not _count(manifest.get("step"), 0):
        problems.append(f"step: {manifest.get('step')!r} is not a step number (an int >= 0)")
    tp = manifest.get("tp")
    for key in ("tp", "chunk_tp"):
        if not _count(manifest.get(key), 1):
            problems.append(f"{key}: {manifest.get(key)!r} is not a TP size (an int >= 1)")
    common = manifest.get("common")
    saved_tp = _saved_tp(common.get("extra")) if isinstance(common, dict) else None
    if not isinstance(common, dict):
        problems.append("common: missing (the checkpoint's common state)")
    elif saved_tp is not None and saved_tp != tp:
        problems.append(f"tp: {tp!r}, but the checkpoint it holds was saved at TP={saved_tp}")
    if isinstance(common, dict):
        problems += _record_problems(manifest, common)
    if not isinstance(manifest.get("objects", {}), dict):
        problems.append("objects: not a JSON object")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        return problems + ["tensors: missing or empty (every tensor's entry)"]
    cut_tp = tp if _count(tp, 1) else None
    for key, entry in tensors.items():
        problems += [f"tensors.{key}: {p}" for p in _entry_problems(entry, export_dir, cut_tp, key)]
    return problems


def tensor_bytes(manifest: dict[str, Any]) -> int:
    """The bytes of every tensor of a checked manifest (about the imported checkpoint's size)."""
    return sum(math.prod(e["shape"]) * DTYPES[e["dtype"]] for e in manifest["tensors"].values())


def _entry_problems(entry: Any, export_dir: Path, tp: int | None, key: str) -> list[str]:
    if not isinstance(entry, dict):
        return ["not a JSON object"]
    problems = []
    shape, axis, blocks = entry.get("shape"), entry.get("tp_axis"), entry.get("tp_blocks")
    if not isinstance(shape, list) or not all(_count(n, 0) for n in shape):
        return [f"shape {shape!r} is not a list of sizes"]
    if entry.get("dtype") not in DTYPES:
        problems.append(f"dtype {entry.get('dtype')!r} is not one of {', '.join(sorted(DTYPES))}")
    digest = entry.get("sha256")
    if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        problems.append("sha256: not a SHA-256 hex digest")
    if axis is not None and not (_count(axis, 0) and axis < len(shape)):
        problems.append(f"tp_axis {axis!r} is not an axis of shape {shape}")
    elif not _count(blocks, 1):
        problems.append(f"tp_blocks {blocks!r} is not an int >= 1")
    elif tp is not None and (p := TPLayout(axis, blocks).problem(key, tuple(shape), tp)):
        problems.append(f"cannot be cut for tp={tp}: {p}")
    path = entry.get("path")
    if not isinstance(path, str) or Path(path).is_absolute() or ".." in Path(path).parts:
        problems.append(f"path {path!r} is not a path inside the export")
    elif not (export_dir / path / "zarr.json").is_file():
        problems.append(f"its array {export_dir / path} is missing")
    return problems


def _record_problems(manifest: dict[str, Any], common: dict[str, Any]) -> list[str]:
    """The checkpoint's record (`common.extra`, and its copy `meta`) read as every reader reads
    it (`CheckpointMeta.from_saved`: typed, in range), its step the manifest's: an edited
    record's billion layers made `import` write a checkpoint that `reshape` and a resume hung on.
    """
    from ckpt.meta import CheckpointMeta, MetaError
    from ckpt.plain import decode
    from ckpt.reader import MODEL_WEIGHT

    try:
        extra = decode(common).get("extra")
    except Exception as e:  # any damage of the tagged values (a dtype or base64 that is not one)
        return [f"common: cannot be decoded ({type(e).__name__}: {e})"]
    embedding = (manifest.get("tensors") or {}).get(MODEL_WEIGHT) \
        if isinstance(manifest.get("tensors"), dict) else None
    shape = embedding.get("shape") if isinstance(embedding, dict) else None
    rows = shape[0] if isinstance(shape, list) and shape and _count(shape[0], 0) else 0
    problems = []
    for where, record in (("common.extra", extra), ("meta", manifest.get("meta", extra))):
        try:
            meta = CheckpointMeta.from_saved(record, rows, where)
        except MetaError as e:
            problems.append(str(e))
            continue
        if _count(manifest.get("step"), 0) and meta.step != manifest["step"]:
            problems.append(f"step: {manifest['step']}, but {where} records step {meta.step}")
    return problems


def _saved_tp(extra: Any) -> Any:
    """The TP size the checkpoint's record names (`layout.tp`; `tp` in its older format)."""
    if not isinstance(extra, dict):
        return None
    layout = extra.get("layout")
    return layout.get("tp") if isinstance(layout, dict) and "tp" in layout else extra.get("tp")
