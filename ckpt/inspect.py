"""`python -m ckpt inspect DIR`: what a checkpoint holds, from its index alone (no tensor data)."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict
from typing import Any

from ckpt.disk import human_bytes
from ckpt.layout import tp_layout
from ckpt.paths import resolve_checkpoint
from ckpt.reader import MODEL_WEIGHT, Checkpoint


def describe(ckpt: Checkpoint) -> dict[str, Any]:
    """Step, run settings, TP size, tensors (global shape, dtype, bytes, TP split), sizes."""
    meta = ckpt.meta
    swiglu = meta.model.swiglu
    tensors = [
        {"key": t.key, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
         "bytes": t.nbytes, "tp_split": tp_layout(t.key, swiglu).describe()}
        for t in ckpt.tensors.values()
    ]
    objects = Counter(key.rsplit("/shard_", 1)[0] for key in ckpt.objects)
    weights = ckpt.tensors.get(MODEL_WEIGHT)
    return {
        "path": str(ckpt.path),
        "step": meta.step,
        "consumed_samples": meta.consumed_samples,
        "tp": meta.layout.tp,
        "layout": meta.layout.to_dict(),
        "model_only": meta.model_only,
        "weights_dtype": str(weights.dtype).removeprefix("torch.") if weights else None,
        "model": asdict(meta.model),
        "attention": asdict(meta.attention),
        "seq_length": meta.seq_length,
        "vocab_size": meta.vocab_size,
        "tokenizer": meta.tokenizer,
        "source": None if meta.hf_source is None else {
            "path": meta.hf_source.path, "architecture": meta.hf_source.architecture},
        "bytes_on_disk": ckpt.bytes_on_disk(),
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "tensors": tensors,
        "objects": dict(sorted(objects.items())),
    }


def format_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
             for r in [header] + rows]
    return "\n".join(lines)


def _settings(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items() if k not in ("name", "kind"))


# The attention settings each kind uses (the others keep their defaults and mean nothing here)
_KIND_SETTINGS = {"standard": (), "chunked": ("chunk_size", "global_layer_interval"),
                  "dca": ("dca_chunk_size", "dca_local_size", "dca_scaling", "dca_scaling_parts",
                          "dca_scaling_attn_scale", "dca_scaling_floor_scale",
                          "dca_scaling_original_length")}
_ROPE_SETTINGS = {"linear": ("rope_scaling_factor",), "ntk": ("rope_scaling_factor",),
                  "dynamic": ("rope_scaling_factor",),
                  "yarn": ("rope_scaling_factor", "rope_original_max_position", "rope_beta_fast",
                           "rope_beta_slow", "rope_attention_factor"),
                  "llama3": ("rope_scaling_factor", "rope_original_max_position",
                             "rope_low_freq_factor", "rope_high_freq_factor")}


def model_settings(model: dict[str, Any]) -> dict[str, Any]:
    """The model's settings, RoPE scaling's only when it scales."""
    kept = ("rope_theta", "rope_scaling_type") + _ROPE_SETTINGS.get(
        model.get("rope_scaling_type"), ())
    return {k: v for k, v in model.items() if not k.startswith("rope_") or k in kept}


def attention_settings(attention: dict[str, Any]) -> dict[str, Any]:
    """The settings the attention's kind uses, the gate's when it is on."""
    keys = _KIND_SETTINGS.get(attention["kind"], tuple(attention))
    gate = ("head_wise_attn_gate", "head_wise_attn_gate_init_weight_scale",
            "head_wise_attn_gate_init_bias") if attention.get("head_wise_attn_gate") else ()
    return {k: attention[k] for k in keys + gate if k in attention}


def print_description(d: dict[str, Any]) -> None:
    model, attention = d["model"], d["attention"]
    print(f"checkpoint {d['path']}")
    print(f"  step {d['step']} (consumed samples {d['consumed_samples']}), saved at TP={d['tp']}, "
          f"weights {d['weights_dtype']}{', model only' if d['model_only'] else ''}")
    layout = d["layout"]
    print("  layout " + " ".join(f"{k}={v}" for k, v in layout.items()))
    print(f"  on disk {human_bytes(d['bytes_on_disk'])}, tensors {human_bytes(d['tensor_bytes'])}")
    print(f"  model {model['name']}: {_settings(model_settings(model))}")
    print(f"  sequence length {d['seq_length']}, vocabulary {d['vocab_size']}, tokenizer "
          f"{d['tokenizer']}")
    if d.get("source"):
        print(f"  imported from {d['source']['path']} ({d['source']['architecture']})")
    settings = _settings(attention_settings(attention))
    print(f"  attention {attention['kind']}{': ' + settings if settings else ''}")
    rows = [[t["key"], "x".join(map(str, t["shape"])), t["dtype"], human_bytes(t["bytes"]),
             t["tp_split"]] for t in d["tensors"]]
    print(f"\n{len(rows)} tensors:")
    print(format_table(rows, ["key", "global shape", "dtype", "size", "TP split"]))
    print("\nobjects: " + ", ".join(f"{k} ({n} shards)" for k, n in d["objects"].items()))


def run(args: argparse.Namespace) -> int:
    d = describe(Checkpoint(resolve_checkpoint(args.dir)))
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print_description(d)
    return 0
