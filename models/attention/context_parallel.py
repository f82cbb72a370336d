"""Context parallelism (CP) for attention: the load-balanced layout, p2p KV exchange, and exact
attention over keys that other ranks hold (LSE merge forward, global-LSE backward).

The pieces (`PieceLayout`). With N CP ranks a sequence of S tokens is cut into 2N pieces of
P = S / (2N) tokens and rank r holds pieces r and 2N-1-r, in that order (megatron's
`get_batch_on_this_cp_rank` and its RoPE slicing use the same layout). Under a causal mask every
rank then does the same work.

Calls. An attention kind describes itself by a `CPPlan`: for a query rank `dst` and a KV source
rank `src`, the dense kernel `Call`s (cp_calls.py: query rows of dst x key rows of src, full or
causal, which rotated copy of the query to use, possibly in blocks). Every call runs
`attention_forward`, returning (out, lse); results merge by LSE online into a float32 output
(one fused pass per call, `merge_partials`), and the backward runs every call's
`attention_backward` with the *merged* out and lse (the global-LSE recipe of lse_attention.py),
so each call's dq, dk, dv are exact and simply add up: dq into one float32 buffer through the
call's rotation's transpose (one fused pass per call, `CPPlan.add_dq`), dk and dv into float32
accumulators of the key rows.

Exchange, chosen by the plan:
  ring    the KV block (k and v, one message) travels rank r -> r+1 for N-1 steps, so at step t
          rank r holds the KV of r-t; in backward the KV travels again, and each step's fp32
          dk/dv partial for r-t goes straight back to r-t while the next step computes.
          For attention that needs (nearly) every earlier key: standard causal and DCA.
  direct  each rank sends straight to each other rank only the key rows that rank's calls read
          (a contiguous row span), nothing when it reads none; the few rows received are kept
          for backward, whose dk/dv partials go straight back. For chunked attention.
Both use torch.distributed p2p (batch_isend_irecv), which NCCL and gloo support.

Overlap. By default every exchange is posted before the compute it can hide behind and waited
for only when its data is needed. With `overlap=False` (the run setting `parallel.cp_overlap`)
each exchange is waited for as soon as it is posted, so exchange and compute take turns: the
same operations in the same order, so the same results bit for bit, and the step time of the
two shows what the overlap hides. (The direct backward sends its partials after all of its
compute in either case.)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from models.attention.cp_calls import Call
from models.attention.lse_attention import attention_backward, attention_forward, merge_partials
from models.recompute import keep_attention, kept_attention


@dataclass(frozen=True)
class PieceLayout:
    """Where one CP rank's 2P local tokens sit in the global sequence."""

    size: int  # N, the CP world size
    rank: int
    local_len: int  # 2P

    def __post_init__(self) -> None:
        if self.local_len % 2:
            raise ValueError(f"context parallelism needs an even local sequence (two pieces), "
                             f"got {self.local_len}; make seq_length divisible by 2 x cp")

    @property
    def piece_len(self) -> int:
        return self.local_len // 2

    def pieces(self, rank: int) -> tuple[int, int]:
        """Global piece indices held by `rank`, in local order."""
        return rank, 2 * self.size - 1 - rank

    def positions(self) -> torch.Tensor:
        """[2P] int64 global position of each local token of this rank (on the CPU)."""
        p = self.piece_len
        return torch.cat([torch.arange(a * p, (a + 1) * p) for a in self.pieces(self.rank)])


