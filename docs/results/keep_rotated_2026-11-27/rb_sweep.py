"""rotate_back variants at 32K (16 heads of 128, 3 parts, successive rows shared): heads a
program, pipeline stages, evict-first loads, warps; a copy and a fill for scale; the successive
accumulator's zeroing three ways. Run from the repository root with PYTHONPATH=$PWD (eleventh
session, docs/benchmarks.md). The shipped kernel is timed first (a bias: see pass_ab.py)."""
import json
import os
import sys

import torch
import triton
import triton.language as tl

from models.attention.dca import fa4_backward
from models.attention.dca.dq_parts import DQParts, rotate_back
from models.attention.dca.plan import DCAPlan, KernelPaths
from models.attention.dca.scaling import DCAScaling


@triton.jit
def _rb_kernel(data_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, B, s_data_bp, s_data_h, s_pos,
               s_tab, s_out_b, s_out_s, s_out_h, scale, PARTS: tl.constexpr, DIM: tl.constexpr,
               HALF: tl.constexpr, COL8: tl.constexpr, HEADS: tl.constexpr,
               STAGES: tl.constexpr, EVICT: tl.constexpr):
    group = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1).to(tl.int64) * HEADS
    b = tl.program_id(2).to(tl.int64)
    row = group * 64 + tl.arange(0, 64)
    c = tl.arange(0, COL8 * 8)
    ok = (c < HALF)[None, :]
    for hh in tl.static_range(HEADS):
        head = head0 + hh
        acc1 = tl.zeros((64, COL8 * 8), dtype=tl.float32)
        acc2 = tl.zeros((64, COL8 * 8), dtype=tl.float32)
        for p in tl.range(PARTS, num_stages=STAGES):
            pos = tl.load(pos_ptr + p * s_pos + row).to(tl.int64)
            used = pos >= 0
            read = tl.max(used.to(tl.int32), axis=0) > 0
            base = data_ptr + (p * B + b) * s_data_bp + head * s_data_h + group * (64 * DIM)
            j = tl.arange(0, COL8 * 512)
            m = (j < HALF * 64) & read
            if EVICT:
                x1 = tl.load(base + j, mask=m, other=0.0, eviction_policy="evict_first")
                x2 = tl.load(base + HALF * 64 + j, mask=m, other=0.0,
                             eviction_policy="evict_first")
            else:
                x1 = tl.load(base + j, mask=m, other=0.0)
                x2 = tl.load(base + HALF * 64 + j, mask=m, other=0.0)
            x1 = tl.reshape(tl.permute(tl.reshape(x1, (COL8, 4, 8, 4, 2, 2)), (1, 4, 2, 0, 3, 5)),
                            (64, COL8 * 8))
            x2 = tl.reshape(tl.permute(tl.reshape(x2, (COL8, 4, 8, 4, 2, 2)), (1, 4, 2, 0, 3, 5)),
                            (64, COL8 * 8))
            g1 = tl.where(used[:, None], x1, 0.0)
            g2 = tl.where(used[:, None], x2, 0.0)
            tab = pos[:, None] * s_tab + c[None, :]
            cos = tl.load(cos_ptr + tab, mask=ok & used[:, None], other=0.0)
            sin = tl.load(sin_ptr + tab, mask=ok & used[:, None], other=0.0)
            acc1 += g1 * cos + g2 * sin
            acc2 += g2 * cos - g1 * sin
        o_off = b * s_out_b + row[:, None] * s_out_s + head * s_out_h + c[None, :]
        tl.store(out_ptr + o_off, (acc1 * scale).to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(out_ptr + o_off + HALF, (acc2 * scale).to(out_ptr.dtype.element_ty), mask=ok)


def variant(heads_per, stages, evict, warps):
    def run(dq_parts, positions, cos, sin, scale, out):
        parts = positions.shape[0]
        batch, rows, heads, dim = out.shape
        _rb_kernel[(rows // 64, heads // heads_per, batch)](
            dq_parts.data, positions, cos, sin, out, batch, dq_parts.data.stride(0),
            dq_parts.data.stride(1), positions.stride(0), cos.stride(0), out.stride(0),
            out.stride(1), out.stride(2), scale, PARTS=parts, DIM=dim, HALF=dim // 2,
            COL8=triton.next_power_of_2(dim // 16), HEADS=heads_per, STAGES=stages,
            EVICT=evict, num_warps=warps)
    return run


def timed(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    torch.manual_seed(0)
    seq, heads, dim = 32768, 16, 128
    q = torch.empty(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
    plan = DCAPlan(q, 8192, 1024, 10000.0, 1.0, None, DCAScaling(), None,
                   KernelPaths(kernels=True))
    positions = plan.part_positions.contiguous()
    data = torch.randn(3, heads, seq * dim, device="cuda")
    dq = DQParts(data, "fa4_sm90")
    ref = torch.empty(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
    rotate_back(dq, positions, plan.cos, plan.sin, None, 0.1, ref)
    held = (positions >= 0).float().mean(1).sum().item()  # parts' rows read
    moved = held * heads * seq * dim * 4 + ref.numel() * 2
    results = {"shipped": timed(lambda: rotate_back(dq, positions, plan.cos, plan.sin, None,
                                                     0.1, ref))}
    for hp in (1, 2, 4):
        for stages in (1, 2, 3):
            for evict in (False, True):
                for warps in (4, 8):
                    out = torch.empty_like(ref)
                    fn = variant(hp, stages, evict, warps)
                    name = f"h{hp}_s{stages}_e{int(evict)}_w{warps}"
                    try:
                        fn(dq, positions, plan.cos, plan.sin, 0.1, out)
                        diff = (out.float() - ref.float()).abs().max().item()
                        if diff > 1e-2:
                            raise AssertionError(f"differs by {diff}")
                        results[name] = timed(lambda: fn(dq, positions, plan.cos, plan.sin,
                                                         0.1, out))
                    except Exception as err:  # noqa: BLE001
                        results[name] = f"error: {str(err)[:200]}"
    x = torch.empty(3 * heads * seq * dim, device="cuda")
    y = torch.empty_like(x)
    results["copy_fp32_805MB"] = timed(lambda: y.copy_(x))
    results["zero_fp32_805MB"] = timed(lambda: y.zero_())
    # the successive part's zeroing: index_fill_ vs per-chunk slices
    acc = torch.empty(3, 1, heads, seq * dim, device="cuda")
    idx = fa4_backward._successive_groups(seq, seq, plan.length, plan.successive_rows,
                                          q.device)
    groups = acc[1].view(1, heads, seq // 64, 64 * dim)
    results["index_fill"] = timed(lambda: groups.index_fill_(2, idx, 0))
    starts = list(range(0, seq, plan.length))
    sub = plan.successive_rows * dim

    def sliced():
        flat = acc[1]
        for s0 in starts:
            flat[..., s0 * dim:min(s0 * dim + sub, seq * dim)].zero_()
    results["slices_fill"] = timed(sliced)
    chunks = seq // plan.length
    strided = acc[1].as_strided((1, heads, chunks, sub), (heads * seq * dim, seq * dim,
                                                          plan.length * dim, 1))
    results["strided_fill_full_chunks"] = timed(lambda: strided.zero_())
    out = os.environ.get("OUT", ".")
    json.dump({**results, "bytes_rotate_back": moved}, open(f"{out}/rb_sweep.json", "w"),
              indent=1)
    base = results["shipped"]
    for k, v in results.items():  # TB/s: rotate_back's bytes, meaningful for its rows only
        if isinstance(v, float):
            print(f"{k:28s} {v * 1000:8.1f} us  {moved / v / 1e9:6.2f} TB/s  {base / v:5.2f}x")
        else:
            print(k, v)


if __name__ == "__main__":
    sys.exit(main())
