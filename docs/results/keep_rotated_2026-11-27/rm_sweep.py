"""rotate_multi variants at 32K (16 heads of 128, DCA's 3 parts: tokens a program, warps,
unrolled or not, evict-first loads with streaming stores) and rotate_back's best of rb_sweep.py
at more head counts and warps. The shipped kernels are timed first (a bias: see pass_ab.py)."""
import json
import os

import torch
import triton
import triton.language as tl

from models.attention.dca.plan import DCAPlan, KernelPaths
from models.attention.dca.scaling import DCAScaling
from models.attention.rope import rotate_multi
from rb_sweep import timed, variant


@triton.jit
def _rm_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, S, H, sxb, sxs, sxh, son, sob, sos,
               soh, spn, stab, NUM_OUT: tl.constexpr, HALF: tl.constexpr,
               BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
               UNROLL: tl.constexpr, EVICT: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    tok = (tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    head = tl.arange(0, BLOCK_H)
    dim = tl.arange(0, BLOCK_D)
    tok_ok = tok < S
    mask = tok_ok[:, None, None] & (head < H)[None, :, None] & (dim < HALF)[None, None, :]
    x_off = b * sxb + tok[:, None, None] * sxs + head[None, :, None] * sxh + dim[None, None, :]
    if EVICT:
        x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0, eviction_policy="evict_first")
        x2 = tl.load(x_ptr + x_off + HALF, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0)
        x2 = tl.load(x_ptr + x_off + HALF, mask=mask, other=0.0)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    o_off = b * sob + tok[:, None, None] * sos + head[None, :, None] * soh + dim[None, None, :]
    tab_mask = tok_ok[:, None] & (dim < HALF)[None, :]
    if UNROLL:
        for i in tl.static_range(NUM_OUT):
            pos = tl.load(pos_ptr + i * spn + tok, mask=tok_ok, other=-1).to(tl.int64)
            needed = pos >= 0
            t_off = pos[:, None] * stab + dim[None, :]
            t_mask = tab_mask & needed[:, None]
            c = tl.load(cos_ptr + t_off, mask=t_mask, other=0.0)[:, None, :]
            sn = tl.load(sin_ptr + t_off, mask=t_mask, other=0.0)[:, None, :]
            o_mask = mask & needed[:, None, None]
            tl.store(out_ptr + i * son + o_off, (x1 * c - x2 * sn).to(out_ptr.dtype.element_ty),
                     mask=o_mask, cache_modifier=".cs" if EVICT else "")
            tl.store(out_ptr + i * son + o_off + HALF,
                     (x2 * c + x1 * sn).to(out_ptr.dtype.element_ty), mask=o_mask,
                     cache_modifier=".cs" if EVICT else "")
    else:
        for i in tl.range(NUM_OUT, num_stages=1):
            pos = tl.load(pos_ptr + i * spn + tok, mask=tok_ok, other=-1).to(tl.int64)
            needed = pos >= 0
            t_off = pos[:, None] * stab + dim[None, :]
            t_mask = tab_mask & needed[:, None]
            c = tl.load(cos_ptr + t_off, mask=t_mask, other=0.0)[:, None, :]
            sn = tl.load(sin_ptr + t_off, mask=t_mask, other=0.0)[:, None, :]
            o_mask = mask & needed[:, None, None]
            tl.store(out_ptr + i * son + o_off, (x1 * c - x2 * sn).to(out_ptr.dtype.element_ty),
                     mask=o_mask)
            tl.store(out_ptr + i * son + o_off + HALF,
                     (x2 * c + x1 * sn).to(out_ptr.dtype.element_ty), mask=o_mask)


def rm_variant(block_s, block_h, warps, unroll, evict):
    def run(x, positions, cos, sin, out):
        b, s, h, d = x.shape
        grid = (triton.cdiv(s, block_s), b)
        if block_h < h:  # heads in programs of block_h: a third grid axis folded into tokens
            raise ValueError("block_h < h unsupported")
        _rm_kernel[grid](x, out, positions, cos, sin, s, h, x.stride(0), x.stride(1),
                         x.stride(2), out.stride(0), out.stride(1), out.stride(2),
                         out.stride(3), positions.stride(0), cos.stride(0), NUM_OUT=positions.shape[0],
                         HALF=d // 2, BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_D=d // 2,
                         UNROLL=unroll, EVICT=evict, num_warps=warps)
    return run


def main():
    torch.manual_seed(0)
    seq, heads, dim = 32768, 16, 128
    results = {}
    q = torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
    plan = DCAPlan(q, 8192, 1024, 10000.0, 1.0, None, DCAScaling(), None,
                   KernelPaths(kernels=True))
    pos = plan.part_positions.to(torch.int32).contiguous()
    ref = rotate_multi(q, pos, plan.cos, plan.sin)
    held = (pos >= 0).float().mean(1).sum().item()
    moved = q.numel() * 2 * (1 + held)
    results["rm_shipped"] = timed(lambda: rotate_multi(q, pos, plan.cos, plan.sin))
    out = torch.empty_like(ref)
    for bs in (1, 2, 4, 8):
        for warps in (4, 8):
            for unroll in (True, False):
                for evict in (False, True):
                    if evict and not unroll:
                        continue
                    name = f"rm_s{bs}_w{warps}_u{int(unroll)}_e{int(evict)}"
                    fn = rm_variant(bs, 16, warps, unroll, evict)
                    try:
                        fn(q, pos, plan.cos, plan.sin, out)
                        used = pos[1] >= 0
                        assert torch.equal(out[1][:, used], ref[1][:, used])
                        assert torch.equal(out[0], ref[0]) and torch.equal(out[2], ref[2])
                        results[name] = timed(lambda: fn(q, pos, plan.cos, plan.sin, out))
                    except Exception as err:  # noqa: BLE001
                        results[name] = f"error: {str(err)[:300]}"
    base = results["rm_shipped"]
    for k, v in results.items():
        if isinstance(v, float):
            print(f"{k:28s} {v * 1000:8.1f} us  {moved / v / 1e9:6.2f} TB/s  {base / v:5.2f}x")
        else:
            print(k, v)
    # rotate_back: the best of the first sweep at more head loops and warps
    from models.attention.dca.dq_parts import DQParts, rotate_back
    data = torch.randn(3, heads, seq * dim, device="cuda")
    dq = DQParts(data, "fa4_sm90")
    ref_b = torch.empty(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
    rotate_back(dq, pos, plan.cos, plan.sin, None, 0.1, ref_b)
    rb = {"rb_shipped": timed(lambda: rotate_back(dq, pos, plan.cos, plan.sin, None, 0.1,
                                                   ref_b))}
    for hp in (1, 2, 4, 8, 16):
        for warps in (2, 4, 8):
            fn = variant(hp, 1, True, warps)
            o = torch.empty_like(ref_b)
            fn(dq, pos, plan.cos, plan.sin, 0.1, o)
            assert (o.float() - ref_b.float()).abs().max().item() <= 1e-2
            rb[f"rb_h{hp}_w{warps}_evict"] = timed(lambda: fn(dq, pos, plan.cos, plan.sin, 0.1, o))
    for k, v in rb.items():
        print(f"{k:28s} {v * 1000:8.1f} us  {rb['rb_shipped'] / v:5.2f}x")
    results.update(rb)
    json.dump(results, open(f"{os.environ.get('OUT', '.')}/rm_sweep.json", "w"), indent=1)


if __name__ == "__main__":
    main()