class CPPlan:
    """What an attention kind computes under CP. Subclasses implement `calls` and may set
    `mode`; kinds that rotate q/k themselves (DCA: one rotated q per part) override
    rotate, add_dq and unrotate_k."""

    mode = "ring"  # "ring" | "direct"

    def __init__(self, layout: PieceLayout) -> None:
        self.layout = layout

    def calls(self, dst: int, src: int) -> list[Call]:
        raise NotImplementedError

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [b, s, hq, d] -> [parts, b, s, hq, d] and k -> [b, s, hk, d], both contiguous."""
        return q.contiguous().unsqueeze(0), k.contiguous()

    def add_dq(self, dq: torch.Tensor, part: int, q0: int, grad: torch.Tensor) -> None:
        """dq [rows, hq, d] (float32 rows q0.. of one sequence) += the gradient of rotated copy
        `part` of those rows, taken back to q (here: no rotation)."""
        dq.add_(grad)

    def unrotate_k(self, dk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """dk w.r.t. the rotated keys [b, s, hk, d] (float32) -> w.r.t. k, in `dtype`."""
        return dk.to(dtype)


def key_span(plan: CPPlan, dst: int, src: int) -> tuple[int, int] | None:
    """The contiguous rows of src's KV covering every row dst's calls read, or None."""
    calls = plan.calls(dst, src)
    if not calls:
        return None
    return min(c.k0 for c in calls), max(c.k1 for c in calls)


def _p2p(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
         group: dist.ProcessGroup, tag: int = 0) -> list:
    """Post sends and receives (peers are ranks within `group`); returns the works to wait on."""
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=peer, tag=tag) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=peer, tag=tag) for t, peer in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _kernel_view(x: torch.Tensor, start: int, stop: int, blocks: int) -> torch.Tensor:
    """Rows [start, stop) of a token-major [b, s, h, d] as the kernels' head-major [b * blocks,
    h, (stop - start) / blocks, d] (a view: callers pass b = 1 when blocks > 1)."""
    return x[:, start:stop].unflatten(1, (blocks, -1)).flatten(0, 1).transpose(1, 2)


def _token_rows(y: torch.Tensor, blocks: int) -> torch.Tensor:
    """A kernel's [b * blocks, h, rows, d] result as token-major [b, blocks * rows, h, d]."""
    return y.transpose(1, 2).unflatten(0, (-1, blocks)).flatten(1, 2)


def _entries(c: Call, batch: int) -> list[slice]:
    """The batch entries one kernel call of `c` takes at a time: all of them, or one each
    when the call's blocks fill the kernel's batch dimension."""
    return [slice(None)] if c.blocks == 1 else [slice(i, i + 1) for i in range(batch)]


def _ring_sources(kv: torch.Tensor, layout: PieceLayout, group: dist.ProcessGroup,
                  overlap: bool = True) -> Iterator[tuple[int, torch.Tensor, int]]:
    """Forward ring: yields (src, its whole KV [2, b, s, hk, d], row offset 0) for t = 0..N-1,
    the next block already in flight while the caller computes on this one (`overlap`), or
    already arrived before it does."""
    n, r = layout.size, layout.rank
    current = kv
    for t in range(n):
        works, incoming = [], None
        if t < n - 1:
            incoming = torch.empty_like(current)
            works = _p2p([(current, (r + 1) % n)], [(incoming, (r - 1) % n)], group)
            if not overlap:
                _wait(works)
                works = []
        yield (r - t) % n, current, 0
        _wait(works)
        current = incoming


class _CPAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan,
                group: dist.ProcessGroup, scale: float, overlap: bool) -> torch.Tensor:
        # Inside a recomputed layer (models/recompute.py) the first forward keeps its result and
        # the KV rows it received; the recompute reuses them: no kernels and no exchange again.
        kept = kept_attention(q.shape)
        if kept is None:
            out, lse, received = _forward(q, k, v, plan, group, scale, overlap)
            keep_attention(out, lse, *received)
        else:
            out, lse, *received = kept
        ctx.save_for_backward(q, k, v, out, lse, *received)
        ctx.plan, ctx.group, ctx.scale, ctx.overlap = plan, group, scale, overlap
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, *received = ctx.saved_tensors
        plan: CPPlan = ctx.plan
        q_parts, k_rot = plan.rotate(q, k)
        kv = torch.stack([k_rot, v])
        acc_dtype = lse.dtype
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)  # [b, s, hq, d] w.r.t. q
        dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device)  # this rank's own K/V
        args = _BackwardArgs(plan, q_parts, dout.contiguous(), out, lse, dq, ctx.scale)
        if plan.mode == "ring":
            _ring_backward(plan, kv, dkv, args, ctx.group, ctx.overlap)
        else:
            _direct_backward(plan, kv, dkv, args, ctx.group,
                             [(src, lo, rows) for (src, (lo, _)), rows in zip(_incoming(plan),
                                                                              received)])
        return (dq.to(q.dtype), plan.unrotate_k(dkv[0], k.dtype), dkv[1].to(v.dtype), None,
                None, None, None)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan,
             group: dist.ProcessGroup, scale: float,
             overlap: bool = True) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(out [b, s, hq, d] contiguous, merged lse [b, hq, s] in fp32/fp64, the KV row blocks
    received in direct mode, in `_incoming` order)."""
    layout = plan.layout
    q_parts, k_rot = plan.rotate(q, k)  # [parts, b, s, hq, d], [b, s, hk, d]
    kv = torch.stack([k_rot, v])  # [2, b, s, hk, d]: one message per exchange
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, seq, heads, dim = q.shape
    # Rows start at out 0, lse -inf: a row's first merge takes its partial as it is.
    acc = torch.zeros(batch, seq, heads, dim, dtype=acc_dtype, device=q.device)  # [b, s, h, d]
    lse = torch.full((batch, heads, seq), float("-inf"), dtype=acc_dtype, device=q.device)
    received: list[torch.Tensor] = []
    if plan.mode == "ring":
        sources = _ring_sources(kv, layout, group, overlap)
    else:
        sources = _direct_sources(kv, plan, group, received, overlap)
    for src, block, offset in sources:
        for c in plan.calls(layout.rank, src):
            k0, k1 = c.k0 - offset, c.k1 - offset
            for entries in _entries(c, batch):
                part_out, part_lse = attention_forward(
                    _kernel_view(q_parts[c.part, entries], c.q0, c.q1, c.blocks),
                    _kernel_view(block[0, entries], k0, k1, c.blocks),
                    _kernel_view(block[1, entries], k0, k1, c.blocks),
                    causal=c.causal, scale=scale)  # [b' * blocks, h, rows, d], [.., h, rows]
                _merge(acc[entries, c.q0:c.q1], lse[entries, :, c.q0:c.q1],
                       _token_rows(part_out, c.blocks),
                       part_lse.unflatten(0, (-1, c.blocks)).transpose(1, 2).flatten(2, 3))
    # [b, s, hq, d] contiguous: the layout of q_parts[p], as the kernel backwards require.
    return acc.to(q.dtype), lse, received


def _merge(acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
           out_lse: torch.Tensor) -> None:
    """Fold one call's (out [b, m, h, d], lse [b, h, m]) into the running result's rows (acc
    [b, m, h, d], lse [b, h, m] views) in place, in the accumulators' precision."""
    for b in range(acc.shape[0]):
        merge_partials([acc[b], out[b]], [lse[b], out_lse[b]], acc[b], lse[b])


