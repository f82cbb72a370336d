"""`python -m ckpt gguf-to-hf MODEL.gguf HF_DIR`: a GGUF file as a Hugging Face model directory.

Models often travel as GGUF (llama.cpp's format; some Python packages bundle one). transformers
reads a Llama/Qwen2/Mistral GGUF and dequantizes its weights (with the `gguf` package); this
writes what it read as a plain model directory: `config.json` (the quantization entry dropped),
`model.safetensors` (float32 or bfloat16), the tokenizer files and its chat template, and
`gguf_source.json` (the file's name, size and SHA-256, so the directory says where it came from).
`python -m ckpt import-hf HF_DIR DST` then imports it like any other. Dequantized weights are
the quantized model's, not the original full-precision ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from ckpt.destination import staged
from ckpt.hf_config import HFError

ARCHITECTURES = ("llama", "qwen2", "mistral")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_file(path: str | Path) -> Path:
    """`path` resolved, if it is a GGUF file (its magic bytes), else HFError."""
    gguf = Path(path).resolve()
    if not gguf.is_file():
        raise HFError(f"{gguf}: no such GGUF file")
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise HFError(f"{gguf}: not a GGUF file (it does not start with 'GGUF')")
    return gguf


def gguf_to_hf(gguf: str | Path, dst: str | Path, *, dtype: str = "fp32",
               overwrite: bool = False) -> None:
    """Write the model in the GGUF file `gguf` as the Hugging Face directory `dst`."""
    gguf = gguf_file(gguf)
    try:
        import gguf as _  # noqa: F401  transformers' dequantizer
        import torch
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise HFError(f"gguf-to-hf needs transformers and gguf ({err.name} is missing): pip "
                      "install gguf transformers accelerate") from None
    folder, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if config.model_type not in ARCHITECTURES:
        raise HFError(f"{gguf}: a {config.model_type} model; import-hf takes "
                      f"{', '.join(ARCHITECTURES)}")
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = "float32" if dtype == "fp32" else "bfloat16"
    source = {"gguf_file": name, "bytes": gguf.stat().st_size, "sha256": _sha256(gguf),
              "dtype": cfg["dtype"], "note": "weights dequantized from the GGUF file"}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with staged(Path(dst), overwrite, sources=(gguf.parent,) if Path(dst).resolve()
                == gguf.parent else (), needs_bytes=nbytes) as tmp:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tokenizer.save_pretrained(tmp)
        (tmp / "gguf_source.json").write_text(json.dumps(source, indent=2) + "\n")
    print(f"wrote {dst} ({cfg['architectures'][0]}, {len(tensors)} tensors, {cfg['dtype']}, "
          f"from {name})")


def run(args: argparse.Namespace) -> int:
    gguf_to_hf(args.gguf, args.dst, dtype=args.dtype, overwrite=args.overwrite)
    return 0
