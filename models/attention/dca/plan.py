"""What Dual Chunk Attention derives from its arguments before any kernel runs: the checks of
q, k, v and the sizes, and `DCAPlan` (documents, per-part positions, RoPE tables, logit factors),
shared by the forward (attention.py), the backward (backward.py), the CUDA graphs (graphs.py),
the probe (models/attention/probe.py) and, for the checks, the CP form (cp_variants.py).
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import torch

from models.attention.dca.scaling import DCAScaling, query_factors
from models.attention.rope import rope_cos_sin, rotate_multi
from models.options import DCABackward
from models.rope_scaling import RopeScaling

BACKWARDS = tuple(DCABackward)  # the trainer.dca_backward setting (dispatch.route)


def check_backward(backward: str) -> None:
    if backward not in BACKWARDS:
        raise ValueError(f"dca_backward must be one of {' | '.join(BACKWARDS)}, got {backward!r}")

# DCA's own kernels' query and key tile (FA4's SM90 tiles for head_dim <= 128): every tile lies
# in one chunk when L and the sequence are multiples of it.
KERNEL_BLOCK = 128
# The head dims DCA's kernels run at: where FA4's SM90 dQ accumulator has the order dq_parts.py
# reads, checked with the kernels on the H100 (tests/gpu/test_fa4_gpu.py; at 72 FA4's SM90
# backward machinery gave wrong gradients, docs/benchmarks.md). Other head dims take the part
# calls.
KERNEL_HEAD_DIMS = (64, 96, 128)


class KernelPaths(NamedTuple):
    """How one DCA call runs, chosen by dispatch.route: through DCA's own FA4 kernels
    (fa4_forward.py, fa4_backward.py) or the part calls, the backward kernel over all heads
    and query rows at once or in the pieces of grouped.split, and whether the backward takes
    the forward's rotated queries and keys (kept as activations) or rotates them again."""
    kernels: bool = False
    one_piece: bool = False
    keep_rotated: bool = False


