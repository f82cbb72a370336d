"""`python -m ckpt export SRC DST --format zarr` and `python -m ckpt import SRC DST`.

The export holds everything a training checkpoint holds, so an import resumes training:
    DST/manifest.json          step, the checkpoint's record (`ckpt.meta`), every tensor's
                               shape, dtype, TP axis, chunk shape and SHA-256; the [QKV; Gate]
                               split of head-gated layers; the common state and the RNG
                               objects as exact JSON (`ckpt.plain`)
    DST/arrays/<key>/          one zarr v3 array per global tensor (model and optimizer state),
                               written with tensorstore, bf16 stored as bfloat16
Each array is chunked along its TP axis so that one chunk is one piece of one rank's slice at
`chunk_tp` (default: the TP size saved at; stacked layers also one chunk per layer): reading
TP rank r's slice (`read_rank_shard`) reads exactly its chunks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from tqdm import tqdm

from ckpt.destination import staged
from ckpt.errors import ExportError
from ckpt.layout import TPLayout, checked_layout, is_stacked
from ckpt.paths import resolve_checkpoint
from ckpt.plain import decode, encode
from ckpt.reader import Checkpoint, object_location
from ckpt.save import write_checkpoint
from ckpt.zarr_manifest import MANIFEST, manifest_path, manifest_problems, tensor_bytes
from parallel.distributed import init_process_group

FORMAT, VERSION, DRIVER = "longctx-zarr", 1, "zarr3"


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; ml_dtypes' is tensorstore's
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _to_torch(a: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _spec(path: Path) -> dict[str, Any]:
    return {"driver": DRIVER, "kvstore": {"driver": "file", "path": str(path)}}


def chunk_shape(key: str, shape: tuple[int, ...], layout: TPLayout, chunk_tp: int) -> list[int]:
    """One layer (stacked tensors) by one piece of one rank's slice along the TP axis."""
    chunks = list(shape)
    if is_stacked(key):
        chunks[0] = 1
    if layout.axis is not None:
        chunks[layout.axis] = layout.piece(shape[layout.axis], chunk_tp)
    return chunks


def export(src: str | Path, dst: str | Path, *, chunk_tp: int | None = None,
           overwrite: bool = False) -> None:
    """Write every global tensor of checkpoint `src` as a zarr array under `dst`."""
    src_dir = resolve_checkpoint(src)
    ckpt = Checkpoint(src_dir)
    ckpt.require_intact()  # checksums: a changed file is refused here, as by verify and resume
    meta = ckpt.meta
    swiglu, tp = meta.model.swiglu, meta.layout.tp
    chunk_tp = chunk_tp or tp
    layouts = {k: checked_layout(info, swiglu, tp) for k, info in ckpt.tensors.items()}
    bad = [p for k, layout in layouts.items()
           if (p := layout.problem(k, ckpt.tensors[k].shape, chunk_tp))]
    if bad:
        raise ExportError(f"cannot chunk for TP={chunk_tp}:\n  " + "\n  ".join(bad))
    tensors: dict[str, Any] = {}
    with staged(Path(dst), overwrite, sources=(src_dir,),
                needs_bytes=sum(t.nbytes for t in ckpt.tensors.values())) as tmp:
        for key in tqdm(sorted(ckpt.tensors), desc="exporting", unit="tensor"):
            info, layout = ckpt.tensors[key], layouts[key]
            tensor = ckpt.read(key)
            dtype = str(info.dtype).removeprefix("torch.")
            chunks = chunk_shape(key, info.shape, layout, chunk_tp)
            array = ts.open({**_spec(tmp / "arrays" / key), "metadata": {
                "shape": list(info.shape), "data_type": dtype,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
            }}, create=True).result()
            array.write(_to_numpy(tensor)).result()
            tensors[key] = {"path": f"arrays/{key}", "shape": list(info.shape), "dtype": dtype,
                            "tp_axis": layout.axis, "tp_blocks": layout.blocks,
                            "chunk_shape": chunks, "sha256": _sha256(tensor)}
        manifest = {
            "format": FORMAT, "version": VERSION, "driver": DRIVER, "source": str(src_dir),
            "step": meta.step, "tp": tp, "chunk_tp": chunk_tp,
            "meta": meta.to_saved(), "tensors": tensors, "fused": _fused(tensors),
            "objects": {k: encode(_only(ckpt.read_object(k), k), k) for k in sorted(ckpt.objects)},
            "common": encode(ckpt.common, "common"),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    print(f"exported {len(tensors)} tensors of {src_dir} to {dst} (chunked for TP={chunk_tp})")


def _only(values: list[Any], key: str) -> Any:
    """megatron stores each object item as the list of the rank's objects under that key."""
    if not isinstance(values, list) or len(values) != 1:
        raise ExportError(f"object {key}: expected one stored object, found {values!r:.80}")
    return values[0]


def _fused(tensors: dict[str, Any]) -> dict[str, Any]:
    """Head-gated `linear_qkv` tensors: stored as `<key>._qkv` and `<key>._gate`; at TP size t
    rank r's local tensor is [its slice of _qkv; its slice of _gate] along the TP axis."""
    fused = {}
    for key, entry in tensors.items():
        gate = key.removesuffix("._qkv") + "._gate"
        if key.endswith("._qkv") and gate in tensors:
            axis = entry["tp_axis"]
            fused[key.removesuffix("._qkv")] = {
                "parts": [key, gate], "axis": axis,
                "sizes": [entry["shape"][axis], tensors[gate]["shape"][axis]],
            }
    return fused


def load_manifest(export_dir: str | Path) -> dict[str, Any]:
    path = manifest_path(export_dir)
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path} is not valid JSON ({e}): restore it from the export") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("version") != VERSION:
        raise ExportError(f"{path}: not a {FORMAT} v{VERSION} manifest")
    problems = manifest_problems(manifest, Path(export_dir))
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ExportError(f"{path} is damaged or edited ({'; '.join(problems[:3])}{more}): "
                          "export the checkpoint again")
    return manifest


