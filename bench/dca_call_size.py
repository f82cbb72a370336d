"""How large the DCA backward's kernel calls should be: speed and peak memory against causal.

    python -m bench.dca_call_size --seqs 32768,131072 --out call_size.json
    python -m bench.dca_call_size --kernel fa4 --fractions 4,8 --kv-heads 16   # against FA4

The backward cuts its calls to at most `rows_per_call(tokens)` query rows (dca/backward.py, at
least 8192). This runs DCA forward+backward with that budget at tokens / each of `--fractions`
(default a quarter, half and all of the tokens) beside causal attention on the same shape and
kernel (cuDNN SDPA, or FA4's causal call under `--kernel fa4`), timed and measured as
bench/attention.py does (same settings and flags).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench import attention
from models.attention.dca import backward as dca_backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="32768,131072")
    parser.add_argument("--kv-heads", default="16,4")
    attention.add_variant_args(parser)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--kernel", choices=("cudnn", "fa4"), default="cudnn")
    parser.add_argument("--fractions", default="4,2,1",
                        help="budgets to run: tokens // each (at least MIN_ROWS_PER_CALL)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.back_to_back = 1
    if not torch.cuda.is_available():
        raise SystemExit("bench.dca_call_size needs a CUDA device")
    causal = attention.sdpa("cudnn") if args.kernel == "cudnn" else attention.fa4()
    dca = attention.dca(args.dca_chunk, args.dca_local, kernel=args.kernel)
    fractions = [int(f) for f in args.fractions.split(",")]
    default = dca_backward.rows_per_call
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        for kv in (int(h) for h in args.kv_heads.split(",")):
            ref = attention.measure(causal, seq, args.heads, kv, args.head_dim, args)
            for fraction in fractions:
                dca_backward.rows_per_call = lambda tokens, f=fraction: max(
                    tokens // f, dca_backward.MIN_ROWS_PER_CALL)
                try:
                    row = attention.measure(dca, seq, args.heads, kv, args.head_dim, args)
                finally:
                    dca_backward.rows_per_call = default
                torch.cuda.empty_cache()
                row.update(fraction=fraction,
                           speed_vs_causal=ref["fwd_bwd_ms"] / row["fwd_bwd_ms"],
                           memory_vs_causal=row["peak_mib"] / ref["peak_mib"])
                rows.append(row)
                print(f"seq {seq} heads {args.heads}/{kv} rows per call tokens/{fraction}: "
                      f"fwd+bwd {row['fwd_bwd_ms']:.2f} ms ({row['speed_vs_causal']:.3f}x "
                      f"{args.kernel} causal {ref['fwd_bwd_ms']:.2f}), peak "
                      f"{row['peak_mib']:.0f} MiB ({row['memory_vs_causal']:.2f}x "
                      f"{ref['peak_mib']:.0f})", flush=True)
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cudnn": torch.backends.cudnn.version()}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
