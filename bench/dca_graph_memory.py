"""What DCA's CUDA graphs keep on the GPU (models/attention/dca/graphs.py): memory allocated and
reserved by the first graphed call of each shape (buffers, outputs, the graphs' pools).

    python -m bench.dca_graph_memory --seqs 8192,32768 --kv-heads 16,4 --chunk 2048 --local 256
"""

from __future__ import annotations

import argparse

import torch

from models.attention.dca import graphs as dca_graphs
from models.attention.dca.attention import dual_chunk_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="8192,32768")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", default="16,4")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--local", type=int, default=256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.dca_graph_memory needs a CUDA device")
    print("| seq | heads q/kv | allocated MiB (x q) | reserved MiB (x q) |")
    print("| --- | --- | --- | --- |")
    for seq in (int(s) for s in args.seqs.split(",")):
        for kv in (int(h) for h in args.kv_heads.split(",")):
            q, k, v = (torch.randn(1, seq, h, args.head_dim, device="cuda", dtype=torch.bfloat16)
                       for h in (args.heads, kv, kv))
            torch.cuda.synchronize()
            allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            dual_chunk_attention(q, k, v, chunk_size=args.chunk, local_size=args.local,
                                 cuda_graphs=True)  # captures; its output is dropped at once
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated() - allocated
            reserved = torch.cuda.memory_reserved() - reserved
            print(f"| {seq} | {args.heads}/{kv} | {allocated / 2**20:.0f} "
                  f"({allocated / q.nbytes:.1f}) | {reserved / 2**20:.0f} "
                  f"({reserved / q.nbytes:.1f}) |", flush=True)
            dca_graphs.release()
            del q, k, v
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
