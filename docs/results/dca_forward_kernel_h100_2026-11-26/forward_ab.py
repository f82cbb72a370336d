"""Forward timing: DCA kernel vs FA4 causal fwd vs part-call forward."""
import torch
from models.attention import kernels
from models.attention.dca import fa4_forward
from models.attention.dca.attention import _forward
from models.attention.dca.plan import DCAPlan
from models.attention.dca.scaling import DCAScaling

def bench(fn, n=10):
    for _ in range(3): fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]

fa = kernels.fa4_module()
with kernels.using("fa4"):
    for s, hk, chunk, local in [(8192, 16, 2048, 1024), (32768, 16, 8192, 0), (32768, 4, 8192, 0), (131072, 16, 8192, 0)]:
        q = torch.randn(1, s, 16, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, s, hk, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, s, hk, 128, device="cuda", dtype=torch.bfloat16)
        plan = DCAPlan(q, chunk, local, 10000.0, 1.0, None, DCAScaling())
        scale = 128 ** -0.5
        out = torch.empty_like(q); lse = torch.empty(1, 16, s, device="cuda", dtype=torch.float32)
        q_rot, k_rot = plan.rotate(q, k)
        kern = lambda: fa4_forward.forward(q_rot.flatten(0, 1), k_rot, v, scale, plan.length, out, lse)
        def kern_rot():
            qr, kr = plan.rotate(q, k)
            fa4_forward.forward(qr.flatten(0, 1), kr, v, scale, plan.length, out, lse)
        kern1 = lambda: fa4_forward.forward(q_rot[:1].flatten(0, 1), k_rot, v, scale, plan.length, out, lse)
        causal = lambda: fa._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
        parts = lambda: _forward(q, k, v, plan, scale)
        r = {name: bench(f) for name, f in [("fa4_causal", causal), ("dca_kernel", kern), ("kernel_1part", kern1), ("dca_kernel+rot", kern_rot), ("dca_parts", parts)]}
        print(s, hk, {k_: round(v_, 3) for k_, v_ in r.items()}, "kernel/causal", round(r["dca_kernel"] / r["fa4_causal"], 3), flush=True)
        del q, k, v, q_rot, k_rot, out, lse