class _BackwardArgs(NamedTuple):
    """What every call's backward reads (token-major [parts|-, b, s, h, d]) and the float32 dq
    it adds to ([b, s, hq, d], w.r.t. the unrotated q)."""
    plan: CPPlan
    q: torch.Tensor
    dout: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor  # [b, hq, s]
    dq: torch.Tensor
    scale: float


def _calls_backward(args: _BackwardArgs, calls: list[Call], block: torch.Tensor,
                    dblock: torch.Tensor, offset: int) -> None:
    """Run the calls' kernel backwards against a KV block [2, b, rows, hk, d]; dq adds into
    args.dq (through the plan's rotation), dk/dv into dblock (same shape as block, fp32). Rows of
    the block start at `offset`."""
    batch = args.dq.shape[0]
    for c in calls:
        k0, k1 = c.k0 - offset, c.k1 - offset
        for entries in _entries(c, batch):
            lse = args.lse[entries, :, c.q0:c.q1].unflatten(2, (c.blocks, -1))  # [b', h, bl, rows]
            grads = attention_backward(
                *(_kernel_view(x[entries], c.q0, c.q1, c.blocks)
                  for x in (args.dout, args.q[c.part])),
                *(_kernel_view(x[entries], k0, k1, c.blocks) for x in block),
                _kernel_view(args.out[entries], c.q0, c.q1, c.blocks),
                lse.transpose(1, 2).flatten(0, 1).contiguous(),  # [b' * blocks, h, rows]
                causal=c.causal, scale=args.scale)
            dq_c, dk_c, dv_c = (_token_rows(g, c.blocks) for g in grads)  # [b', rows', h, d]
            for dq_rows, g in zip(args.dq[entries, c.q0:c.q1], dq_c):
                args.plan.add_dq(dq_rows, c.part, c.q0, g)
            dblock[0, entries, k0:k1] += dk_c
            dblock[1, entries, k0:k1] += dv_c


