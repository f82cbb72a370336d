"""What a piece of DCA's backward costs: the backward kernel alone (fa4_backward.backward, as
grouped.backward calls it: the queries in even pieces, the last first, each with the keys up
to its end), at 32K MHA (16 heads of 128, bf16, L = 7168, three parts), in 1 to 8 pieces.
Each configuration profiled 5 times, interleaved; the median of the main kernels' GPU time
summed over the pieces, against the CTAs launched (a CTA per 128-row key block and head, per
piece) and the (query, key) tile pairs computed (the same in every configuration).

    python3 docs/results/dca_passes_2026-11-27/pieces_kernel.py
"""

import statistics

import torch
from flash_attn.cute import interface as fa

from models.attention.dca import fa4_backward

seq, heads, dim, length, parts = 32768, 16, 128, 7168, 3
scale = dim ** -0.5
torch.manual_seed(0)
q, k, v, dout = (torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
                 for _ in range(4))
out, lse = fa._flash_attn_fwd(q, k, v, causal=True, return_lse=True)[:2]
q_rot = torch.cat([q] * parts)  # [p * b, s, h, d]: the parts' copies (values alike here)
dk, dv = torch.empty_like(k), torch.empty_like(v)


def pieces(count: int):  # noqa: ANN201
    size = -(-seq // count // 128) * 128
    spans = [(max(end - size, 0), end) for end in range(seq, 0, -size)]

    def call() -> None:
        for start, end in spans:
            fa4_backward.backward(q_rot[:, start:end], k[:, :end], v[:, :end],
                                  out[:, start:end], dout[:, start:end], lse[:, :, start:end],
                                  scale, length, dk[:, :end], dv[:, :end], end < seq)
    ctas = sum(end // 128 * heads for _, end in spans)
    return call, ctas


configs = {n: pieces(n) for n in (1, 2, 3, 4, 5, 8)}
for fn, _ in configs.values():
    fn()
times: dict[int, list[float]] = {n: [] for n in configs}
for _ in range(5):
    for n, (fn, _) in configs.items():
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        times[n].append(sum(e.device_time_total for e in prof.key_averages()
                            if "fa4_backward" in e.key) / 1e3)
print(torch.cuda.get_device_name(), "torch", torch.__version__)
one = statistics.median(times[1])
for n, (_, ctas) in configs.items():
    t = statistics.median(times[n])
    extra = ctas - configs[1][1]
    per_cta = f", {1e3 * (t - one) / extra:.2f} us per extra CTA" if extra else ""
    print(f"{n} pieces: kernel {t:.2f} ms (min {min(times[n]):.2f}), {ctas} CTAs, "
          f"+{t - one:.2f} ms over one piece{per_cta}")
