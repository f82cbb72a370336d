"""Time `python -m ckpt import-hf` on a random Llama built locally, with peak host memory.

Builds a random-init `LlamaForCausalLM` with `transformers` (no download; ~1B parameters by
default, Llama-3.2-1B's shape), saves it as sharded safetensors, then runs the import as a
subprocess and samples the memory of its whole process tree (the TP ranks and megatron's
forked writers included) every 50 ms: RSS, which counts pages shared between processes (forked
writers, mapped files) once per process, and PSS, which shares them out (the memory the import
really occupies). The same import of a 2-layer toy model gives the fixed cost of the processes
(torch and megatron-core loaded in the parent and in each rank); what is left of the peak PSS is
what the model's size costs. Prints one JSON line.

    python bench/hf_import.py --tp 1 --dtype bf16 --out hf_import.json          # ~1B
    python bench/hf_import.py --layers 2 --hidden 256 --ffn 512 --vocab 4096   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build(directory: Path, a: argparse.Namespace) -> int:
    """Save a random Llama of the requested shape; returns its parameter count."""
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads,
                         num_key_value_heads=a.kv_heads, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_parameters=dict(
                             rope_type="llama3", rope_theta=500000.0, factor=32.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192))
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(directory, max_shard_size=a.shard_size)
    del model
    return params


def tree_memory(proc: psutil.Process) -> tuple[int, int]:
    """(RSS, PSS) summed over a process and its descendants."""
    rss = pss = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            info = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss, pss = rss + info.rss, pss + info.pss
    return rss, pss


def timed_import(hf: Path, dst: Path, a: argparse.Namespace) -> tuple[float, int, int]:
    """Seconds, peak RSS and peak PSS of `python -m ckpt import-hf hf dst`."""
    start = time.perf_counter()
    proc = psutil.Popen([sys.executable, "-m", "ckpt", "import-hf", str(hf), str(dst),
                         "--target-tp", str(a.tp), "--dtype", a.dtype])
    peak_rss = peak_pss = 0
    while proc.poll() is None:
        rss, pss = tree_memory(proc)
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.05)
    if proc.returncode:
        sys.exit(f"import-hf failed (exit {proc.returncode})")
    return time.perf_counter() - start, peak_rss, peak_pss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--shard-size", default="1GB")
    p.add_argument("--workdir", help="where to write the model and checkpoint (default: tmp)")
    p.add_argument("--out", help="also write the JSON result here")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=a.workdir) as d:
        toy = argparse.Namespace(**{**vars(a), "layers": 2, "hidden": 64, "ffn": 128,
                                    "heads": 4, "kv_heads": 2, "vocab": 256})
        build(Path(d) / "toy", toy)
        _, _, fixed_pss = timed_import(Path(d) / "toy", Path(d) / "toy_ckpt", toy)
        hf = Path(d) / "hf"
        params = build(hf, a)
        size = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
        seconds, peak_rss, peak_pss = timed_import(hf, Path(d) / "ckpt", a)
        result = {"params": params, "dtype": a.dtype, "tp": a.tp, "source_bytes": size,
                  "import_s": round(seconds, 2), "peak_rss_bytes": peak_rss,
                  "peak_pss_bytes": peak_pss, "fixed_pss_bytes": fixed_pss,
                  "model_pss_over_source": round((peak_pss - fixed_pss) / size, 2)}
    print(json.dumps(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
