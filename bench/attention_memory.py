"""Where an attention variant's peak memory goes: one forward+backward under the CUDA allocator's
history, replayed to its peak, the blocks live there grouped by the line that allocated them.

    python -m bench.attention_memory --seq 32768 --kv-heads 16 4 --out memory.json

Same shapes and variants as bench/attention.py (batch 1, 16 query heads, d = 128, bf16; cuDNN
causal SDPA and DCA at C = 8192, w = 1024); "peak" is above the inputs (q, k, v, dout), as
there. Each line of the breakdown names the innermost frame in this repository (else the
innermost frame) and the MiB its live blocks held at the peak.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from bench.attention import REGISTRY, add_variant_args

REPO = str(Path(__file__).resolve().parents[1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[32768])
    add_variant_args(p)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[16, 4])
    p.add_argument("--variants", default="sdpa_cudnn,dca")
    p.add_argument("--top", type=int, default=12, help="breakdown lines per measurement")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def _site(frames: list[dict]) -> str:
    """The innermost frame in this repository (else the innermost frame) as file:line fn."""
    ours = [f for f in frames if f["filename"].startswith(REPO)]
    f = (ours or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{f['filename'].removeprefix(REPO + '/')}:{f['line']} {f['name']}"


def peak_breakdown(trace: list[dict]) -> tuple[int, Counter]:
    """Replay allocator events recorded after the inputs existed: the peak of the bytes
    allocated since (frees of older blocks are ignored) and, at that moment, bytes per site."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        action, addr = event["action"], event["addr"]
        if action == "alloc":
            live[addr] = (event["size"], _site(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_requested" and addr in live:
            total -= live.pop(addr)[0]
    sites: Counter = Counter()
    for size, site in at_peak.values():
        sites[site] += size
    return peak, sites


def measure(variant_name: str, args: argparse.Namespace, seq: int, kv_heads: int) -> dict:
    variant = REGISTRY[variant_name](args)
    q, k, v = (torch.randn(1, seq, h, args.head_dim, device="cuda",
                           dtype=torch.bfloat16).requires_grad_()
               for h in (args.heads, kv_heads, kv_heads))
    dout = torch.randn_like(q)
    torch.autograd.grad(variant.fn(q, k, v), (q, k, v), dout)  # warm-up: workspaces, kernels
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    torch.autograd.grad(variant.fn(q, k, v), (q, k, v), dout)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = [e for device in snapshot["device_traces"] for e in device]
    peak, sites = peak_breakdown(trace)
    return {"variant": variant.name, "seq": seq, "heads": args.heads, "kv_heads": kv_heads,
            "peak_mib": (torch.cuda.max_memory_allocated() - start) / 2**20,
            "replayed_peak_mib": peak / 2**20,
            "sites_mib": {s: b / 2**20 for s, b in sites.most_common(args.top)}}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    for seq in args.seq:
        for kv_heads in args.kv_heads:
            cudnn = None
            for name in args.variants.split(","):
                row = measure(name, args, seq, kv_heads)
                cudnn = row["peak_mib"] if name == "sdpa_cudnn" else cudnn
                row["vs_cudnn"] = None if cudnn is None else row["peak_mib"] / cudnn
                rows.append(row)
                ratio = "" if row["vs_cudnn"] is None else f" ({row['vs_cudnn']:.2f}x cuDNN)"
                print(f"seq {seq} heads {args.heads}/{kv_heads} {row['variant']}: peak "
                      f"{row['peak_mib']:.0f} MiB{ratio}, replayed {row['replayed_peak_mib']:.0f}",
                      flush=True)
                for site, mib in row["sites_mib"].items():
                    print(f"    {mib:8.1f} MiB  {site}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
