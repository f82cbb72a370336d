"""`python -m ckpt export-hf CKPT DST`: a checkpoint as a Hugging Face model directory.

Reads the global tensors (any TP size; no process group, no model built) with
`ckpt.reader.Checkpoint.read`, one megatron tensor at a time, and writes `config.json` (a Llama,
or Qwen2 when the model has q/k/v biases) and `model.safetensors`, or shards with
`model.safetensors.index.json` above `--max-shard-bytes`. The checkpoint's tokenizer files are
copied when its run used a `tokenizer.json`.

A model that is plain Llama/Qwen2/Mistral (standard attention, no gate) exports as that family
(Mistral when it was imported from one). A DCA, chunked or head-gated model exports with the
transformers remote code in ckpt/remote_code/ (its files copied beside the weights, `auto_map`
in config.json, the attention settings under "longctx"), so
`AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True)` runs the attention it was
trained with. A Qwen2-shaped DCA model without RoPE scaling or gate also keeps model_type qwen2
and carries sglang's `dual_chunk_attention_config`. `max_position_embeddings` is the model's own
(the imported model's, else the trained length; `--max-position-embeddings` for the length DCA
extends it to, the model's own then recorded as "longctx".original_max_position_embeddings).

Training-free context extension, shipped without a fine-tune: `--attention dca` exports the
model with Dual Chunk Attention (sizes `--dca-chunk-size`/`--dca-local-size`, default ChunkLlama's
split of the model's own length T: 3T/4 and T/16; `--dca-scaling log|yarn` adds its logit
scaling, log from T on), `--rope-scaling linear|ntk|yarn --rope-factor
s` with RoPE scaling from T (a plain Llama/Qwen2 config transformers runs natively); either
records `--max-position-embeddings` (default 4T for DCA, sT for RoPE scaling).
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

from ckpt import remote_code
from ckpt.destination import staged
from ckpt.disk import file_size_limit, human_bytes
from ckpt.hf_config import HFError, hf_config, model_max_positions, source_config
from ckpt.hf_import import INDEX
from ckpt.hf_weights import Shape, hf_tensors
from ckpt.layout import is_optimizer_key
from ckpt.paths import resolve_checkpoint
from ckpt.reader import MODEL_WEIGHT, Checkpoint
from models.gpt import ffn_hidden_size
from models.schema import (
    AttentionConfig,
    ModelConfig,
    dca_local_within,
    dca_pretrained_log_floor,
    dca_pretrained_split,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
REMOTE_CODE = ("configuration_longctx.py", "modeling_longctx.py", "longctx_attention.py")
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _model(ckpt: Checkpoint) -> ModelConfig:
    return dataclasses.replace(ckpt.meta.model, ffn_hidden_size=ffn_hidden_size(ckpt.meta.model))


def _refusals(ckpt: Checkpoint, m: ModelConfig) -> list[str]:
    problems = []
    if m.normalization != "RMSNorm" or not m.swiglu:
        problems.append(f"model.normalization={m.normalization}, model.swiglu={m.swiglu}: only "
                        "RMSNorm + SwiGLU models are Llama-shaped")
    return problems


def _longctx(ckpt: Checkpoint, m: ModelConfig, original_max: int) -> dict[str, Any]:
    """The attention settings the remote code reads (config.json's "longctx"); empty for a
    plain model (standard attention, no gate), which needs no remote code."""
    att = ckpt.meta.attention
    gate = att.head_wise_attn_gate
    if att.kind == "standard" and not gate:
        return {}
    out: dict[str, Any] = {"attention": att.kind, "head_wise_attn_gate": gate,
                           "qkv_bias": m.qkv_bias,
                           "original_max_position_embeddings": original_max}
    if att.kind == "dca":
        out.update(dca_chunk_size=att.dca_chunk_size, dca_local_size=att.dca_local_size)
        if att.dca_scaling != "none":
            out.update(dca_scaling=att.dca_scaling, dca_scaling_parts=att.dca_scaling_parts,
                       dca_scaling_attn_scale=att.dca_scaling_attn_scale,
                       dca_scaling_floor_scale=att.dca_scaling_floor_scale,
                       dca_scaling_original_length=(att.dca_scaling_original_length
                                                    or att.dca_chunk_size))
    if att.kind == "chunked":
        out.update(chunk_size=att.chunk_size, global_layer_interval=att.global_layer_interval)
    return out


def _family(ckpt: Checkpoint, m: ModelConfig) -> str:
    if m.qkv_bias:
        return "qwen2"
    source = ckpt.meta.hf_source
    return "mistral" if source and source.architecture == "MistralForCausalLM" else "llama"


def _remote_code(cfg: dict[str, Any], family: str, m: ModelConfig) -> dict[str, Any]:
    """config.json for the remote code: LongCtxForCausalLM, or for a Qwen2-shaped DCA model that
    sglang can serve (no RoPE scaling: its DCA rotary ignores it; no gate; no logit scaling but
    the `yarn` one with its sources' constants on every part) a Qwen2 config with sglang's
    `dual_chunk_attention_config` (chunk_size, local_size; original_max_position_embeddings:
    0 turns its length-dependent scaling off, else it is the `yarn` scaling's length)."""
    settings = cfg["longctx"]
    scaling = settings.get("dca_scaling", "none")
    served = scaling == "none" or (scaling == "yarn" and settings["dca_scaling_parts"] == "all"
                                   and settings["dca_scaling_attn_scale"]
                                   == AttentionConfig.dca_scaling_attn_scale)
    sglang = (family == "qwen2" and settings["attention"] == "dca" and served
              and not settings["head_wise_attn_gate"] and m.rope_scaling_type == "none")
    kind = "LongCtxQwen2" if sglang else "LongCtx"
    cfg["auto_map"] = {"AutoConfig": f"configuration_longctx.{kind}Config",
                       "AutoModelForCausalLM": f"modeling_longctx.{kind}ForCausalLM"}
    if sglang:
        cfg["dual_chunk_attention_config"] = {
            "chunk_size": settings["dca_chunk_size"], "local_size": settings["dca_local_size"],
            "original_max_position_embeddings": settings.get("dca_scaling_original_length", 0)}
        return cfg
    cfg.update(architectures=["LongCtxForCausalLM"], model_type="longctx")
    for key in ("use_sliding_window", "sliding_window"):
        cfg.pop(key, None)
    cfg.update(attention_bias=False, mlp_bias=False)
    return cfg


def export_vocab(ckpt: Checkpoint) -> int:
    """The vocabulary to export, padding rows dropped: the one the checkpoint records (an
    imported model's `vocab_size`, the tokenizer's for a trained one), never above the
    embedding's rows."""
    return min(ckpt.meta.vocab_size, ckpt.tensors[MODEL_WEIGHT].shape[0])


@dataclasses.dataclass(frozen=True)
class Extension:
    """A training-free context extension added at export (see the module doc)."""

    attention: str | None = None  # "dca"
    dca_chunk_size: int | None = None
    dca_local_size: int | None = None
    rope_scaling: str | None = None  # linear | ntk | yarn
    rope_factor: float | None = None
    dca_scaling: str | None = None  # log (floor_scale T) | yarn: DCA's logit scaling

    def apply(self, ckpt: Checkpoint, own: int) -> tuple[Checkpoint, int]:
        """The checkpoint as if it had these settings, and the length to record by default."""
        meta = ckpt.meta
        if self.attention is None and self.rope_scaling is None:
            if self.dca_chunk_size or self.dca_local_size or self.dca_scaling \
                    or self.rope_factor:
                raise HFError("--dca-chunk-size/--dca-local-size/--dca-scaling need --attention "
                              "dca, --rope-factor needs --rope-scaling")
            return ckpt, 0
        if self.attention and self.rope_scaling:
            raise HFError("choose one extension: --attention dca or --rope-scaling")
        if self.attention is not None:
            if self.attention != "dca" or meta.attention.kind not in ("standard", "dca"):
                raise HFError(f"--attention {self.attention}: only dca, on a model with "
                              f"standard attention (this one has {meta.attention.kind})")
            chunk, local = dca_pretrained_split(own)
            chunk = self.dca_chunk_size or chunk
            local = self.dca_local_size or dca_local_within(local, chunk)
            if not 0 < local < chunk:
                raise HFError(f"--dca-local-size {local} must be positive and below "
                              f"--dca-chunk-size {chunk}")
            attention = dataclasses.replace(meta.attention, kind="dca", dca_chunk_size=chunk,
                                            dca_local_size=local)
            if self.dca_scaling is not None:
                if self.dca_scaling not in ("log", "yarn"):
                    raise HFError(f"--dca-scaling {self.dca_scaling}: choose log or yarn")
                # log from the model's own length on (1 within it); yarn as its source
                attention = dataclasses.replace(attention, dca_scaling=self.dca_scaling)
                if self.dca_scaling == "log":
                    attention = dataclasses.replace(
                        attention, dca_scaling_floor_scale=dca_pretrained_log_floor(own))
            print(f"adding DCA: chunk {chunk}, local window {local}"
                  f"{f', {self.dca_scaling} scaling' if self.dca_scaling else ''} (the model's "
                  f"length {own})")
            return _with(ckpt, dataclasses.replace(meta, attention=attention)), 4 * own
        if self.rope_scaling not in ("linear", "ntk", "yarn"):
            raise HFError(f"--rope-scaling {self.rope_scaling}: choose linear, ntk or yarn")
        if meta.model.rope_scaling_type != "none":
            raise HFError(f"the model already scales RoPE ({meta.model.rope_scaling_type}); "
                          "export it without --rope-scaling")
        factor = self.rope_factor or 4.0
        if not factor > 1:
            raise HFError(f"--rope-factor {factor} must be above 1")
        model = dataclasses.replace(meta.model, rope_scaling_type=self.rope_scaling,
                                    rope_scaling_factor=factor, rope_original_max_position=own)
        print(f"adding RoPE scaling: {self.rope_scaling} x{factor:g} from {own}")
        return _with(ckpt, dataclasses.replace(meta, model=model)), int(factor * own)


def _with(ckpt: Checkpoint, meta) -> Checkpoint:
    """`ckpt` read as usual, its record replaced."""
    out = Checkpoint(ckpt.path)
    out.__dict__["meta"] = meta  # the record is a cached property: this copy's own
    return out


def export_hf(src: str | Path, dst: str | Path, *, overwrite: bool = False,
              max_shard_bytes: int = 5 * 2**30, max_positions: int | None = None,
              extension: Extension = Extension()) -> None:
    """Write checkpoint `src` as the Hugging Face model directory `dst` (`max_positions`: the
    max_position_embeddings to write; default the model's own), with `extension` added."""
    if max_shard_bytes < 1:
        raise HFError(f"--max-shard-bytes {max_shard_bytes} must be >= 1 (bytes per "
                      "safetensors shard; the default is 5 GiB)")
    src_dir = resolve_checkpoint(src)
    ckpt = Checkpoint(src_dir)
    ckpt.require_intact()  # checksums: a changed file is refused here, as by verify and resume
    ckpt, extended = extension.apply(ckpt, model_max_positions(ckpt))
    max_positions = max_positions or extended or None
    m = _model(ckpt)
    problems = _refusals(ckpt, m)
    if problems:
        raise HFError(f"cannot export {src_dir}:\n  - " + "\n  - ".join(problems))
    vocab = export_vocab(ckpt)
    dtype = ckpt.tensors[MODEL_WEIGHT].dtype
    own = model_max_positions(ckpt)
    if max_positions is not None and max_positions < own:
        raise HFError(f"--max-position-embeddings {max_positions} is below the model's own "
                      f"length ({own}); give at least {own}")
    settings = _longctx(ckpt, m, own)
    family = _family(ckpt, m)
    max_positions = max_positions or source_config(ckpt).get("max_position_embeddings") or own
    cfg = hf_config(m, vocab, max_positions, _DTYPES[dtype],
                    {"longctx": settings} if settings else {}, family)
    if settings:
        cfg = _remote_code(cfg, family, m)
    gate = ckpt.meta.attention.head_wise_attn_gate
    dst = Path(dst)
    weights = sum(t.nbytes for k, t in ckpt.tensors.items() if not is_optimizer_key(k))
    limit = file_size_limit()
    if limit is not None and min(weights, max_shard_bytes) >= limit:  # a shard fills up to it
        raise HFError(f"this process may write files of at most {human_bytes(limit)} (ulimit "
                      f"-f), and the {human_bytes(weights)} of weights go into files of up to "
                      f"{human_bytes(min(weights, max_shard_bytes))}: pass --max-shard-bytes "
                      f"{limit // 2} (or less), or raise the limit (ulimit -f unlimited)")
    with staged(dst, overwrite, sources=(src_dir,), needs_bytes=weights) as tmp:
        _write_weights(tmp, hf_tensors(ckpt.read, Shape.of(m, gate), vocab), max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if settings:
            for name in REMOTE_CODE:
                shutil.copyfile(Path(remote_code.__file__).parent / name, tmp / name)
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


def run(args: argparse.Namespace) -> int:
    extension = Extension(args.attention, args.dca_chunk_size, args.dca_local_size,
                          args.rope_scaling, args.rope_factor, args.dca_scaling)
    export_hf(args.src, args.dst, overwrite=args.overwrite, max_shard_bytes=args.max_shard_bytes,
              max_positions=args.max_position_embeddings, extension=extension)
    return 0
