"""Attacks through a checkpoint's record (`common.pt`'s `extra`: ckpt/meta.py) and its tensor index
(`.metadata`), the checksum manifest rewritten to match as an attacker would.

Every value of the record is typed and range-checked by the one check every model source shares
(`models.validation`, called by `CheckpointMeta.from_saved`), and the step it records must be its
directory's: an edited record used to export "successfully" (`vocab_size=-1`), hang `reshape` and
a resume (`num_layers=10**9`), or let a swapped `iter_*` pair verify OK and resume at the wrong
step. Each is now one `error:` line (inspect, export-hf, a resume) or a `FAIL` line (verify).
Start the next attack on a record here.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt.__main__ import main
from ckpt.checksums import checkpoint_files, digests, write_manifest
from ckpt.paths import resolve_checkpoint
from tests.ckpt.cli import refused


def _rehash(ckpt: Path) -> None:
    write_manifest(ckpt, digests(ckpt, checkpoint_files(ckpt)))


def _edit_record(root: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of `root` whose newest checkpoint's record went through `edit`."""
    shutil.copytree(root, dst)
    ckpt = resolve_checkpoint(dst)
    common = torch.load(ckpt / "common.pt", weights_only=True)
    edit(common["extra"])
    torch.save(common, ckpt / "common.pt")
    _rehash(ckpt)
    return dst


def _set(*path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(record: dict[str, Any]) -> None:
        node = record
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


RECORDS = {
    "num_layers text": (_set("model", "num_layers", value="abc"),
                        "model.num_layers='abc' must be a whole number"),
    "a billion layers": (_set("model", "num_layers", value=10**9),
                         "model.num_layers=1000000000 must be a whole number in [1, 1024]"),
    "no heads": (_set("model", "num_attention_heads", value=0),
                 "model.num_attention_heads=0 must be"),
    "step text": (_set("step", value="abc"), "step='abc' must be a whole number"),
    "wandb id a path": (_set("wandb_id", value="../.."), "wandb_id='../..' must be null or a"),
    "vocabulary -1": (_set("vocab_size", value=-1), "vocab_size=-1 must be a whole number"),
    "tied a string": (_set("model", "untie_embeddings", value="false"),
                      "model.untie_embeddings='false' must be true or false"),
    "unknown attention": (_set("attention", "kind", value="evil"),
                          "attention.kind='evil' must be one of"),
    "layout not a mapping": (_set("layout", value="tp=1"), "not a mapping"),
    "layout tp 0": (_set("layout", "tp", value=0), "layout.tp=0 must be a whole number"),
}


@pytest.mark.parametrize("name", RECORDS)
def test_an_edited_record_is_refused_by_every_reader(root: Path, tmp_path: Path, name: str,
                                                     capsys) -> None:
    from trainer.errors import UserError
    from trainer.init_from import open_load

    edit, message = RECORDS[name]
    src = _edit_record(root, tmp_path / "src", edit)
    for argv in (["inspect", str(src)], ["export-hf", str(src), str(tmp_path / "hf")]):
        refused(capsys, argv, message, "common.pt")
    assert not (tmp_path / "hf").exists()
    assert main(["verify", str(src)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {resolve_checkpoint(src) / 'common.pt'}: " in out and message in out, out
    with pytest.raises(UserError, match="checkpoint.load=") as info:  # a resume, a fine-tune
        open_load(str(src))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_billion_layers_in_a_record_is_refused_at_once(root: Path, tmp_path: Path,
                                                          capsys) -> None:
    """`reshape` of it hung over 90 s before."""
    src = _edit_record(root, tmp_path / "src", RECORDS["a billion layers"][0])
    start = time.monotonic()
    assert main(["reshape", str(src), str(tmp_path / "dst"), "--target-tp", "1"]) == 2
    assert time.monotonic() - start < 30
    assert "model.num_layers=1000000000" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


def test_swapped_checkpoint_directories_are_named(root: Path, tmp_path: Path, capsys) -> None:
    """iter_0000002 and iter_0000004 swapped: each one's own checksums still match, so verify
    said OK and a resume 'resumed from iter_0000004' at step 3."""
    from trainer.errors import UserError
    from trainer.init_from import open_load

    src = Path(shutil.copytree(root, tmp_path / "src"))
    (src / "iter_0000002").rename(src / "swap")
    (src / "iter_0000004").rename(src / "iter_0000002")
    (src / "swap").rename(src / "iter_0000004")
    assert main(["verify", str(src)]) == 1  # the tracker names step 4
    out = capsys.readouterr().out
    assert "the record says step 2, but the checkpoint lies in iter_0000004" in out, out
    assert main(["verify", str(src / "iter_0000002")]) == 1
    assert "the record says step 4" in capsys.readouterr().out
    assert main(["inspect", str(src)]) == 2
    assert capsys.readouterr().err.count("error:") == 1
    with pytest.raises(UserError, match="record says step 2, but .* iter_0000004"):
        open_load(str(src))


def _forge_index(ckpt: Path, size: tuple[int, ...]) -> str:
    """Give the embedding's entry of `.metadata` the global shape `size`; returns its key."""
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    key = "embedding.word_embeddings.weight"
    entry = metadata.state_dict_metadata[key]
    metadata.state_dict_metadata[key] = dataclasses.replace(entry, size=torch.Size(size))
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    _rehash(ckpt)
    return key


@pytest.mark.parametrize("size", [(10**12, 128), (-5, 128), (4096, 128)],
                         ids=["1e12 rows", "-5 rows", "more rows than stored"])
def test_a_forged_tensor_shape_in_the_index_is_refused(root: Path, tmp_path: Path, capsys,
                                                        size: tuple[int, ...]) -> None:
    """`verify` allocated the forged shape (a `can't allocate` traceback) before."""
    src = Path(shutil.copytree(root, tmp_path / "src"))
    key = _forge_index(resolve_checkpoint(src), size)
    start = time.monotonic()
    assert main(["verify", str(src)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert ".metadata" in err and key in err and str(list(size)) in err, err
    assert time.monotonic() - start < 30
