"""`python -m ckpt import-hf HF_DIR DST [--target-tp N]`: a Hugging Face model as a checkpoint.

HF_DIR holds `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`); pickled weights are never read. Everything is checked from the
config and the safetensors headers before any weight is read: the architecture and settings
(`ckpt/hf_config.py`), every expected tensor present in an existing file with a float dtype and
the shape the config implies. Then N CPU processes (gloo) build the model at TP=N through
`models.gpt.build_model`, fill their shards from slices of the HF tensors (`safe_open`, one
tensor slice at a time: the process tree holds about one copy of the model) and save DST with
the trainer's writer: a model-only checkpoint at step 0 whose record (`ckpt.meta`) holds the
model, its tokenizer, its documented length (`max_position_embeddings`) and the source.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import SafetensorError, safe_open

from ckpt.destination import staged
from ckpt.hf_config import (
    HFError,
    architecture,
    attention_config,
    check_values,
    model_config,
    read_config,
)
from ckpt.hf_weights import Shape, expected_hf, local_tensor
from ckpt.meta import CheckpointMeta, HFSource
from ckpt.save import write_checkpoint
from models.gpt import BuildOptions, build_model, padded_vocab_size, tp_problems
from models.schema import AttentionConfig, ModelConfig, ParallelConfig
from models.validation import SettingError, check_length, check_vocab
from parallel.cpu_mode import enable_cpu_mode
from parallel.distributed import initialize_parallel, shutdown
from parallel.lifetime import run_workers
from parallel.placement import Layout

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
# Tensors some exports carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def weight_files(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it (the index's map, or the one file).
    Every file is checked to lie inside `hf_dir` (resolved) before any is opened."""
    index = hf_dir / INDEX
    if index.is_file():
        weight_map = _read_index(index)
        paths = {file: _inside(hf_dir, file, index) for file in set(weight_map.values())}
        return {name: paths[file] for name, file in weight_map.items()}
    single = hf_dir / "model.safetensors"
    if single.is_file():
        with _open(_inside(hf_dir, single.name, single)) as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no iter)
    raise HFError(f"{hf_dir}: no model.safetensors or {INDEX} (pickled .bin weights are not "
                  "read; convert them to safetensors first)")