def _ring_backward(plan: CPPlan, kv: torch.Tensor, dkv: torch.Tensor, args: _BackwardArgs,
                   group: dist.ProcessGroup, overlap: bool = True) -> None:
    """At step t rank r holds src = r-t's KV. Step 0's dk/dv (its own keys) go into `dkv`; each
    later step's go into a fresh partial that is sent to src (and the partial of rank r+t for
    r's keys received) while the next step computes; it is added into `dkv` one step later.
    Nothing waits on a gradient hop until the last step. Without `overlap` each exchange is
    waited for where it is posted; the additions into `dkv` keep their order (same sums)."""
    n, r = plan.layout.size, plan.layout.rank
    current, in_flight = kv, None
    for t in range(n):
        works, incoming = [], None
        if t < n - 1:  # the KV moves on while this step computes
            incoming = torch.empty_like(current)
            works = _p2p([(current, (r + 1) % n)], [(incoming, (r - 1) % n)], group)
            if not overlap:
                _wait(works)
                works = []
        partial = dkv if t == 0 else torch.zeros_like(dkv)
        _calls_backward(args, plan.calls(r, (r - t) % n), current, partial, 0)
        _add_arrived(dkv, in_flight)
        if t > 0:  # the sent partial stays referenced until its send is waited on
            arrived = torch.empty_like(dkv)
            in_flight = (arrived, partial, _p2p([(partial, (r - t) % n)],
                                                [(arrived, (r + t) % n)], group, tag=1))
            if not overlap:
                _add_arrived(dkv, in_flight)
                in_flight = None
        _wait(works)
        current = incoming
    _add_arrived(dkv, in_flight)


def _add_arrived(dkv: torch.Tensor,
                 in_flight: tuple[torch.Tensor, torch.Tensor, list] | None) -> None:
    """Wait for the partial exchange in flight (received, sent, works) and add what arrived."""
    if in_flight is not None:
        arrived, _, works = in_flight
        _wait(works)
        dkv += arrived


def _incoming(plan: CPPlan) -> list[tuple[int, tuple[int, int]]]:
    """Direct mode: (src, key span) of every row block this rank receives, in order."""
    n, r = plan.layout.size, plan.layout.rank
    blocks = []
    for t in range(1, n):
        span = key_span(plan, r, (r - t) % n)
        if span is not None:
            blocks.append(((r - t) % n, span))
    return blocks


def _direct_sources(kv: torch.Tensor, plan: CPPlan, group: dist.ProcessGroup,
                    received: list[torch.Tensor],
                    overlap: bool = True) -> Iterator[tuple[int, torch.Tensor, int]]:
    """Direct exchange: post every send and receive at once, yield the local KV while they fly
    (`overlap`; else once they have arrived), then each received row block (also appended to
    `received` for the backward)."""
    n, r = plan.layout.size, plan.layout.rank
    sends = []
    for t in range(1, n):
        span = key_span(plan, (r + t) % n, r)
        if span is not None:
            sends.append((kv[:, :, span[0]:span[1]].contiguous(), (r + t) % n))
    incoming = _incoming(plan)
    received += [kv.new_empty(2, kv.shape[1], hi - lo, *kv.shape[3:]) for _, (lo, hi) in incoming]
    works = _p2p(sends, [(rows, src) for (src, _), rows in zip(incoming, received)], group)
    if not overlap:
        _wait(works)
        works = []
    yield r, kv, 0
    _wait(works)
    for (src, (lo, _)), rows in zip(incoming, received):
        yield src, rows, lo


def _direct_backward(plan: CPPlan, kv: torch.Tensor, dkv: torch.Tensor, args: _BackwardArgs,
                     group: dist.ProcessGroup,
                     received: list[tuple[int, int, torch.Tensor]]) -> None:
    """dk/dv partials for received rows go straight back to their owners; ours come to us."""
    n, r = plan.layout.size, plan.layout.rank
    _calls_backward(args, plan.calls(r, r), kv, dkv, 0)
    sends = []
    for src, offset, rows in received:
        partial = torch.zeros(rows.shape, dtype=dkv.dtype, device=dkv.device)
        _calls_backward(args, plan.calls(r, src), rows, partial, offset)
        sends.append((partial, src))
    incoming = []
    for t in range(1, n):
        dst = (r + t) % n
        span = key_span(plan, dst, r)
        if span is not None:
            partial = dkv.new_empty(2, dkv.shape[1], span[1] - span[0], *dkv.shape[3:])
            incoming.append((partial, dst, span))
    _wait(_p2p(sends, [(p, dst) for p, dst, _ in incoming], group))
    for partial, _, (lo, hi) in incoming:
        dkv[:, :, lo:hi] += partial


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CPPlan,
                 group: dist.ProcessGroup, scale: float, overlap: bool = True) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys as `plan` describes.

    q: [b, 2P, hq, d]; k, v: [b, 2P, hk, d] (this rank's tokens in the load-balanced layout).
    Returns [b, 2P, hq, d] in q's dtype; differentiable in q, k, v (exact global-LSE backward).
    `overlap=False` waits for each exchange where it is posted (the module docstring).
    """
    return _CPAttention.apply(q, k, v, plan, group, scale, overlap)
