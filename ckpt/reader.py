"""Read a megatron `torch_dist` checkpoint directory without a model and without running code.

A checkpoint directory holds
    metadata.json   megatron's format marker (JSON)
    .metadata       torch DCP's index: every tensor's global shape, dtype and stored chunks, and
                    where each chunk lives (file, byte offset, length); a pickle
    common.pt       the non-sharded state (step, config, scheduler, optimizer hyper-parameters);
                    megatron-core >= 0.19 stores it instead as the `common_state` object item
    __<rank>_<n>.distcp   the chunks each rank wrote: one `torch.save` zip per tensor chunk or
                    pickled object (RNG states)
torch unpickles `.metadata` with plain `pickle.load` and the object items with
`weights_only=False`. `Checkpoint` parses `.metadata` with an allowlist and `common.pt` with
`weights_only=True`, and `audit` parses every object item with `weights_only=True`, so a crafted
checkpoint is refused before torch or megatron open it. Every file the index names must lie in
the directory (no absolute path, `..` or link out of it, none of the files without tensor data),
so `checksums.json` covers every byte a reader reads. Any damage raises `CheckpointError`
naming the file.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import io
import json
import pickle
import re
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt.checksums import (
    OWN_FILES,
    checksum_problems,
    has_manifest,
    missing_manifest_warning,
    not_inside,
)
from ckpt.meta import CheckpointMeta, MetaError
from ckpt.paths import CheckpointError, checkpoint_name

# Modules whose dataclasses and enums make up torch DCP's `.metadata` pickle.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")


# The embedding: its rows are the padded vocabulary.
MODEL_WEIGHT = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class Item:
    """One stored chunk or object: `length` bytes at `start` in `file` (relative to the dir)."""

    file: str
    start: int
    length: int


@dataclass(frozen=True)
class Chunk:
    """A box of a global tensor stored as one item."""

    offset: tuple[int, ...]
    size: tuple[int, ...]
    item: Item


@dataclass(frozen=True)
class TensorInfo:
    """A global tensor: its shape, dtype and stored chunks."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@contextmanager
