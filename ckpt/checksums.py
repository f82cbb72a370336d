"""`checksums.json`: every file of a checkpoint with its size and SHA-256, recorded at save time.

A save hashes each file it wrote (each rank its own `.distcp` files, rank 0 the rest) and writes
the manifest last, inside `iter_N.tmp/`, before the rename. A load and `python -m ckpt verify`
compare the directory with it and name each file that differs, is missing or is extra; this
catches what the zip CRCs cannot (a `common.pt` rewritten with `torch.save` after a bit flip).
Checkpoints saved before the manifest existed have none: they load with a one-line warning.
The manifest covers what a reader reads only when every file lies in the directory: `not_inside`
says why a name does not (`ckpt.reader` checks every file its index names).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

MANIFEST = "checksums.json"
FORMAT, VERSION, ALGORITHM = "longctx-checksums", 1, "sha256"


def file_digest(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of one file, read in blocks (files larger than memory are fine)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, ALGORITHM).hexdigest()
        return {"size": os.fstat(f.fileno()).st_size, ALGORITHM: digest}


def checkpoint_files(directory: Path) -> list[str]:
    """Every file under `directory` but the manifest, as sorted relative POSIX paths."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def digests(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: file_digest(directory / name) for name in names}


def write_manifest(directory: Path, files: dict[str, dict[str, Any]]) -> None:
    """Write the manifest of `files` (name -> size and hash) into `directory`, fsynced."""
    manifest = {"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM,
                "files": dict(sorted(files.items()))}
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def has_manifest(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def checksum_problems(directory: Path, share: tuple[int, int] = (0, 1)) -> list[str]:
    """Files of `directory` that differ from its manifest, are missing from it or are extra.

    `share=(i, n)`: hash only files i, i+n, ... (ranks split the reading); share 0 also
    compares the listing. Call only when `has_manifest(directory)`.
    """
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT or manifest.get("algorithm") != ALGORITHM:
            raise ValueError(f"not a {FORMAT} manifest with {ALGORITHM} hashes")
        recorded: dict[str, dict[str, Any]] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{path}: cannot read the checksum manifest: {type(e).__name__}: {e}"]
    present = checkpoint_files(directory)
    problems = []
    if share[0] == 0:
        problems += [f"{directory / name}: missing (listed in {MANIFEST})"
                     for name in sorted(set(recorded) - set(present))]
        problems += [f"{directory / name}: extra file, not written by the save (not in "
                     f"{MANIFEST})" for name in sorted(set(present) - set(recorded))]
    for name in sorted(set(recorded) & set(present))[share[0]::share[1]]:
        want = recorded[name]
        size = (directory / name).stat().st_size
        if size != want.get("size"):
            problems.append(f"{directory / name}: {size} bytes, {MANIFEST} recorded "
                            f"{want.get('size')}")
        elif file_digest(directory / name)[ALGORITHM] != want.get(ALGORITHM):
            problems.append(f"{directory / name}: contents changed since the save ({ALGORITHM} "
                            f"differs from {MANIFEST})")
    return problems


def missing_manifest_warning(directory: Path) -> str:
    return (f"{directory} has no {MANIFEST} (saved before checksums were recorded): checking "
            "only sizes and CRCs")


# Files of a checkpoint that hold no tensor data of its index.
OWN_FILES = ("metadata.json", ".metadata", "common.pt", MANIFEST)


def not_inside(directory: Path, name: str, *, stored: bool) -> str | None:
    """Why the file `name` of checkpoint `directory` is not one of its own files (None: it is):
    a path out of the directory (absolute, `..`, a symbolic link that leads out) or, for a file
    the index stores data in (`stored`), one of the files that hold none."""
    if not name or PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
        return f"a path outside {directory}"
    if stored and name in OWN_FILES:
        return "one of the checkpoint's files that hold no tensor data"
    path = directory / name
    if (path.exists() or path.is_symlink()) \
            and not path.resolve().is_relative_to(directory.resolve()):
        return f"a link to {path.resolve()}, outside {directory}"
    return None