class DCAPlan:
    """Everything both passes derive from the arguments: documents, positions, RoPE tables."""

    def __init__(self, q: torch.Tensor, chunk_size: int, local_size: int, theta: float,
                 mscale: float, bounds: list[int] | None, scaling: DCAScaling,
                 rope_scaling: RopeScaling | None = None,
                 paths: KernelPaths | None = None,
                 lengths: tuple[int, ...] | None = None) -> None:
        batch, seq, head_dim = q.shape[0], q.shape[1], q.shape[-1]
        self.length = chunk_size - local_size
        # chosen by the caller once, so forward, backward and CUDA graphs agree
        self.paths = paths or KernelPaths()
        if bounds is None:
            self.docs = [(b, 0, seq) for b in range(batch)]
        else:
            self.docs = [(0, a, e - a) for a, e in itertools.pairwise(bounds) if e > a]
        max_chunks = max(-(-n // self.length) for _, _, n in self.docs)
        self.num_parts = min(3, max_chunks)  # rotations actually needed
        positions = _positions(seq, chunk_size, local_size,
                               None if bounds is None else tuple(bounds), q.device)
        self.positions = positions[:self.num_parts]  # [parts, s]
        self.in_document = positions[3]  # [s]
        table_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        # Positions reach C itself (min(r + L, C)), so the table has C + 1 rows.
        self.cos, self.sin = _tables(chunk_size + 1, head_dim, theta, mscale, table_dtype,
                                     q.device, rope_scaling)
        # [parts, s] logit factor per rotated query ([parts, b, s] with `lengths`: each row's
        # own, for a length-dependent scaling in inference), or None: no scaling (the default)
        self.q_scale = query_factors(scaling, chunk_size, seq,
                                     None if bounds is None else tuple(bounds), self.num_parts,
                                     table_dtype, q.device, lengths=lengths)
        # DCA's kernels read a query block's successive tiles from the inter copy where the two
        # are the same rotation: with the inter position min(2L - 1, C) equal to C, every row
        # past a chunk's first w has its successive position r + L clamped to C too. So only
        # the first `successive_rows` rows of each chunk (w, in whole kernel blocks) need a
        # successive copy of their own, and `part_positions` marks the others -1: never
        # written, zeroed or read (L: every row has its own).
        shares = (self.paths.kernels and self.num_parts == 3 and self.q_scale is None
                  and min(2 * self.length - 1, chunk_size) == chunk_size)
        self.successive_rows = (min(-(-local_size // KERNEL_BLOCK) * KERNEL_BLOCK, self.length)
                                if shares else self.length)
        self.part_positions = self.positions if self.successive_rows == self.length else (
            _part_positions(seq, chunk_size, local_size, self.successive_rows, q.device))

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q rotated for every part [parts, b, s, hq, d]; k rotated to r [b, s, hk, d]."""
        return self.rotate_parts(q), self.rotate_k(k)

    def rotate_parts(self, q: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """Sequence rows `rows` (default all) of q [b, s, hq, d] rotated for every part (times
        the parts' logit factors, if any): a contiguous [parts, b, s', hq, d], the rows where
        `part_positions` is -1 left unwritten."""
        q_rot = rotate_multi(q[:, rows], self.part_positions[:, rows], self.cos, self.sin)
        if self.q_scale is not None:  # [parts, 1 or b, s', 1, 1]
            q_rot.mul_(self._rows(self.q_scale, rows)[..., None, None])
        return q_rot

    def rotate_q(self, q: torch.Tensor, part: int, rows: slice = slice(None)) -> torch.Tensor:
        """q [b, s', hq, d] holding sequence rows `rows` (default all), rotated for one part
        (times that part's logit factors, if any): a contiguous [b, s', hq, d]."""
        q_rot = rotate_multi(q, self.positions[part:part + 1, rows], self.cos, self.sin)[0]
        if self.q_scale is not None:  # [1 or b, s', 1, 1]
            q_rot.mul_(self._rows(self.q_scale, rows)[part, ..., None, None])
        return q_rot

    @staticmethod
    def _rows(q_scale: torch.Tensor, rows: slice) -> torch.Tensor:
        """The factors of sequence rows `rows`: [parts, 1 or b, s'] (one table for every batch
        row, or each row's own)."""
        return q_scale[:, None, rows] if q_scale.dim() == 2 else q_scale[:, :, rows]

    def rotate_k(self, k: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """k [b, s', hk, d] holding sequence rows `rows` (default all), rotated to its in-chunk
        offset r (the same for every part): a contiguous [b, s', hk, d]."""
        return rotate_multi(k, self.positions[:1, rows], self.cos, self.sin)[0]


@functools.lru_cache(maxsize=16)
def _positions(seq: int, chunk_size: int, local_size: int, bounds: tuple[int, ...] | None,
               device: torch.device) -> torch.Tensor:
    """[4, seq] int32 query positions of every token for intra, successive and inter, then its
    position in its document (the causal case's).

    Row 0 (r, the in-chunk offset) is also every key's position. Built on the CPU and cached,
    so a layer's call launches nothing for it; positions restart at each document.
    """
    length = chunk_size - local_size
    in_doc = torch.arange(seq)
    if bounds is not None:
        edges = torch.tensor(bounds)
        in_doc = in_doc - edges[:-1].repeat_interleave(edges.diff())
    r = in_doc % length
    succ = torch.clamp(r + length, max=chunk_size)
    inter = torch.full_like(r, min(2 * length - 1, chunk_size))
    return torch.stack([r, succ, inter, in_doc]).to(torch.int32).to(device, non_blocking=True)


@functools.lru_cache(maxsize=16)
def _part_positions(seq: int, chunk_size: int, local_size: int, successive_rows: int,
                    device: torch.device) -> torch.Tensor:
    """[3, seq] `_positions` of one document with the successive row -1 past each chunk's
    first `successive_rows` rows (built on the CPU and cached, as _positions)."""
    positions = _positions(seq, chunk_size, local_size, None, torch.device("cpu"))[:3].clone()
    positions[1].masked_fill_(positions[0] >= successive_rows, -1)
    return positions.to(device, non_blocking=True)


@functools.lru_cache(maxsize=16)
def _tables(rows: int, head_dim: int, theta: float, mscale: float, dtype: torch.dtype,
            device: torch.device, scaling: RopeScaling | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-width [rows, d/2] cos and sin tables (cached: every layer asks for the same one)."""
    cos, sin = rope_cos_sin(torch.arange(rows, device=device), head_dim, theta, mscale,
                            dtype=dtype, scaling=scaling)
    return cos[:, :head_dim // 2].contiguous(), sin[:, :head_dim // 2].contiguous()


def check_sizes(chunk_size: int, local_size: int, rope_theta: float) -> None:
    for name, value in (("chunk_size", chunk_size), ("local_size", local_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if chunk_size <= local_size:
        raise ValueError(f"chunk_size ({chunk_size}) must exceed local_size ({local_size})")
    if rope_theta <= 0:
        raise ValueError(f"rope_theta must be positive, got {rope_theta}")


def flat_heads(q: torch.Tensor) -> torch.Tensor:
    """q itself if [b, s, hq, d]; for q [b, s, groups, q_per_group, d] (its heads in their
    groups, models/fused_qkv.py) a [b, s, hq, d] stand-in of its shape, dtype and device that
    holds no data (for the checks and the plan; the kernels read q itself)."""
    if q.dim() != 5:
        return q
    return torch.empty((), dtype=q.dtype, device=q.device).expand(
        *q.shape[:2], q.shape[2] * q.shape[3], q.shape[4])


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() == 5 and q.shape[2] != k.shape[2]:
        raise ValueError(f"q in groups {tuple(q.shape)} needs a group per kv head, got k "
                         f"{tuple(k.shape)}")
    q = flat_heads(q)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [batch, seq, heads, head_dim]; got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, seq "
                         "and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"kv heads ({k.shape[2]}) must divide query heads ({q.shape[2]})")
    if q.shape[3] % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {q.shape[3]}")
    if q.shape[1] == 0:
        raise ValueError("sequence length must be positive")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k, v must share dtype and device")
