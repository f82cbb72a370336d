"""Launch settings of DCA's two Triton passes at 32K (16 heads of 128, bf16, positions as
DCAPlan's with C = 8192, w = 1024): rotate_multi (every part's q, the successive rows shared)
by tokens per program and warps, and rotate_back (three float32 dQ accumulators into dq) by
warps. Medians of 20 timed launches (CUDA events), and the bandwidth they reach.

    python3 docs/results/dca_shared_2026-11-27/pass_tuning.py
"""

import statistics

import torch
import triton

from models.attention import rope
from models.attention.dca import dq_parts
from models.attention.dca.plan import DCAPlan, KernelPaths
from models.attention.dca.scaling import DCAScaling


def median_ms(fn) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


seq, heads, dim = 32768, 16, 128
q = torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
plan = DCAPlan(q, 8192, 1024, 10000.0, 1.0, None, DCAScaling(), paths=KernelPaths(True))
pos = plan.part_positions.contiguous()
used = (pos >= 0).sum().item() / seq  # rows written, in q's
out = torch.empty(3, 1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
print(f"rotate_multi: q [1, {seq}, {heads}, {dim}] into {used:.2f} copies")
for block_s in (4, 8, 16, 32):
    for warps in (4, 8, 16):
        def launch(block_s=block_s, warps=warps) -> None:  # noqa: ANN001
            rope._rotate_multi_kernel[(triton.cdiv(seq, block_s), 1)](
                q, out, pos, plan.cos, plan.sin, seq, heads, q.stride(0), q.stride(1),
                q.stride(2), out.stride(0), out.stride(1), out.stride(2), out.stride(3),
                pos.stride(0), plan.cos.stride(0), NUM_OUT=3, HALF=dim // 2, BLOCK_S=block_s,
                BLOCK_H=heads, BLOCK_D=dim // 2, num_warps=warps)
        ms = median_ms(launch)
        moved = q.numel() * 2 * (1 + used)
        print(f"  BLOCK_S {block_s:2d} warps {warps:2d}: {ms * 1e3:6.1f} us, "
              f"{moved / ms / 1e9:.2f} TB/s{'  (now)' if (block_s, warps) == (4, 8) else ''}")

data = torch.randn(3, heads, seq * dim, device="cuda")
dq = torch.empty(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
read = data[0].numel() * 4 * used + dq.numel() * 2
print(f"rotate_back: 3 float32 accumulators ({used:.2f} read) into dq")
for warps in (2, 4, 8, 16):
    def back(warps=warps) -> None:  # noqa: ANN001
        dq_parts._rotate_back_kernel[(seq // 64, heads, 1)](
            data, pos, plan.cos, plan.sin, plan.cos, dq, 1, data.stride(0), data.stride(1),
            pos.stride(0), plan.cos.stride(0), 0, dq.stride(0), dq.stride(1), dq.stride(2),
            0.1, PARTS=3, DIM=dim, HALF=dim // 2, COL8=triton.next_power_of_2(dim // 16),
            FACTORS=False, num_warps=warps)
    ms = median_ms(back)
    print(f"  warps {warps:2d}: {ms * 1e3:6.1f} us, {read / ms / 1e9:.2f} TB/s"
          f"{'  (now)' if warps == 4 else ''}")
