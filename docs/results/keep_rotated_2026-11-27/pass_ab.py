"""The rotation kernels before and after the eleventh session's change, same inputs, in
alternating rounds (neither always first), outputs compared bitwise. Needs the old module
beside it: git show ec7172e:models/attention/rope.py > rope_old.py (in this folder)."""
import json
import os

import torch

import rope_old
from models.attention import rope
from models.attention.dca.plan import DCAPlan, KernelPaths
from models.attention.dca.scaling import DCAScaling
from rb_sweep import timed as _timed


def ab(old, new, rounds=6):
    """(old us, new us): medians over rounds of 10-call medians, the order alternating."""
    times = {0: [], 1: []}
    for r in range(rounds):
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            times[which].append(_timed((old, new)[which], reps=10))
    return [1000 * sorted(t)[len(t) // 2] for t in (times[0], times[1])]


def main():
    torch.manual_seed(0)
    seq, heads, dim = 32768, 16, 128
    res = {}
    q = torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16)
    plan = DCAPlan(q, 8192, 1024, 10000.0, 1.0, None, DCAScaling(), None,
                   KernelPaths(kernels=True))
    pos = plan.part_positions.to(torch.int32).contiguous()
    fused = torch.randn(seq, 1, 4, 6 * dim, device="cuda", dtype=torch.bfloat16)  # GQA 16/4
    grouped_q = fused[..., :4 * dim].unflatten(-1, (4, dim)).transpose(0, 1)  # [1, s, 4, 4, d]
    k4 = fused[..., 4 * dim:5 * dim].transpose(0, 1)  # [1, s, 4, d]
    cases = {
        "multi q 16 heads, 3 parts": (q, pos),
        "multi q 3 of 16 heads, 3 parts": (q[:, :, 5:8], pos),
        "multi q grouped 16/4, 3 parts": (grouped_q, pos),
        "multi k 16 heads, 1": (q, pos[:1]),
        "multi k 4 heads (view), 1": (k4, pos[:1]),
    }
    for name, (x, p) in cases.items():
        new = rope.rotate_multi(x, p, plan.cos, plan.sin)
        old = rope_old.rotate_multi(x, p, plan.cos, plan.sin)
        held = p >= 0
        same = all(torch.equal(new[i][:, held[i]], old[i][:, held[i]]) for i in range(len(p)))
        o_us, n_us = ab(lambda: rope_old.rotate_multi(x, p, plan.cos, plan.sin),
                        lambda: rope.rotate_multi(x, p, plan.cos, plan.sin))
        res[name] = {"same": same, "old_us": o_us, "new_us": n_us}
    g = torch.randn(seq, heads, dim, device="cuda", dtype=torch.bfloat16)
    slot = fused[:, 0, :, :4 * dim].unflatten(-1, (4, dim))  # [s, 4, 4, d] grouped slots
    g4 = torch.randn(seq, 4, dim, device="cuda", dtype=torch.bfloat16)
    tcases = {
        "transpose_sum dk 16 heads": ([g], [pos[0]], torch.empty_like(g)),
        "transpose_sum dq into grouped slots": ([g], [pos[0]], slot),
        "transpose_sum dv copy 4 heads": ([g4], None, torch.empty_like(g4)),
    }
    for name, (gs, ps, out) in tcases.items():
        rope.rotate_transpose_sum(gs, ps, plan.cos, plan.sin, out)
        a = out.clone()
        rope_old.rotate_transpose_sum(gs, ps, plan.cos, plan.sin, out)
        o_us, n_us = ab(lambda: rope_old.rotate_transpose_sum(gs, ps, plan.cos, plan.sin, out),
                        lambda: rope.rotate_transpose_sum(gs, ps, plan.cos, plan.sin, out))
        res[name] = {"same": torch.equal(a, out), "old_us": o_us, "new_us": n_us}
    for name, r in res.items():
        print(f"{name:40s} same={r['same']!s:5s} old {r['old_us']:7.1f} us  new {r['new_us']:7.1f} us"
              f"  {r['old_us'] / r['new_us']:.2f}x")
    json.dump(res, open(f"{os.environ.get('OUT', '.')}/pass_ab.json", "w"), indent=1)


if __name__ == "__main__":
    main()