def reading(path: Path, what: str) -> Iterator[None]:
    """Turn any failure while reading `path` into a `CheckpointError` that names it."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # torch, pickle, zipfile and json all raise their own types
        raise CheckpointError(f"{path}: cannot read {what}: {type(e).__name__}: {e}") from e


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch DCP's `.metadata`: its dataclasses and enums, torch sizes and dtypes only."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj)
                                          or issubclass(obj, enum.Enum)):
                return obj
        if module == "torch" and (name == "Size"
                                  or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):  # maps a name to a layout
            return torch.serialization._get_layout
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: not checkpoint "
                                     "metadata")


def load_weights_only(data: bytes | Path) -> Any:
    """`torch.load` restricted to tensors and plain Python containers (no code runs)."""
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    return torch.load(source, map_location="cpu", weights_only=True)


def check_zip_crcs(data: bytes) -> None:
    """Check the CRC-32 of every member of a `torch.save` zip (torch's reader does not)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            if info.CRC == 0:  # written with torch's CRC computation turned off
                continue
            with archive.open(info) as member:  # raises BadZipFile on a CRC mismatch
                while member.read(1 << 24):
                    pass


# Where megatron-core >= 0.19 keeps the common state:
# ShardedObject("common_state", ..., (1,), (0,)).
COMMON_OBJECT = "common_state/shard_0_1"


class Checkpoint:
    """One checkpoint directory (`iter_*`): its index and common state, read safely.

    Nothing here loads tensor data until asked (`read`, `audit`).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        marker = self.path / "metadata.json"
        if not marker.is_file():
            raise CheckpointError(f"{marker} is missing: {self.path} is not a complete "
                                  "torch_dist checkpoint")
        for name in OWN_FILES:
            if problem := not_inside(self.path, name, stored=False):
                raise CheckpointError(f"{self.path / name}: {problem}; restore the checkpoint")
        with reading(marker, "the format marker"):
            backend = json.loads(marker.read_text())["sharded_backend"]
        if backend != "torch_dist":
            raise CheckpointError(f"{marker}: sharded_backend is {backend!r}; only torch_dist "
                                  "checkpoints are supported")
        index = self.path / ".metadata"
        with reading(index, "the tensor index"), open(index, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        with reading(index, "the tensor index"):
            self.tensors, self.objects = _parse_index(metadata)
        for name in sorted({item.file for item in self._items()}):
            if problem := not_inside(self.path, name, stored=True):
                raise CheckpointError(f"{index}: the index stores data in {name!r}, {problem}: "
                                      "the index was edited or damaged; restore the checkpoint")
        common = self.path / "common.pt"
        self.common: dict[str, Any]
        if common.is_file():  # megatron-core < 0.19
            with reading(common, "the common state"):
                self.common = load_weights_only(common)
        elif COMMON_OBJECT in self.objects:  # megatron-core >= 0.19: inside the torch_dist data
            self.common = self.read_object(COMMON_OBJECT)[0]
        else:
            raise CheckpointError(f"{common} is missing and {index} holds no {COMMON_OBJECT!r} "
                                  "object: the checkpoint's common state is lost")

    @functools.cached_property
    def meta(self) -> CheckpointMeta:
        """The checkpoint's typed record: model, attention, layout, vocabulary, step, source."""
        extra = self.common.get("extra")
        where = str(self.path / "common.pt")
        if extra is None:
            raise CheckpointError(f"{where} holds no checkpoint record (extra)")
        rows = self.tensors[MODEL_WEIGHT].shape[0] if MODEL_WEIGHT in self.tensors else 0
        try:
            meta = CheckpointMeta.from_saved(extra, rows, where)
        except MetaError as e:
            raise CheckpointError(str(e)) from e
        named = re.fullmatch(r"iter_(\d+)", self.path.name)
        if named and int(named[1]) != meta.step:
            raise CheckpointError(
                f"{where}: the record says step {meta.step}, but the checkpoint lies in "
                f"{self.path.name} (step {int(named[1])}): directories renamed or swapped? "
                f"move it back to {checkpoint_name(meta.step)}, or load another checkpoint")
        return meta

    def files(self) -> list[Path]:
        """Every file of the checkpoint (the chunk files the index names, sorted)."""
        names = {"metadata.json", ".metadata"}
        for optional in ("common.pt", "checksums.json"):
            if (self.path / optional).is_file():
                names.add(optional)
        names |= {c.item.file for t in self.tensors.values() for c in t.chunks}
        names |= {item.file for item in self.objects.values()}
        return sorted(self.path / n for n in names)

    def bytes_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.files() if p.is_file())

    def check_files(self) -> list[str]:
        """Missing or truncated chunk files (cheap: file sizes against the index)."""
        needed: dict[str, int] = {}
        for item in self._items():
            needed[item.file] = max(needed.get(item.file, 0), item.start + item.length)
        problems = []
        for name, end in sorted(needed.items()):
            path = self.path / name
            if not path.is_file():
                problems.append(f"{path}: missing (the index stores data in it)")
            elif path.stat().st_size < end:
                problems.append(f"{path}: truncated: {path.stat().st_size} bytes, the index "
                                f"needs at least {end}")
        return problems

    def integrity_problems(self, share: tuple[int, int] = (0, 1)) -> list[str]:
        """What a reader checks before it reads a weight: files present and long enough, every
        file's SHA-256 against `checksums.json` (no file missing or extra), the pickled objects;
        without a manifest (saved before checksums), every item's CRC. `share=(i, n)`: this
        process's part of the hashing."""
        problems = self.check_files()
        if problems:
            return problems
        if has_manifest(self.path):  # the hashes cover every byte: CRCs would repeat them
            return checksum_problems(self.path, share) or self.audit(share, tensors=False)
        return self.audit(share)

    def require_intact(self) -> None:
        """`integrity_problems` in this one process, raised as one `CheckpointError` (the
        commands that read a checkpoint without a process group: export, export-hf, and
        reshape before it starts its ranks); warns on stderr without a manifest."""
        if not has_manifest(self.path):
            print(f"warning: {missing_manifest_warning(self.path)}", file=sys.stderr)
        problems = self.integrity_problems()
        if problems:
            more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
            raise CheckpointError(f"{self.path} is damaged or changed since its save "
                                  f"({'; '.join(problems[:3])}{more}); nothing was written: "
                                  f"python -m ckpt verify {self.path} lists every problem")

    def audit(self, share: tuple[int, int] = (0, 1), *, tensors: bool = True) -> list[str]:
        """Check every stored item's CRC and parse every pickled object with `weights_only`.

        `share=(i, n)`: only items i, i+n, ... (ranks split the work when loading).
        `tensors=False`: objects only.
        """
        problems = []
        objects = set(self.objects.values())
        items = sorted(set(self._items()) if tensors else objects,
                       key=lambda it: (it.file, it.start))
        for item in items[share[0]::share[1]]:
            try:
                data = self.read_item(item)
                if item in objects:
                    with reading(self.path / item.file, f"the object at byte {item.start}"):
                        load_weights_only(data)
            except CheckpointError as e:
                problems.append(str(e))
        return problems

    def read_item(self, item: Item) -> bytes:
        """An item's bytes, CRC-checked."""
        path = self.path / item.file
        with reading(path, f"{item.length} bytes at byte {item.start}"):
            with open(path, "rb") as f:
                f.seek(item.start)
                data = f.read(item.length)
            if len(data) != item.length:
                raise EOFError(f"file ends after {item.start + len(data)} bytes")
            check_zip_crcs(data)
        return data

    def read(self, key: str) -> torch.Tensor:
        """The whole global tensor `key`, checked: every chunk's CRC, shape and dtype, and that
        the chunks cover the tensor."""
        info = self.tensors[key]
        out = torch.empty(info.shape, dtype=info.dtype)
        covered = 0
        for chunk in info.chunks:
            with reading(self.path / chunk.item.file, f"tensor {key} at {chunk.offset}"):
                part = load_weights_only(self.read_item(chunk.item))
                if tuple(part.shape) != chunk.size or part.dtype != info.dtype:
                    raise ValueError(f"stored chunk is {part.dtype}{list(part.shape)}, the index "
                                     f"says {info.dtype}{list(chunk.size)}")
            out[tuple(slice(o, o + s) for o, s in zip(chunk.offset, chunk.size))] = part
            covered += _numel(chunk.size)
        if covered != _numel(info.shape):  # DCP chunks never overlap: the count is the coverage
            raise CheckpointError(f"{self.path / '.metadata'}: tensor {key} is incomplete: its "
                                  f"chunks hold {covered} of {_numel(info.shape)} elements")
        return out

    def read_object(self, unique_key: str) -> Any:
        """A pickled object item (megatron stores a list of the rank's objects), weights-only."""
        item = self.objects[unique_key]
        with reading(self.path / item.file, f"object {unique_key}"):
            return load_weights_only(self.read_item(item))

    def _items(self) -> Iterator[Item]:
        for info in self.tensors.values():
            for chunk in info.chunks:
                yield chunk.item
        yield from self.objects.values()


