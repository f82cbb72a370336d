"""Where attention goes: the probabilities of a few queries, to explain extrapolation results.

The fused kernels never form the attention matrix. Under `probing(rows, edges)` every core
attention (unpacked sequences, no context parallelism: as `trainer.eval` runs) also computes,
for the query rows `rows` only, the probabilities its variant assigns to every key (dense,
float64, from the same q and k its kernel gets; the variant's mask and positions), and records
per layer:

    entropy   mean over batch, heads and rows of -sum_j p_j ln p_j (nats); uniform over n keys
              is ln n, so a flat (diluted) softmax shows as entropy growing with the length;
    mass      the probability on keys at distance i - j in each [edges[k], edges[k+1]) (the
              last bucket open-ended), averaged like the entropy: how far back each layer reads.

`tests/models/test_probe.py` checks the probabilities against the kernels: p @ v reproduces
each variant's own output rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from models.attention.dca.plan import DCAPlan
from models.attention.dca.scaling import DCAScaling
from models.rope_scaling import RopeScaling


@dataclass
class LayerSummary:
    entropy: float
    mass: list[float]  # per distance bucket


@dataclass
class Probe:
    rows: torch.Tensor  # [n] query positions
    edges: list[int]  # distance bucket starts, edges[0] == 0
    layers: dict[int, LayerSummary] = field(default_factory=dict)


_probe: Probe | None = None


@contextlib.contextmanager
def probing(rows: torch.Tensor, edges: list[int]) -> Iterator[Probe]:
    """Record every core attention's summary for query `rows` during the forwards inside."""
    global _probe
    if not edges or edges[0] != 0:
        raise ValueError(f"distance buckets must start at 0, got {edges}")
    _probe = Probe(rows.to(torch.long), list(edges))
    try:
        yield _probe
    finally:
        _probe = None


def active_probe() -> Probe | None:
    return _probe


def _logits(q_rows: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """[b, n, hq, d] x [b, s, hk, d] -> [b, hq, n, s] float64 (K heads shared by query groups)."""
    k = k.double().repeat_interleave(q_rows.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bnhd,bshd->bhns", q_rows.double(), k) * scale


def _softmax(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Probabilities over the allowed keys ([n, s] bool)."""
    return logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1)


def _causal(rows: torch.Tensor, seq: int) -> torch.Tensor:
    return torch.arange(seq, device=rows.device)[None, :] <= rows[:, None]  # [n, s]


def causal_probabilities(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Rotated q [b, s, hq, d], k [b, s, hk, d] -> [b, hq, n, s] for causal attention."""
    return _softmax(_logits(q[:, rows], k, scale), _causal(rows, q.shape[1]))


def chunked_probabilities(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float,
                          chunk_size: int) -> torch.Tensor:
    """Causal within chunks of `chunk_size` tokens."""
    keys = torch.arange(q.shape[1], device=q.device)
    same = (keys[None, :] // chunk_size) == (rows[:, None] // chunk_size)
    return _softmax(_logits(q[:, rows], k, scale), _causal(rows, q.shape[1]) & same)


def dca_probabilities(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float, *,
                      chunk_size: int, local_size: int, rope_theta: float, mscale: float,
                      scaling: DCAScaling, rope_scaling: RopeScaling | None) -> torch.Tensor:
    """Unrotated q, k -> DCA's probabilities: each (query, key) pair's logit from the query
    rotated for its part (intra / successive / inter, with the part's scaling factor)."""
    plan = DCAPlan(q, chunk_size, local_size, rope_theta, mscale, None, scaling, rope_scaling)
    q_rot, k_rot = plan.rotate(q, k)  # [parts, b, s, hq, d], [b, s, hk, d]
    logits = torch.stack([_logits(part[:, rows], k_rot, scale) for part in q_rot])
    chunk = torch.arange(q.shape[1], device=q.device) // plan.length
    behind = chunk[rows][:, None] - chunk[None, :]  # [n, s]: chunks between query and key
    part = behind.clamp(0, plan.num_parts - 1)  # 0 intra, 1 successive, 2 inter
    chosen = logits.gather(0, part.expand(1, *logits.shape[1:3], -1, -1))[0]
    return _softmax(chosen, _causal(rows, q.shape[1]))


def record(layer: int, probs: torch.Tensor, rows: torch.Tensor) -> None:
    """Summarise one layer's [b, h, n, s] probabilities of the probe's `rows` (on the model's
    device) into the active probe."""
    probe = _probe
    plogp = torch.where(probs > 0, probs * probs.clamp_min(1e-300).log(), 0.0)
    entropy = float(-plogp.sum(-1).mean())
    distance = rows[:, None] - torch.arange(probs.shape[-1], device=probs.device)[None]
    bucket = torch.bucketize(distance.clamp_min(0), torch.tensor(probe.edges[1:],
                                                                 device=probs.device),
                             right=True)  # [n, s]
    per_row = probs.mean(dim=(0, 1))  # [n, s]
    mass = torch.zeros(len(probe.edges), dtype=torch.float64, device=probs.device)
    mass.index_add_(0, bucket.flatten(), per_row.flatten())
    probe.layers[layer] = LayerSummary(entropy, (mass / len(probe.rows)).tolist())
