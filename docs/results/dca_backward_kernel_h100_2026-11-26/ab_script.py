"""Scratch: DCA one-call backward, FA4 block-sparse vs the DCA kernel (temporary)."""
import argparse, json, os, statistics, sys
import torch
from bench import attention as A
from models.attention import kernels
from models.attention.dca import grouped

args = argparse.Namespace(warmup=3, repeats=10, back_to_back=int(os.environ.get("B2B", "20")))
rows = []
def run(variant, seq, hk, flag=None):
    if flag is not None:
        grouped.BACKWARD_KERNEL = flag
    r = A.measure(variant, seq, 16, hk, 128, args)
    r["bwd_kernel"] = flag
    rows.append(r)
    print(f"{seq} {hk} {r['variant']:36s} kernel_bwd={flag} fwd {r['fwd_ms']:.3f} fwdbwd {r['fwd_bwd_ms']:.3f} host {r['fwd_bwd_host_ms']:.2f} peak {r['peak_mib']:.0f}", flush=True)

cases = [(8192, 2048, 256), (16384, 2048, 256), (16384, 8192, 1024), (32768, 8192, 1024)]
for seq, c, w in cases:
    for hk in (16, 4):
        if seq == 32768: args.back_to_back = 1
        run(A.sdpa("cudnn"), seq, hk)
        run(A.fa4(), seq, hk)
        for flag in (False, True, False, True):
            run(A.dca(c, w, "dca_fa4_one_call", kernel="fa4", one_call=True), seq, hk, flag)
        run(A.dca(c, w, "dca_fa4_parts", kernel="fa4", one_call=False), seq, hk)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "bwd.json"), "w"), indent=1)
