"""Which feature of the changed rotate_back (head masks, grouped output, the load helper) and
rotate_multi (grouped head addressing, tokens, warps) costs time (ran on an H200)."""
import itertools
import os
import json

import torch
import triton
import triton.language as tl

from models.attention import rope
from models.attention.dca import dq_parts
from models.attention.dca.dq_parts import _fa4_sm90_half
from models.attention.dca.plan import DCAPlan, KernelPaths
from models.attention.dca.scaling import DCAScaling
from rb_sweep import timed


@triton.jit
def _rb(data_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, B, H, PER_GROUP, s_data_bp, s_data_h,
        s_pos, s_tab, s_out_b, s_out_s, s_out_g, s_out_h, scale, PARTS: tl.constexpr,
        DIM: tl.constexpr, HALF: tl.constexpr, COL8: tl.constexpr, HEADS: tl.constexpr,
        GROUPED: tl.constexpr, MASK_H: tl.constexpr, HELPER: tl.constexpr,
        PG: tl.constexpr):
    group = tl.program_id(0).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    row = group * 64 + tl.arange(0, 64)
    c = tl.arange(0, COL8 * 8)
    ok = (c < HALF)[None, :]
    for i in tl.static_range(HEADS):
        head = tl.program_id(1).to(tl.int64) * HEADS + i
        if MASK_H:
            head_ok = head < H
        else:
            head_ok = head >= 0
        acc1 = tl.zeros((64, COL8 * 8), dtype=tl.float32)
        acc2 = tl.zeros((64, COL8 * 8), dtype=tl.float32)
        for p in tl.range(PARTS, num_stages=1):
            pos = tl.load(pos_ptr + p * s_pos + row).to(tl.int64)
            used = pos >= 0
            if MASK_H:
                read = (tl.max(used.to(tl.int32), axis=0) > 0) & head_ok
            else:
                read = tl.max(used.to(tl.int32), axis=0) > 0
            base = data_ptr + (p * B + b) * s_data_bp + head * s_data_h + group * (64 * DIM)
            if HELPER:
                x1 = _fa4_sm90_half(base, read, COL8, HALF)
                x2 = _fa4_sm90_half(base + HALF * 64, read, COL8, HALF)
            else:
                j = tl.arange(0, COL8 * 512)
                m = (j < HALF * 64) & read
                x1 = tl.load(base + j, mask=m, other=0.0, eviction_policy="evict_first")
                x2 = tl.load(base + HALF * 64 + j, mask=m, other=0.0,
                             eviction_policy="evict_first")
                x1 = tl.reshape(tl.permute(tl.reshape(x1, (COL8, 4, 8, 4, 2, 2)),
                                           (1, 4, 2, 0, 3, 5)), (64, COL8 * 8))
                x2 = tl.reshape(tl.permute(tl.reshape(x2, (COL8, 4, 8, 4, 2, 2)),
                                           (1, 4, 2, 0, 3, 5)), (64, COL8 * 8))
            g1 = tl.where(used[:, None], x1, 0.0)
            g2 = tl.where(used[:, None], x2, 0.0)
            tab = pos[:, None] * s_tab + c[None, :]
            cos = tl.load(cos_ptr + tab, mask=ok & used[:, None], other=0.0)
            sin = tl.load(sin_ptr + tab, mask=ok & used[:, None], other=0.0)
            acc1 += g1 * cos + g2 * sin
            acc2 += g2 * cos - g1 * sin
        if GROUPED:
            if PG > 0:
                o_head = (head // PG) * s_out_g + (head % PG) * s_out_h
            else:
                o_head = (head // PER_GROUP) * s_out_g + (head % PER_GROUP) * s_out_h
        else:
            o_head = head * s_out_h
        o_off = b * s_out_b + row[:, None] * s_out_s + o_head + c[None, :]
        if MASK_H:
            o_mask = ok & head_ok
        else:
            o_mask = ok
        tl.store(out_ptr + o_off, (acc1 * scale).to(out_ptr.dtype.element_ty), mask=o_mask)
        tl.store(out_ptr + o_off + HALF, (acc2 * scale).to(out_ptr.dtype.element_ty),
                 mask=o_mask)


@triton.jit
def _rm(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, S, H, PER_GROUP, sxb, sxs, sxg, sxh, son,
        sob, sos, soh, spn, stab, NUM_OUT: tl.constexpr, HALF: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        MODE: tl.constexpr, PG: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    tok = (tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    head = tl.arange(0, BLOCK_H)
    dim = tl.arange(0, BLOCK_D)
    tok_ok = tok < S
    mask = tok_ok[:, None, None] & (head < H)[None, :, None] & (dim < HALF)[None, None, :]
    if MODE == 0:
        x_head = (head // PER_GROUP) * sxg + (head % PER_GROUP) * sxh
    elif MODE == 1:
        x_head = (head // PG) * sxg + (head % PG) * sxh
    else:
        x_head = head * sxh
    x_off = b * sxb + tok[:, None, None] * sxs + x_head[None, :, None] + dim[None, None, :]
    x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    x2 = tl.load(x_ptr + x_off + HALF, mask=mask, other=0.0,
                 eviction_policy="evict_first").to(tl.float32)
    o_off = b * sob + tok[:, None, None] * sos + head[None, :, None] * soh + dim[None, None, :]
    tab_mask = tok_ok[:, None] & (dim < HALF)[None, :]
    for i in tl.static_range(NUM_OUT):
        pos = tl.load(pos_ptr + i * spn + tok, mask=tok_ok, other=-1).to(tl.int64)
        needed = pos >= 0
        t_off = pos[:, None] * stab + dim[None, :]
        t_mask = tab_mask & needed[:, None]
        c = tl.load(cos_ptr + t_off, mask=t_mask, other=0.0)[:, None, :]
        sn = tl.load(sin_ptr + t_off, mask=t_mask, other=0.0)[:, None, :]
        o_mask = mask & needed[:, None, None]
        tl.store(out_ptr + i * son + o_off, (x1 * c - x2 * sn).to(out_ptr.dtype.element_ty),
                 mask=o_mask, cache_modifier=".cs")
        tl.store(out_ptr + i * son + o_off + HALF,
                 (x2 * c + x1 * sn).to(out_ptr.dtype.element_ty), mask=o_mask,
                 cache_modifier=".cs")


def main():
    torch.manual_seed(0)
    seq, heads, dim = 32768, 16, 128
    q = torch.empty(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
    plan = DCAPlan(q, 8192, 1024, 10000.0, 1.0, None, DCAScaling(), None,
                   KernelPaths(kernels=True))
    pos = plan.part_positions.to(torch.int32).contiguous()
    data = torch.randn(3, heads, seq * dim, device="cuda")
    dq = dq_parts.DQParts(data, "fa4_sm90")
    ref = torch.empty(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
    res = {"shipped": timed(lambda: dq_parts.rotate_back(dq, pos, plan.cos, plan.sin, None,
                                                          0.1, ref))}
    out = torch.empty_like(ref)
    for grouped, mask_h, helper, pg in itertools.product((0, 1), (0, 1), (0, 1), (0, 16)):
        if pg and not grouped:
            continue
        for warps in (4, 8):
            name = f"g{grouped}_m{mask_h}_h{helper}_pg{pg}_w{warps}"

            def fn(grouped=grouped, mask_h=mask_h, helper=helper, pg=pg, warps=warps):
                _rb[(seq // 64, heads // 4, 1)](
                    data, pos, plan.cos, plan.sin, out, 1, heads, heads, data.stride(0),
                    data.stride(1), pos.stride(0), plan.cos.stride(0), out.stride(0),
                    out.stride(1), 0, out.stride(2), 0.1, PARTS=3, DIM=dim, HALF=dim // 2,
                    COL8=8, HEADS=4, GROUPED=grouped, MASK_H=mask_h, HELPER=helper, PG=pg,
                    num_warps=warps)
            fn()
            assert torch.equal(out, ref), name
            res[name] = timed(fn)
    # rotate_multi: shipped vs PER_GROUP as a constant
    x = torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
    res["multi shipped"] = timed(lambda: rope.rotate_multi(x, pos, plan.cos, plan.sin))
    want = rope.rotate_multi(x, pos, plan.cos, plan.sin)
    o = torch.empty_like(want)
    for mode in (0, 1, 2):
        for bs, warps in ((1, 4), (2, 4), (2, 8), (4, 8)):
            def fm(mode=mode, bs=bs, warps=warps):
                _rm[(seq // bs, 1)](x, o, pos, plan.cos, plan.sin, seq, heads, heads,
                                    x.stride(0), x.stride(1), 0, x.stride(2), o.stride(0),
                                    o.stride(1), o.stride(2), o.stride(3), pos.stride(0),
                                    plan.cos.stride(0), NUM_OUT=3, HALF=64, BLOCK_S=bs,
                                    BLOCK_H=16, BLOCK_D=64, MODE=mode, PG=16, num_warps=warps)
            fm()
            assert torch.equal(o[0], want[0]) and torch.equal(o[2], want[2])
            res[f"multi mode{mode} s{bs} w{warps}"] = timed(fm)
    for k, v in res.items():
        print(f"{k:28s} {v * 1000:7.1f} us")
    json.dump(res, open(f"{os.environ.get('OUT', '.')}/pass_ab2.json", "w"), indent=1)


if __name__ == "__main__":
    main()
