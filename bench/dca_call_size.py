"""How large the DCA backward's kernel calls should be: speed and peak memory against cuDNN.

    python -m bench.dca_call_size --seqs 32768,131072 --out call_size.json

The backward cuts its calls to at most `rows_per_call(tokens)` query rows (dca/backward.py: a
quarter of the tokens, at least 8192). This runs DCA forward+backward with that budget at a
quarter, half and all of the tokens (fewer, larger calls) beside cuDNN causal attention on the
same shape, timed and measured as bench/attention.py does (same settings and flags).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench import attention
from models.attention.dca import backward as dca_backward

FRACTIONS = (4, 2, 1)  # budget = tokens // fraction (at least MIN_ROWS_PER_CALL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="32768,131072")
    parser.add_argument("--kv-heads", default="16,4")
    attention.add_variant_args(parser)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.back_to_back = 1
    if not torch.cuda.is_available():
        raise SystemExit("bench.dca_call_size needs a CUDA device")
    cudnn, dca = attention.sdpa("cudnn"), attention.dca(args.dca_chunk, args.dca_local)
    default = dca_backward.rows_per_call
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        for kv in (int(h) for h in args.kv_heads.split(",")):
            ref = attention.measure(cudnn, seq, args.heads, kv, args.head_dim, args)
            for fraction in FRACTIONS:
                dca_backward.rows_per_call = lambda tokens, f=fraction: max(
                    tokens // f, dca_backward.MIN_ROWS_PER_CALL)
                try:
                    row = attention.measure(dca, seq, args.heads, kv, args.head_dim, args)
                finally:
                    dca_backward.rows_per_call = default
                torch.cuda.empty_cache()
                row.update(fraction=fraction, speed_vs_cudnn=ref["fwd_bwd_ms"] / row["fwd_bwd_ms"],
                           memory_vs_cudnn=row["peak_mib"] / ref["peak_mib"])
                rows.append(row)
                print(f"seq {seq} heads {args.heads}/{kv} rows per call tokens/{fraction}: "
                      f"fwd+bwd {row['fwd_bwd_ms']:.2f} ms ({row['speed_vs_cudnn']:.3f}x cuDNN "
                      f"{ref['fwd_bwd_ms']:.2f}), peak {row['peak_mib']:.0f} MiB "
                      f"({row['memory_vs_cudnn']:.2f}x cuDNN {ref['peak_mib']:.0f})", flush=True)
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cudnn": torch.backends.cudnn.version()}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
