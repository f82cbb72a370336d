"""FA4's own SM90 causal attention (flash_attn.cute.flash_attn_func) at the head dims the
project routes to cuDNN (72, 80) beside ones it runs FA4 at (64, 96, 128): relative errors of
out, dq, dk, dv against float64 (bf16 inputs, 2048 tokens, 8 heads, MHA and GQA 8/2).

    python3 docs/results/dca_passes_2026-11-27/fa4_head_dims.py
"""

import torch
from flash_attn.cute import flash_attn_func


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def reference(q, k, v):  # noqa: ANN001, ANN201
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, 2) for x in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    seq = q.shape[1]
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~mask, -torch.inf).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


print(torch.cuda.get_device_name(), "torch", torch.__version__)
for kv in (8, 2):
    for dim in (64, 72, 80, 96, 128):
        torch.manual_seed(dim)
        q, k, v = (torch.randn(1, 2048, h, dim, device="cuda", dtype=torch.bfloat16)
                   .requires_grad_() for h in (8, kv, kv))
        dout = torch.randn_like(q)
        try:
            out = flash_attn_func(q, k, v, causal=True)
            out = out[0] if isinstance(out, tuple) else out
            grads = torch.autograd.grad(out, (q, k, v), dout)
        except Exception as error:  # noqa: BLE001
            print(f"8/{kv} heads, head_dim {dim}: {type(error).__name__}: {error}"[:200])
            continue
        leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
        ref = reference(*leaves)
        ref_grads = torch.autograd.grad(ref, leaves, dout.double())
        errors = [rel_err(out, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
        print(f"8/{kv} heads, head_dim {dim}: relative errors out, dq, dk, dv "
              + ", ".join(f"{e:.1e}" for e in errors))
