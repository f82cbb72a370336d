"""Smoke test: DCA's forward kernel vs the part-call forward (out, lse)."""
import sys, time, torch
from models.attention import kernels
from models.attention.dca import fa4_forward, grouped
from models.attention.dca.attention import _forward
from models.attention.dca.plan import DCAPlan
from models.attention.dca.scaling import DCAScaling

def run(b, s, hq, hk, d, chunk, local, seq_k=None):
    torch.manual_seed(0)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    plan = DCAPlan(q, chunk, local, 10000.0, 1.0, None, DCAScaling())
    scale = d ** -0.5
    ref_out, ref_lse = _forward(q, k, v.contiguous(), plan, scale)  # part calls
    out = torch.empty_like(q); lse = torch.empty(b, hq, s, device="cuda", dtype=torch.float32)
    q_rot, k_rot = plan.rotate(q, k)
    t = time.time()
    fa4_forward.forward(q_rot.flatten(0, 1), k_rot, v, scale, plan.length, out, lse)
    torch.cuda.synchronize()
    print(f"b{b} s{s} h{hq}/{hk} d{d} C{chunk} w{local}: first call {time.time()-t:.1f}s",
          "out err", ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item(),
          "lse maxdiff", (lse - ref_lse).abs().max().item(), flush=True)
    # pieces: last rows only, bottom-right
    half = s // 2 // 128 * 128
    q_rot2 = plan.rotate_parts(q, slice(s - half, s))
    out2 = torch.empty_like(q[:, :half]); lse2 = torch.empty(b, hq, half, device="cuda", dtype=torch.float32)
    fa4_forward.forward(q_rot2.flatten(0, 1), k_rot, v, scale, plan.length, out2, lse2)
    print("  piece (last half rows) out err",
          ((out2.float() - ref_out[:, s - half:].float()).norm() / ref_out[:, s-half:].float().norm()).item(),
          "lse maxdiff", (lse2 - ref_lse[:, :, s - half:]).abs().max().item(), flush=True)

with kernels.using("fa4"):
    for cfg in [(1, 4096, 8, 8, 128, 1024, 128), (1, 4096, 8, 2, 128, 1024, 128),
                (2, 2048, 8, 2, 64, 512, 128), (1, 8192, 16, 16, 128, 2048, 1024),
                (1, 1792, 8, 2, 128, 1024, 128)]:
        try:
            run(*cfg)
        except Exception as e:
            import traceback; traceback.print_exc(); print("FAILED", cfg, flush=True)
            break