def _read_index(index: Path) -> dict[str, str]:
    """The index's weight_map: tensor name -> file name, both strings."""
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFError(f"{index}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or "weight_map" not in data:
        raise HFError(f"{index}: not a safetensors index (a JSON object with a weight_map)")
    weight_map = data["weight_map"]
    if not isinstance(weight_map, dict):
        raise HFError(f"{index}: weight_map must map tensor names to file names, not be a "
                      f"{type(weight_map).__name__}")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise HFError(f"{index}: weight_map[{name!r}]={file!r} must be a file name")
    return weight_map


def _inside(hf_dir: Path, file: str, named_in: Path) -> Path:
    """`hf_dir / file` when it names a file inside `hf_dir` (a symbolic link too, when it stays
    inside, or in the blobs of a huggingface_hub cache snapshot), else HFError: an index must
    not make the import read other files of this machine."""
    rel = Path(file)
    if not file or rel.is_absolute() or ".." in rel.parts:
        raise HFError(f"{named_in}: weight file {file!r} lies outside {hf_dir}; list file names "
                      "inside the model directory")
    real = (hf_dir / rel).resolve()
    hub_blobs = hf_dir.parent.parent / "blobs" if hf_dir.parent.name == "snapshots" else None
    if not (real.is_relative_to(hf_dir) or (hub_blobs and real.is_relative_to(hub_blobs))):
        raise HFError(f"{named_in}: weight file {file} links to {real}, outside {hf_dir}; copy "
                      "the file into the model directory")
    return hf_dir / rel


@contextmanager
def _open(path: Path) -> Iterator[Any]:
    """safe_open, its errors (truncated, empty, a header too large or not JSON) naming the
    file."""
    try:
        with safe_open(path, "pt") as f:
            yield f
    except SafetensorError as e:
        raise HFError(f"{path}: not a readable safetensors file ({e}); download or export it "
                      "again") from None


def check_layers(files: dict[str, Path], layers: int, cfg_path: Path) -> None:
    """The config's layer count against the layers the weight files hold, before anything is
    listed per layer (a count of 10^9 would list 9 x 10^9 tensors)."""
    present = {int(m.group(1)) for m in map(_LAYER_NAME.match, files) if m}
    if len(present) != layers or max(present, default=-1) != layers - 1:  # layers 0..n-1
        held = f"layers 0..{max(present)} ({len(present)} layers)" if present else "no layers"
        raise HFError(f"{cfg_path}: num_hidden_layers={layers} but the weight files hold "
                      f"{held}; fix num_hidden_layers")


def check_tensors(files: dict[str, Path], expected: dict[str, tuple[int, ...]],
                  tied: bool) -> str:
    """Every expected tensor present, float and of its shape (from the headers alone); returns
    the source dtype (fp32, bf16, fp16: the widest found)."""
    problems, dtypes = [], set()
    for path in sorted(set(files.values())):
        if not path.is_file():
            problems.append(f"{path}: missing (listed in {INDEX})")
    missing_files = {p for p in files.values() if not p.is_file()}
    for name in sorted(set(files) - set(expected)):
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        problems.append(f"{files[name]}: tensor {name} is not part of the model the config "
                        "describes")
    for name, shape in expected.items():
        if name not in files:
            problems.append(f"{name}: not in any weight file (the config implies "
                            f"{list(shape)})")
            continue
        if files[name] in missing_files:
            continue
        with _open(files[name]) as f:
            if name not in f.keys():  # noqa: SIM118
                problems.append(f"{files[name]}: tensor {name} is listed but not in the file")
                continue
            sl = f.get_slice(name)
            dtype, got = sl.get_dtype(), tuple(sl.get_shape())
        if dtype not in FLOAT_DTYPES:
            problems.append(f"{files[name]}: tensor {name} has dtype {dtype}; expected one of "
                            f"{sorted(FLOAT_DTYPES)}")
        elif got != shape:
            problems.append(f"{files[name]}: tensor {name} has shape {list(got)}; config.json "
                            f"implies {list(shape)}")
        dtypes.add(FLOAT_DTYPES.get(dtype))
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise HFError("cannot import: " + "; ".join(problems[:3]) + more)
    return "fp32" if "fp32" in dtypes else "bf16"


class SafetensorsSource:
    """`hf_weights.Source` over safetensors files: reads only the asked slice.

    Each read opens and closes its file: safetensors maps the file into memory, and a mapping
    kept open holds every page read so far in the process's resident memory, which would make
    an import hold the whole source beside the model it builds.
    """

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.warned: set[str] = set()

    def rows(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        with safe_open(self.files[name], "pt") as f:
            sl = f.get_slice(name)
            return self._finite(name, sl[:] if start is None else sl[start:stop])

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        with safe_open(self.files[name], "pt") as f:
            return self._finite(name, f.get_slice(name)[:, start:stop])

    def _finite(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, after one warning line per HF tensor holding NaN or Inf values: they import
        as they are (transformers loads them too), and the model computes NaN from them."""
        if name not in self.warned and not bool(torch.isfinite(tensor).all()):
            self.warned.add(name)
            bad = int((~torch.isfinite(tensor)).sum())
            print(f"warning: {self.files[name]}: tensor {name} holds {bad} NaN or infinite "
                  "values (in the part this rank reads); they are imported as they are, and "
                  "the model's outputs will be NaN", file=sys.stderr, flush=True)
        return tensor


def _worker(rank: int, tp: int, store: str, out_root: str, job: dict[str, Any]) -> None:
    """One TP rank (a spawned process): build the model at TP=`tp`, fill its shards, save."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    _import_rank(rank, tp, store, out_root, job)


def _import_rank(rank: int, tp: int, store: str, out_root: str, job: dict[str, Any]) -> None:
    """Build the model at TP=`tp`, fill this rank's shards from HF, save (collective)."""
    enable_cpu_mode()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp)
    try:
        initialize_parallel(torch.device("cpu"), tp, 0)
        model = ModelConfig(**job["model"])
        bf16 = job["dtype"] == "bf16"
        attention = AttentionConfig(**job["attention"])
        built = build_model(model, attention, ParallelConfig(tp=tp),
                            vocab_size=job["vocab"], max_sequence_length=job["seq_length"],
                            options=BuildOptions(bf16=bf16, initialize=False))
        gpt = built.gpt.bfloat16() if bf16 else built.gpt
        src = SafetensorsSource({k: Path(v) for k, v in job["files"].items()})
        shape = Shape.of(model, attention.head_wise_attn_gate)
        with torch.no_grad():
            for name, param in gpt.named_parameters():
                param.copy_(local_tensor(name, shape, src, job["vocab"], built.vocab_size, tp,
                                         rank))
        write_checkpoint(out_root, 0, {"model": gpt.sharded_state_dict(), "extra": job["meta"]})
    finally:
        shutdown()


def import_hf(hf_dir: str | Path, dst: str | Path, tp: int = 1, *, dtype: str | None = None,
              dry_run: bool = False, overwrite: bool = False) -> None:
    """Write the HF model in `hf_dir` as the checkpoints root `dst` at TP=`tp`."""
    hf_dir = Path(hf_dir).resolve()
    cfg_path = hf_dir / "config.json"
    cfg = read_config(hf_dir)
    check_values(cfg, cfg_path)  # types first: a string "false" is true
    arch, _ = architecture(cfg, cfg_path)
    model = model_config(cfg, cfg_path)
    attention = attention_config(cfg, cfg_path)  # an export's own (ckpt/hf_export.py)
    vocab = cfg.get("vocab_size")
    if vocab is None:
        raise HFError(f"{cfg_path}: vocab_size missing")
    seq_length = cfg.get("max_position_embeddings") or 4096
    try:
        check_vocab(vocab)
        check_length(seq_length, "max_position_embeddings")
    except SettingError as e:
        raise HFError(f"{cfg_path}: {e}; fix it in config.json") from None
    files = weight_files(hf_dir)
    check_layers(files, model.num_layers, cfg_path)
    source_dtype = check_tensors(files, expected_hf(Shape.of(model,
                                                            attention.head_wise_attn_gate), vocab),
                                 not model.untie_embeddings)
    dtype = dtype or source_dtype
    problems = _tp_problems(model, vocab, tp)
    if problems:
        raise HFError(f"cannot import {hf_dir} at TP={tp}: " + "; ".join(problems))
    tokenizer = hf_dir / "tokenizer.json"
    meta = CheckpointMeta(
        model=model, attention=attention, layout=Layout(tp=tp), seq_length=seq_length,
        vocab_size=vocab, tokenizer=str(tokenizer) if tokenizer.is_file() else "byte",
        model_only=True, hf_source=HFSource(path=str(hf_dir), architecture=arch,
                                            vocab_size=vocab, config_json=json.dumps(cfg)))
    padded = padded_vocab_size(vocab, model.make_vocab_size_divisible_by, tp)
    print(f"{hf_dir.name}: {arch}, {model.num_layers} layers, hidden {model.hidden_size}, "
          f"heads {model.num_attention_heads}/{model.num_query_groups}, vocab {vocab} (padded "
          f"{padded}), rope {model.rope_scaling_type}, attention {attention.kind}"
          f"{' + head gate' if attention.head_wise_attn_gate else ''}, "
          f"{len(set(files.values()))} file(s), "
          f"{dtype}, TP={tp}")
    if dry_run:
        print(f"dry run: would write {Path(dst)}/iter_0000000 (nothing written)")
        return
    job = {"model": asdict(model), "attention": asdict(attention), "vocab": vocab,
           "dtype": dtype, "seq_length": seq_length,
           "files": {k: str(v) for k, v in files.items()}, "meta": meta.to_saved()}
    dst = Path(dst)
    weights = sum(p.stat().st_size for p in set(files.values()))  # at least: dtypes may widen
    with staged(dst, overwrite, sources=(hf_dir,), needs_bytes=weights) as tmp, \
            tempfile.TemporaryDirectory() as d:
        if tp == 1 and not dist.is_initialized():
            _import_rank(0, 1, f"{d}/store", str(tmp), job)
        else:
            _spawn(tp, f"{d}/store", str(tmp), job)
    print(f"wrote {dst}/iter_0000000 (TP={tp}, model only)")


def _spawn(tp: int, store: str, out_root: str, job: dict[str, Any]) -> None:
    """`tp` worker processes, stopped with this one (`run_workers`)."""
    try:
        run_workers(_worker, (tp, store, out_root, job), tp)
    except mp.ProcessRaisedException as e:
        raise RuntimeError(f"TP rank {e.error_index} failed:\n{e}") from None
    except mp.ProcessExitedException as e:
        raise RuntimeError(f"TP rank {e.error_index} died (exit code {e.exit_code})") from None


def _tp_problems(model: ModelConfig, vocab: int, tp: int) -> list[str]:
    if tp < 1:
        return [f"--target-tp must be at least 1 (got {tp})"]
    problems = tp_problems(model, tp)
    try:
        padded_vocab_size(vocab, model.make_vocab_size_divisible_by, tp)
    except ValueError as e:
        problems.append(str(e))
    return problems


def run(args: argparse.Namespace) -> int:
    import_hf(args.hf_dir, args.dst, args.target_tp, dtype=args.dtype, dry_run=args.dry_run,
              overwrite=args.overwrite)
    return 0
