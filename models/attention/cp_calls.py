"""The dense kernel calls of attention under context parallelism, and how they are combined.

A `CPPlan` (context_parallel.py) lists, for a query rank and a KV source rank, `Call`s: query
rows of the one against key rows of the other, full or causal, with the rotated copy of the
query to use. `coalesce` merges full calls that tile a larger rectangle into one call;
`join_blocks` runs calls of one shape that follow each other on both axes (a chunk-by-chunk
causal diagonal, a successive staircase) as one call over blocks.
"""

from __future__ import annotations

from typing import NamedTuple


class Call(NamedTuple):
    """One dense kernel call: query rows [q0, q1) of the query rank (rotated copy `part`)
    against key rows [k0, k1) of the source rank; `causal` only for the same global rows.
    With `blocks` > 1 both ranges are that many equal blocks, block j of the queries against
    block j of the keys, run as one kernel call with the blocks in its batch dimension."""

    part: int
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    blocks: int = 1


def coalesce(calls: list[Call]) -> list[Call]:
    """Merge full calls that tile a larger rectangle: the same keys and adjacent query rows,
    then the same queries and adjacent key rows. Fewer, larger kernel calls; same function."""
    return _merge_adjacent(_merge_adjacent(calls, on_queries=True), on_queries=False)


def _merge_adjacent(calls: list[Call], on_queries: bool) -> list[Call]:
    """One coalescing pass along the query (or key) axis."""
    def spans(c: Call) -> tuple[tuple[int, int], tuple[int, int]]:  # (this axis, the other)
        return ((c.q0, c.q1), (c.k0, c.k1)) if on_queries else ((c.k0, c.k1), (c.q0, c.q1))

    merged: list[Call] = []
    for c in sorted(calls, key=lambda c: (c.part, c.causal, spans(c)[1], spans(c)[0])):
        last = merged[-1] if merged else None
        if last is not None and not (c.causal or last.causal) and last.part == c.part:
            (_, end), other = spans(last)
            (start, stop), c_other = spans(c)
            if other == c_other and end == start:
                merged[-1] = last._replace(**{"q1" if on_queries else "k1": stop})
                continue
        merged.append(c)
    return merged


def join_blocks(calls: list[Call]) -> list[Call]:
    """Join calls of one part, kind and shape that follow each other on both axes (each call's
    query and key rows start where the previous call's end) into one call over blocks: a
    chunk-by-chunk causal diagonal or successive staircase becomes one kernel call."""
    joined: list[Call] = []
    for c in sorted(calls, key=lambda c: (c.part, c.causal, c.q1 - c.q0, c.k1 - c.k0, c.q0)):
        last = joined[-1] if joined else None
        if (last is not None and (last.part, last.causal) == (c.part, c.causal)
                and (last.q1 - last.q0) // last.blocks == c.q1 - c.q0
                and (last.k1 - last.k0) // last.blocks == c.k1 - c.k0
                and (last.q1, last.k1) == (c.q0, c.k0)):
            joined[-1] = last._replace(q1=c.q1, k1=c.k1, blocks=last.blocks + 1)
        else:
            joined.append(c)
    return joined
