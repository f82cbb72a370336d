"""Attacks through a zarr export's `manifest.json` on `python -m ckpt import` (a
manifest that lies, or a malformed one): each is refused in one `error:` line before anything is
written. Start the next attack here."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckpt.__main__ import main
from ckpt.zarr_manifest import MANIFEST

KEY = "decoder.layers.self_attention.linear_qkv.weight"  # split along TP


@pytest.fixture(scope="module")
def export(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zarr") / "export"
    assert main(["export", str(root), str(out), "--format", "zarr"]) == 0
    return out


def _set(path: list[str], value: Any) -> Callable[[dict], None]:
    def edit(manifest: dict) -> None:
        node = manifest
        for name in path[:-1]:
            node = node[name]
        node[path[-1]] = value
    return edit


def _drop(name: str) -> Callable[[dict], None]:
    def edit(manifest: dict) -> None:
        del manifest[name]
    return edit


ATTACKS = {
    "tp 0": (_set(["tp"], 0), "tp: 0 is not a TP size"),
    "tp not the saved one": (_set(["tp"], 2), "saved at TP=1"),
    "tp not dividing": (_set(["tp"], 7), "cannot be cut for tp=7"),
    "chunk_tp negative": (_set(["chunk_tp"], -1), "chunk_tp: -1 is not a TP size"),
    "no tensors": (_drop("tensors"), "tensors: missing"),
    "step abc": (_set(["step"], "abc"), "step: 'abc' is not a step number"),
    "dtype save": (_set(["tensors", KEY, "dtype"], "save"), "dtype 'save' is not one of"),
    "shape text": (_set(["tensors", KEY, "shape"], "big"), "shape 'big' is not a list"),
    "axis out of range": (_set(["tensors", KEY, "tp_axis"], 5), "tp_axis 5 is not an axis"),
    "path outside": (_set(["tensors", KEY, "path"], "../../outside"), "not a path inside"),
    "array missing": (_set(["tensors", KEY, "path"], "arrays/none"), "arrays/none is missing"),
    "no common": (_drop("common"), "common: missing"),
    "a list": (lambda m: [m], "not a longctx-zarr v1 manifest"),
    # the record (`common.extra`, and its copy `meta`) is read as every reader reads it: a
    # billion layers imported, then hung `reshape` and a resume
    "record: a billion layers": (_set(["common", "extra", "model", "num_layers"], 10**9),
                                 "model.num_layers=1000000000 must be a whole number in [1, "),
    "record: layers as text": (_set(["meta", "model", "num_layers"], "abc"),
                               "meta: the checkpoint's record is damaged or edited: "
                               "model.num_layers='abc'"),
    "record: vocabulary -1": (_set(["common", "extra", "vocab_size"], -1), "vocab_size=-1"),
    "record: another step": (_set(["step"], 7), "step: 7, but common.extra records step 4"),
}


@pytest.mark.parametrize("name", ATTACKS)
def test_a_bad_manifest_is_refused_before_anything_is_written(export: Path, tmp_path: Path,
                                                               name: str, capsys) -> None:
    edit, message = ATTACKS[name]
    src = shutil.copytree(export, tmp_path / "export")
    manifest = json.loads((src / MANIFEST).read_text())
    manifest = edit(manifest) or manifest
    (src / MANIFEST).write_text(json.dumps(manifest))
    dst = tmp_path / "imported"
    assert main(["import", str(src), str(dst)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error:") and message in err, err
    assert not dst.exists() and [p.name for p in tmp_path.iterdir()] == ["export"]


@pytest.mark.parametrize("text", ["{", "", "\xff\xfe"], ids=["truncated", "empty", "binary"])
def test_a_manifest_that_is_not_json_is_refused_in_one_line(export: Path, tmp_path: Path,
                                                            text: str, capsys) -> None:
    src = shutil.copytree(export, tmp_path / "export")
    (src / MANIFEST).write_bytes(text.encode("latin-1"))
    assert main(["import", str(src), str(tmp_path / "imported")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "is not valid JSON" in err, err
    assert not (tmp_path / "imported").exists()
