"""`python -m ckpt export-hf CKPT DST`: a checkpoint as a Hugging Face model directory.

Reads the global tensors (any TP size; no process group, no model built) with
`ckpt.reader.Checkpoint.read`, one megatron tensor at a time, and writes `config.json` (a Llama,
or Qwen2 when the model has q/k/v biases) and `model.safetensors`, or shards with
`model.safetensors.index.json` above `--max-shard-bytes`. The checkpoint's tokenizer files are
copied when its run used a `tokenizer.json`. DCA or chunked attention settings go into
config.json under the key "longctx" (transformers ignores it and runs standard attention). A
head-gated model has no Llama equivalent and is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ckpt.destination import add_destination_arguments, staged
from ckpt.hf_config import HFError, hf_config
from ckpt.hf_import import INDEX
from ckpt.hf_weights import Shape, hf_tensors
from ckpt.layout import is_optimizer_key
from ckpt.paths import resolve_checkpoint
from ckpt.reader import CHECKPOINT_HELP, MODEL_WEIGHT, Checkpoint
from models.gpt import ffn_hidden_size
from models.schema import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _model(ckpt: Checkpoint) -> ModelConfig:
    return dataclasses.replace(ckpt.meta.model, ffn_hidden_size=ffn_hidden_size(ckpt.meta.model))


def _refusals(ckpt: Checkpoint, m: ModelConfig) -> list[str]:
    att = ckpt.meta.attention
    problems = []
    if att.head_wise_attn_gate:
        problems.append("attention.head_wise_attn_gate: a head-gated model cannot be expressed "
                        "as a Hugging Face Llama/Qwen2 (the gate would be dropped)")
    if m.normalization != "RMSNorm" or not m.swiglu:
        problems.append(f"model.normalization={m.normalization}, model.swiglu={m.swiglu}: only "
                        "RMSNorm + SwiGLU models are Llama-shaped")
    return problems


def _longctx(ckpt: Checkpoint) -> dict[str, Any]:
    """The attention variant's settings, recorded under config.json's "longctx" key."""
    att = ckpt.meta.attention
    if att.kind == "dca":
        return {"attention": "dca", "dca_chunk_size": att.dca_chunk_size,
                "dca_local_size": att.dca_local_size}
    if att.kind == "chunked":
        return {"attention": "chunked", "chunk_size": att.chunk_size,
                "global_layer_interval": att.global_layer_interval}
    return {}


def export_vocab(ckpt: Checkpoint) -> int:
    """The vocabulary to export, padding rows dropped: the one the checkpoint records (an
    imported model's `vocab_size`, the tokenizer's for a trained one), never above the
    embedding's rows."""
    return min(ckpt.meta.vocab_size, ckpt.tensors[MODEL_WEIGHT].shape[0])


def export_hf(src: str | Path, dst: str | Path, *, overwrite: bool = False,
              max_shard_bytes: int = 5 * 2**30) -> None:
    """Write checkpoint `src` as the Hugging Face model directory `dst`."""
    if max_shard_bytes < 1:
        raise HFError(f"--max-shard-bytes {max_shard_bytes} must be >= 1 (bytes per "
                      "safetensors shard; the default is 5 GiB)")
    src_dir = resolve_checkpoint(src)
    ckpt = Checkpoint(src_dir)
    m = _model(ckpt)
    problems = _refusals(ckpt, m)
    if problems:
        raise HFError(f"cannot export {src_dir}:\n  - " + "\n  - ".join(problems))
    vocab = export_vocab(ckpt)
    dtype = ckpt.tensors[MODEL_WEIGHT].dtype
    extra = {"longctx": _longctx(ckpt)} if _longctx(ckpt) else {}
    cfg = hf_config(m, vocab, ckpt.meta.seq_length, _DTYPES[dtype], extra)
    dst = Path(dst)
    weights = sum(t.nbytes for k, t in ckpt.tensors.items() if not is_optimizer_key(k))
    with staged(dst, overwrite, sources=(src_dir,), needs_bytes=weights) as tmp:
        _write_weights(tmp, hf_tensors(ckpt.read, Shape.of(m), vocab), max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        _copy_tokenizer(ckpt, tmp)
    print(f"wrote {dst} ({cfg['architectures'][0]}, vocab {vocab}, {_DTYPES[dtype]})")


def _write_weights(out: Path, tensors, max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index above the limit."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous().clone()  # views of a stacked tensor: own storage
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                         "weight_map": weight_map}, indent=2) + "\n")


def _copy_tokenizer(ckpt: Checkpoint, out: Path) -> None:
    """The run's tokenizer.json and the HF tokenizer files beside it, if any."""
    spec = ckpt.meta.tokenizer
    tok = Path(spec) / "tokenizer.json" if Path(spec).is_dir() else Path(spec)
    if tok.suffix != ".json":
        return
    if not tok.is_file():
        raise HFError(f"the run's tokenizer {tok} is missing; export needs it to copy it")
    for name in TOKENIZER_FILES:
        path = tok if name == "tokenizer.json" else tok.parent / name
        if path.is_file():
            shutil.copyfile(path, out / name)


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "export-hf", help="export a checkpoint as a Hugging Face Llama/Qwen2 model",
        description="Write a checkpoint (any TP size) as a directory that "
                    "transformers.AutoModelForCausalLM.from_pretrained loads: config.json, "
                    "safetensors and the run's tokenizer files. DCA/chunked settings are kept "
                    "under config.json's \"longctx\" key; head-gated models are refused.")
    p.add_argument("src", help=CHECKPOINT_HELP)
    add_destination_arguments(p, "the Hugging Face model directory")
    p.add_argument("--max-shard-bytes", type=int, default=5 * 2**30,
                   help="split model.safetensors into shards with an index above this size")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    export_hf(args.src, args.dst, overwrite=args.overwrite, max_shard_bytes=args.max_shard_bytes)
    return 0
