"""Where the host's time goes in one DCA fwd+bwd at 8K (C = 2048, w = 256, 16/16 heads, FA4):
cProfile over 50 calls issued back to back (the GPU runs behind; one synchronisation at the
end), FA4 causal's beside it.

    python3 docs/results/dca_heads_2026-11-27/host_8k.py
"""

import cProfile
import pstats
import time

import torch

from bench.attention import dca, fa4, fwd_bwd_step, inputs
from models.attention import kernels

problem = inputs(8192, 16, 16, 128)
with kernels.using("fa4"):
    for name, variant in (("fa4 causal", fa4()), ("dca", dca(2048, 256, kernel="fa4"))):
        step = fwd_bwd_step(variant, problem)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            step()
        issued = (time.perf_counter() - start) / 50 * 1e3
        torch.cuda.synchronize()
        done = (time.perf_counter() - start) / 50 * 1e3
        print(f"{name}: host issues a call in {issued:.3f} ms; {done:.3f} ms a call in all")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(50):
            step()
        profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
