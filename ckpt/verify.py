"""`python -m ckpt verify DIR [--against OTHER]`: read every tensor; compare two checkpoints."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ckpt.checksums import checksum_problems, has_manifest, missing_manifest_warning
from ckpt.disk import human_bytes
from ckpt.inspect import format_table
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint, CheckpointError


def check(ckpt: Checkpoint, progress: bool = True) -> list[str]:
    """Every problem found reading the whole checkpoint: missing or truncated files, files that
    differ from the checksum manifest or are missing from it or extra, a record that is damaged
    or names another step than its directory, CRC errors, unsafe or unreadable objects, tensors
    whose chunks are unreadable or incomplete."""
    problems = ckpt.check_files()
    if problems:  # reading would only repeat these
        return problems
    if has_manifest(ckpt.path):
        problems = checksum_problems(ckpt.path)
    try:  # the record: typed, in range, its step the directory's (every reader checks it)
        ckpt.meta  # noqa: B018
    except CheckpointError as e:
        problems.append(str(e))
    problems += ckpt.audit(tensors=False)  # objects; tensors are read (and CRC-checked) below
    for key in tqdm(sorted(ckpt.tensors), desc="reading tensors", unit="tensor",
                    disable=not progress):
        try:
            ckpt.read(key)
        except CheckpointError as e:
            problems.append(str(e))
    return problems


@dataclass(frozen=True)
class Difference:
    """One tensor compared: `problem` is None when it matches."""

    key: str
    max_abs_diff: float | None
    problem: str | None


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bytes (NaNs with the same payload are equal; -0.0 and 0.0 are not)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def compare(a: Checkpoint, b: Checkpoint, keys: Iterable[str] | None = None, atol: float = 0.0,
            progress: bool = True) -> list[Difference]:
    """Compare tensors of two checkpoints (all keys of either, or `keys`): a tensor matches when
    it is in both with the same shape and dtype and is bitwise equal (`atol=0`) or within
    `atol`."""
    keys = sorted(set(a.tensors) | set(b.tensors)) if keys is None else sorted(keys)
    out = []
    for key in tqdm(keys, desc="comparing", unit="tensor", disable=not progress):
        if key not in a.tensors or key not in b.tensors:
            where = a.path if key not in a.tensors else b.path
            out.append(Difference(key, None, f"missing in {where}"))
            continue
        x, y = a.tensors[key], b.tensors[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            problem = f"{x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
            out.append(Difference(key, None, problem))
            continue
        tx, ty = a.read(key), b.read(key)
        diff = (tx.double() - ty.double()).abs().max().item() if tx.numel() else 0.0
        same = bitwise_equal(tx, ty) if atol == 0 else diff <= atol
        out.append(Difference(key, diff, None if same else f"max abs diff {diff:.3g}"))
    return out


def run(args: argparse.Namespace) -> int:
    ckpt = Checkpoint(resolve_checkpoint(args.dir))
    if args.against is None:
        if not has_manifest(ckpt.path):
            print(f"warning: {missing_manifest_warning(ckpt.path)}", file=sys.stderr)
        problems = check(ckpt)
        for p in problems:
            print(f"FAIL {p}")
        if not problems:
            total = sum(t.nbytes for t in ckpt.tensors.values())
            print(f"OK {ckpt.path}: {len(ckpt.tensors)} tensors ({human_bytes(total)}) and "
                  f"{len(ckpt.objects)} objects readable and complete")
        return 1 if problems else 0
    other = Checkpoint(resolve_checkpoint(args.against))
    diffs = compare(ckpt, other, atol=args.atol)
    rows = [[d.key, "-" if d.max_abs_diff is None else f"{d.max_abs_diff:.3g}",
             "ok" if d.problem is None else f"MISMATCH: {d.problem}"] for d in diffs]
    print(format_table(rows, ["key", "max abs diff", "result"]))
    bad = sum(d.problem is not None for d in diffs)
    print(f"\n{len(diffs) - bad} of {len(diffs)} tensors match"
          + (f", {bad} differ" if bad else ""))
    return 1 if bad else 0