def read_rank_shard(export_dir: str | Path, key: str, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s local shard of tensor `key` at TP size `tp`, read from the export (only
    that rank's chunks when `tp` is the export's chunk_tp)."""
    entry = load_manifest(export_dir)["tensors"][key]
    array = ts.open(_spec(Path(export_dir) / entry["path"])).result()
    layout = TPLayout(entry["tp_axis"], entry["tp_blocks"])
    if layout.axis is None:
        return _to_torch(array.read().result(), entry["dtype"])
    lead = (slice(None),) * layout.axis
    parts = [_to_torch(array[lead + (slice(a, b),)].read().result(), entry["dtype"])
             for a, b in layout.ranges(entry["shape"][layout.axis], tp, rank)]
    return torch.cat(parts, dim=layout.axis)


def _as_saved(key: str, tensor: torch.Tensor, layout: TPLayout, tp: int) -> list[ShardedTensor]:
    """`tensor` in the chunks megatron's TP=`tp` ranks write (one per layer and per piece of a
    rank's slice), so that a rank loading it reads only its own chunks, as from the original."""
    stacked = is_stacked(key)
    pieces = 1 if layout.axis is None else layout.blocks * tp
    shards = []
    for layer in range(tensor.shape[0]) if stacked else [None]:
        data = tensor if layer is None else tensor[layer]
        prefix = [] if layer is None else [(0, layer, tensor.shape[0])]
        for p in range(pieces):
            part = data
            offsets = prefix
            if layout.axis is not None:
                size = tensor.shape[layout.axis] // pieces
                part = data.narrow(layout.axis - len(prefix), p * size, size)
                offsets = prefix + [(layout.axis, p, pieces)]
            shards.append(ShardedTensor.from_rank_offsets(
                key, part, *offsets, replica_id=0, prepend_axis_num=len(prefix)))
    return shards


@contextmanager
def _process_group() -> Iterator[None]:
    """megatron saves through torch.distributed: a group of one unless one exists already."""
    if dist.is_initialized():
        yield
        return
    init_process_group(torch.device("cpu"))
    try:
        yield
    finally:
        dist.destroy_process_group()


def import_export(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> None:
    """Write an export back as a torch_dist training checkpoint: the checkpoints root `dst`."""
    src = Path(src)
    manifest = load_manifest(src)
    tensors: dict[str, ShardedTensor] = {}  # several chunks per tensor: distinct dict keys
    for key, entry in tqdm(sorted(manifest["tensors"].items()), desc="importing", unit="tensor"):
        path = src / entry["path"]
        tensor = _to_torch(ts.open(_spec(path)).result().read().result(), entry["dtype"])
        if list(tensor.shape) != entry["shape"] or _sha256(tensor) != entry["sha256"] \
                or str(tensor.dtype).removeprefix("torch.") != entry["dtype"]:
            raise ExportError(f"{path}: data does not match the manifest (a chunk is missing or "
                              "damaged)")
        layout = TPLayout(entry["tp_axis"], entry["tp_blocks"])
        for i, shard in enumerate(_as_saved(key, tensor, layout, manifest["tp"])):
            tensors[f"{key}#{i}"] = shard
    objects = {}
    for unique_key, value in manifest["objects"].items():
        key, offset, shape = object_location(unique_key)
        objects[unique_key] = ShardedObject(key, decode(value), shape, offset, replica_id=0)
    # The sharded part sits under its own key: megatron drops it from common.pt once the
    # sharded values are taken out (but keeps containers that were empty to begin with), so
    # common.pt holds exactly the exported common state.
    sharded = {"tensors": tensors, **({"objects": objects} if objects else {})}
    state = {**decode(manifest["common"]), "sharded": sharded}
    with staged(Path(dst), overwrite, sources=(src,), needs_bytes=tensor_bytes(manifest)) as tmp, \
            _process_group():
        write_checkpoint(tmp, manifest["step"], state)
    print(f"imported {len(manifest['tensors'])} tensors from {src} into {dst}")


def run_export(args: argparse.Namespace) -> int:
    export(args.src, args.dst, chunk_tp=args.chunk_tp, overwrite=args.overwrite)
    return 0


def run_import(args: argparse.Namespace) -> int:
    import_export(args.src, args.dst, overwrite=args.overwrite)
    return 0
