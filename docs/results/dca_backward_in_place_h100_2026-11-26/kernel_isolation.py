"""DCA's backward kernel alone against FA4's causal backward kernel, at 32K MHA (16 heads,
head dim 128, bf16): each call profiled 5 times, the mean GPU time of its main kernel (the
pre/postprocess and accumulator zeroing left out) and of the whole call. DCA's kernel as DCA
(L = 7168, three parts, its q_rot three rotated copies) and as plain causal attention (L =
32768: one chunk, one part), so the subclass's cost and the parts' cost show apart.

    python3 docs/results/dca_backward_in_place_h100_2026-11-26/kernel_isolation.py
"""

import statistics

import torch
from flash_attn.cute import interface as fa

from models.attention.dca import fa4_backward

seq, heads, dim = 32768, 16, 128
scale = dim ** -0.5
torch.manual_seed(0)
q, k, v, dout = (torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
                 for _ in range(4))
out, lse = fa._flash_attn_fwd(q, k, v, causal=True, return_lse=True)[:2]
dk, dv = torch.empty_like(k), torch.empty_like(v)


def causal() -> None:
    fa._flash_attn_bwd(q, k, v, out, dout, lse, causal=True)


def dca(parts: int, length: int):  # noqa: ANN201
    q_rot = torch.cat([q] * parts)

    def call() -> None:
        fa4_backward.backward(q_rot, k, v, out, dout, lse, scale, length, dk, dv, False)
    return call


calls = {"fa4 causal": causal, "dca kernel, L=32768 (1 part)": dca(1, 32768),
         "dca kernel, L=7168 (3 parts)": dca(3, 7168)}
for fn in calls.values():
    fn()
results: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
for _ in range(5):
    for name, fn in calls.items():
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [(e.key, e.device_time_total) for e in prof.key_averages()
                   if e.device_time_total > 0 and e.self_device_time_total > 0]
        main = max(t for _, t in kernels)
        results[name].append((main / 1e3, sum(t for _, t in kernels) / 1e3))
for name, samples in results.items():
    print(f"{name}: main kernel {statistics.median(m for m, _ in samples):.2f} ms, "
          f"all kernels {statistics.median(a for _, a in samples):.2f} ms")