def object_location(unique_key: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """Key, global offset and global shape of a megatron object from its stored name,
    `<key>/shard_<offset>_<shape>` (the key may hold "/" itself: `rng_state/tp2`)."""
    key, shard = unique_key.rsplit("/shard_", 1)
    offset, shape = (tuple(int(i) for i in part.split(".")) for part in shard.split("_"))
    return key, offset, shape


def _parse_index(metadata: Any) -> tuple[dict[str, TensorInfo], dict[str, Item]]:
    """Tensors and objects from torch DCP's `Metadata`, each with where its bytes live."""
    storage: dict[tuple[str, tuple[int, ...] | None], Item] = {}
    for index, info in metadata.storage_data.items():
        if info.transform_descriptors:  # compressed or otherwise transformed by an extension
            raise ValueError(f"{index.fqn}: stored with transforms {info.transform_descriptors}, "
                             "which this reader does not support")
        offset = tuple(index.offset) if index.offset is not None else None
        storage[(index.fqn, offset)] = Item(str(info.relative_path), info.offset, info.length)
    tensors: dict[str, TensorInfo] = {}
    objects: dict[str, Item] = {}
    for key, md in metadata.state_dict_metadata.items():
        if hasattr(md, "chunks"):
            chunks = tuple(
                Chunk(tuple(c.offsets), tuple(c.sizes), storage[(key, tuple(c.offsets))])
                for c in md.chunks
            )
            tensors[key] = _checked(TensorInfo(key, tuple(md.size), md.properties.dtype,
                                               chunks))
        else:
            objects[key] = storage[(key, None)]
    return tensors, objects


def _is_size(n: Any) -> bool:
    return type(n) is int and n >= 0


def _checked(info: TensorInfo) -> TensorInfo:
    """`info` when its shape and chunks are sizes that fit each other and the bytes stored, else
    ValueError: a forged index (a shape of [10**12] or [-5]) must not make a reader allocate or
    fail far from its cause."""
    if not (isinstance(info.dtype, torch.dtype) and len(info.shape) <= 16
            and all(map(_is_size, info.shape))):
        raise ValueError(f"tensor {info.key}: shape {list(info.shape)} / dtype {info.dtype} is "
                         "not a tensor's (sizes must be whole numbers >= 0)")
    stored = 0
    for chunk in info.chunks:
        if not (len(chunk.offset) == len(chunk.size) == len(info.shape)
                and all(map(_is_size, chunk.offset + chunk.size))
                and all(o + n <= d for o, n, d in zip(chunk.offset, chunk.size, info.shape))):
            raise ValueError(f"tensor {info.key}: chunk at {list(chunk.offset)} of size "
                             f"{list(chunk.size)} lies outside its shape {list(info.shape)}")
        if _numel(chunk.size) * info.dtype.itemsize > chunk.item.length:
            raise ValueError(f"tensor {info.key}: chunk at {list(chunk.offset)} of size "
                             f"{list(chunk.size)} needs more than the {chunk.item.length} bytes "
                             "stored for it")
        stored += _numel(chunk.size)
    if stored < _numel(info.shape):
        raise ValueError(f"tensor {info.key}: shape {list(info.shape)} holds "
                         f"{_numel(info.shape)} elements, its chunks only {stored}")
    return info
