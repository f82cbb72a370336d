"""Launch settings of dq_parts' rotate_back kernel (Triton only; no FA4 needed).

    PYTHONPATH=$PWD python3 docs/results/dca_passes_2026-11-27/rotate_back_sweep.py

One piece of DCA's backward at 32K (16 heads of 128, 3 parts): the kernel with each
(num_warps, num_stages), median of 30 timed calls after 5, bytes moved over time, and the
largest difference to the shipped setting's output (all must be 0)."""
import statistics

import torch

from models.attention.dca import dq_parts
from models.attention.dca.plan import _tables

torch.manual_seed(0)
dev = "cuda"
print(torch.cuda.get_device_name(), torch.__version__)
for rows in (32768, 6656):
    parts, batch, heads, dim = 3, 1, 16, 128
    data = torch.randn(parts * batch, heads, rows * dim, device=dev)
    positions = torch.randint(0, 8193, (parts, rows), device=dev, dtype=torch.int32)
    cos, sin = _tables(8193, dim, 10000.0, 1.0, torch.float32, torch.device(dev))
    out = torch.empty(batch, rows, heads, dim, device=dev, dtype=torch.bfloat16)
    ref = torch.empty_like(out)
    half = dim // 2

    def launch(o, warps, stages):
        dq_parts._rotate_back_kernel[(rows // 64, heads, batch)](
            data, positions, cos, sin, cos, o, batch, data.stride(0), data.stride(1),
            positions.stride(0), cos.stride(0), 0, o.stride(0), o.stride(1), o.stride(2),
            0.088, PARTS=parts, DIM=dim, HALF=half, COL8=8, FACTORS=False,
            num_warps=warps, num_stages=stages)

    launch(ref, 8, 3)  # Triton's default num_stages is 3
    moved = data.numel() * 4 + out.numel() * 2
    print(f"\nrows {rows}: {moved / 1e6:.0f} MB moved (parts' dQ read, dq written)")
    for warps in (2, 4, 8, 16):
        for stages in (1, 2, 3, 4):
            launch(out, warps, stages)
            diff = (out.float() - ref.float()).abs().max().item()
            for _ in range(5):
                launch(out, warps, stages)
            times = []
            for _ in range(30):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                launch(out, warps, stages)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            ms = statistics.median(times)
            print(f"num_warps {warps:2d} num_stages {stages}: {ms * 1e3:7.1f} us "
                  f"{moved / ms / 1e9:5.2f} TB/s  max diff {diff}")
