"""DCA (C = 8192, w = 1024) against FA4 causal, its backward kernel adding every part's dQ into
one accumulator in the inter frame (DCAPlan.dq_frame, as on this tree) or into one accumulator
per part (dq_frame None, as before), each under its own `auto` cut. Each sample: FA4 causal,
then both forms, on the same inputs, synchronised single calls and 5 back to back; the ratio
is FA4 causal's time over DCA's, median (min - max). Peak memory of one fwd+bwd; then a
profile of one fwd+bwd of each form.

    python3 docs/results/dca_frame_2026-11-27/frame.py [--seqs 32768,131072] [--kv-heads 16,4]

Run at 4ba59d7, the commit with the frame (DCAPlan.dq_frame); the next one removed it again
(its kernel was 35% slower), so this script runs only on that tree.
"""

import argparse

import torch

from bench.attention import dca, fa4, fwd_bwd_step, inputs, profile
from bench.timing import patched, print_pairs
from models.attention.dca import plan

parser = argparse.ArgumentParser()
parser.add_argument("--seqs", default="32768,131072")
parser.add_argument("--kv-heads", default="16,4")
parser.add_argument("--repeats", type=int, default=10)
parser.add_argument("--back-to-back", default="1,5")
parser.add_argument("--profile-seq", type=int, default=32768)
args = parser.parse_args()
with_frame = plan.DCAPlan.__init__


def without_frame(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
    with_frame(self, *args, **kwargs)
    self.dq_frame = None


def form(step, framed: bool):  # noqa: ANN001, ANN202
    return patched(step, plan.DCAPlan, "__init__", with_frame if framed else without_frame)


print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
variant = dca(8192, 1024, kernel="fa4")
for seq in (int(s) for s in args.seqs.split(",")):
    for kv in (int(x) for x in args.kv_heads.split(",")):
        problem = inputs(seq, 16, kv, 128)
        base = form(fwd_bwd_step(fa4(), problem), True)
        forms = {f"dQ {name}": form(fwd_bwd_step(variant, problem), name == "frame")
                 for name in ("frame", "parts")}
        print_pairs(base, forms, args.repeats, [int(x) for x in args.back_to_back.split(",")],
                    f"{seq} 16/{kv}")
        del problem, base, forms
        torch.cuda.empty_cache()
for framed in (True, False):
    plan.DCAPlan.__init__ = with_frame if framed else without_frame
    print(f"\nprofile, dQ {'frame' if framed else 'parts'}:\n"
          + profile(variant, args.profile_seq, 16, 16, 128), flush=True)
plan.DCAPlan.__init__ = with_frame
