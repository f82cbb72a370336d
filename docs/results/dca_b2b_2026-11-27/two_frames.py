"""DCA in two RoPE frames instead of three rotated query sets, checked in float64 on the CPU.

With L = C - w and the inter position P = min(2L - 1, C) equal to C (L >= (C + 1) / 2, as at
C = 8192, w = 1024), a query at i and a key at j <= i meet in one of two frames:
- intra, and successive on the first w rows of a chunk (r_i < w): the query's position minus
  the key's is i - j, so both sit at their global positions (standard RoPE: q at i, k at j);
- successive on the other rows, and inter: the query sits at C, the key at r_j; shifted by C,
  the query is unrotated and the key sits at r_j - C.
So DCA is attention where query i meets keys j >= s(i) through (RoPE(q, i), RoPE(k, j)) and keys
j < s(i) through (q, RoPE(k, r_j - C)), with s(i) the start of the previous chunk on a chunk's
first w rows and of its own chunk on the rest: one softmax over both. The query rotation of
each frame no longer depends on the part, only the key's frame switches, once per key block at
a fixed query range, which is what a kernel can afford (docs/benchmarks.md).

    PYTHONPATH=. python docs/results/dca_b2b_2026-11-27/two_frames.py
"""

import torch

from tests.models.test_dca import dca_reference
from tests.reference import rope_rotate

torch.manual_seed(0)
seq, heads, dim, chunk, local = 200, 2, 16, 24, 6
length = chunk - local
assert min(2 * length - 1, chunk) == chunk
q, k, v = (torch.randn(1, seq, heads, dim, dtype=torch.float64) for _ in range(3))
i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
r = torch.arange(seq) % length
start = torch.where(r < local, (torch.arange(seq) // length - 1).clamp(min=0) * length,
                    torch.arange(seq) // length * length)  # s(i)
near = (j >= start[:, None]) & (j <= i)
far = j < start[:, None]
scale = dim ** -0.5
scores_near = torch.einsum("bqhd,bkhd->bhqk", rope_rotate(q, torch.arange(seq)),
                           rope_rotate(k, torch.arange(seq)))
scores_far = torch.einsum("bqhd,bkhd->bhqk", q, rope_rotate(k, r - chunk))
scores = torch.where(near, scores_near, torch.where(far, scores_far, float("-inf"))) * scale
out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
reference = dca_reference(q, k, v, chunk, local)
error = ((out - reference).norm() / reference.norm()).item()
print(f"S={seq} C={chunk} w={local}: two frames vs dca_reference, relative error {error:.1e}")
assert error < 1e-12
