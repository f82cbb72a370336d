"""The DCA backward's memory schedule (models/attention/dca/backward.py): kernel calls bounded to
a budget of query rows, rotations made per call and dropped with it. Checked against the dense
float64 reference at budgets small enough to cut every kind of call, for both inter cuts (MHA
per key chunk, GQA per query chunk), packed documents and the length scaling."""

from __future__ import annotations

import weakref

import pytest
import torch

from models.attention.dca import backward as dca_backward
from models.attention.dca.attention import dual_chunk_attention
from models.attention.dca.calls import Call, bounded
from models.attention.dca.scaling import DCAScaling
from tests.models.test_dca import assert_matches_reference, grads, make_qkv
from tests.models.test_dca_scaling import (
    check,
    log_factor,
    part_factors,
    test_packed_documents_scale_by_their_own_position_and_length,
)

CHUNK, LOCAL, SEQ = 10, 3, 52  # L = 7: 7 chunks and a tail of 3
LENGTH = CHUNK - LOCAL
PACKED = [0, 5, 30, 31, 52]  # documents of 5, 25 (3 chunks + 4), 1 and 21 (3 chunks) tokens


def _record_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(query rows, key rows) of every kernel backward call the DCA backward makes."""
    calls: list[tuple[int, int]] = []
    kernel = dca_backward.attention_backward

    def recorded(dout, q, k, *args, **kwargs):  # q, k: [blocks, h, rows, d]
        calls.append((q.shape[0] * q.shape[2], k.shape[0] * k.shape[2]))
        return kernel(dout, q, k, *args, **kwargs)

    monkeypatch.setattr(dca_backward, "attention_backward", recorded)
    return calls


@pytest.mark.parametrize("budget", [1, 7, 13, 20, 10_000])
@pytest.mark.parametrize(("hq", "hk", "cu"), [(2, 2, None), (6, 2, None), (2, 2, PACKED),
                                              (4, 2, PACKED)])
def test_bounded_calls_match_the_reference(budget: int, hq: int, hk: int, cu: list[int] | None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call reads at most max(budget, L) query rows (MHA: key rows too), and the
    gradients are the reference's; the unbounded calls read up to 49 rows, so small budgets
    must cut intra, successive and inter calls."""
    monkeypatch.setattr(dca_backward, "rows_per_call", lambda tokens: budget)
    calls = _record_calls(monkeypatch)
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    assert_matches_reference(1, SEQ, hq, hk, 8, chunk_size=CHUNK, local_size=LOCAL,
                             cu_seqlens=cu_seqlens)
    bound = max(budget, LENGTH)
    assert calls and max(rows for rows, _ in calls) <= bound
    if hq == hk:
        assert max(keys for _, keys in calls) <= bound
    if budget == 10_000 and cu is None:
        assert max(rows for rows, _ in calls) == 7 * LENGTH  # the one batched intra call


@pytest.mark.parametrize("budget", [1, 13])
def test_key_rows_get_one_gradient_add_per_part_or_few_pieces(
        budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """dk/dv are rounded once per part (intra, successive, inter) where the inter query range of
    a key chunk is cut into more than BF16_PIECES pieces (summed in float32 first: key chunk 0,
    38 query rows, at budget 1), else once per piece: never more than 2 + BF16_PIECES times."""
    monkeypatch.setattr(dca_backward, "rows_per_call", lambda tokens: budget)
    adds = torch.zeros(SEQ, dtype=torch.int64)
    add_dkv = dca_backward._add_dkv

    def counted(plan, doc, start: int, dk: torch.Tensor, dv: torch.Tensor,
                accumulate: bool) -> None:
        adds[doc.start + start:doc.start + start + dk.shape[0]] += 1
        add_dkv(plan, doc, start, dk, dv, accumulate)

    monkeypatch.setattr(dca_backward, "_add_dkv", counted)
    assert_matches_reference(1, SEQ, 2, 2, 8, chunk_size=CHUNK, local_size=LOCAL)
    assert int(adds.max()) <= 2 + dca_backward.BF16_PIECES, adds.tolist()
    if budget == 1:
        assert adds[:LENGTH].tolist() == [3] * LENGTH


def test_bounded_calls_with_length_scaling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The logit factors follow the rows of a cut call (query rows rotated and scaled per call)."""
    monkeypatch.setattr(dca_backward, "rows_per_call", lambda tokens: 9)
    check(DCAScaling("log", "all", attn_scale=0.3, floor_scale=6),
          part_factors([log_factor(p, 0.3, 6) for p in range(SEQ)], "all"), SEQ, CHUNK, LOCAL,
          hq=2, hk=2)
    check(DCAScaling("log", "succ_inter", attn_scale=0.3, floor_scale=6),
          part_factors([log_factor(p, 0.3, 6) for p in range(SEQ)], "succ_inter"), SEQ, CHUNK,
          LOCAL, hq=6, hk=2)
    # packed: each document's factors, read at its own rows of the sequence
    test_packed_documents_scale_by_their_own_position_and_length()


@pytest.mark.parametrize(("hq", "hk"), [(2, 2), (6, 2)])
def test_rotations_are_per_call_and_die_with_it(hq: int, hk: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """When the backward rotates, at most one earlier rotation is alive (the keys of the call
    or of the key chunk being worked on), and a rotated q never has more rows than a call."""
    budget = 13
    monkeypatch.setattr(dca_backward, "rows_per_call", lambda tokens: budget)
    alive_at_rotation: list[int] = []
    rotations: list[weakref.ref] = []

    def tracked(rotate):
        def rotated(*args) -> torch.Tensor:  # (plan, doc, [part,] start, count)
            alive_at_rotation.append(sum(ref() is not None for ref in rotations))
            x_rot = rotate(*args)
            rotations.append(weakref.ref(x_rot))
            return x_rot
        return rotated

    def rotated_q(plan, doc, part: int, start: int, count: int) -> torch.Tensor:
        assert count <= max(budget, LENGTH)
        return rotate_q(plan, doc, part, start, count)

    rotate_q = dca_backward._rotated_q
    monkeypatch.setattr(dca_backward, "_rotated_q", tracked(rotated_q))
    monkeypatch.setattr(dca_backward, "_rotated_k", tracked(dca_backward._rotated_k))
    q, k, v = make_qkv(1, SEQ, hq, hk, 8)
    grads(dual_chunk_attention(q, k, v, chunk_size=CHUNK, local_size=LOCAL), [q, k, v])
    assert max(alive_at_rotation) == 1  # 1, not 0: the tracking sees live rotations


def test_bounded_cuts_batched_calls_into_adjacent_groups() -> None:
    intra = Call(0, 0, 7, 5, 0, 7, True)
    successive = Call(1, 7, 7, 4, 0, 7, False)
    assert bounded([intra, successive], 15) == [
        Call(0, 0, 7, 2, 0, 7, True), Call(0, 14, 7, 2, 14, 7, True),
        Call(0, 28, 7, 1, 28, 7, True),
        Call(1, 7, 7, 2, 0, 7, False), Call(1, 21, 7, 2, 14, 7, False)]
    assert bounded([intra], 3) == [Call(0, 7 * i, 7, 1, 7 * i, 7, True) for i in range(5)]
    assert bounded([intra], 100) == [intra]


def test_query_pieces_are_even_and_cover_the_range() -> None:
    assert dca_backward._pieces_of(14, 52, 13) == [(14, 13), (27, 13), (40, 12)]
    assert dca_backward._pieces_of(14, 52, 38) == [(14, 38)]
    assert dca_backward._pieces_of(0, 10, 3) == [(0, 3), (3, 3), (6, 2), (8, 2)]


def test_the_default_budget_is_a_sixth_of_the_tokens() -> None:
    assert dca_backward.rows_per_call(131072) == 21845
    assert dca_backward.rows_per_call(8192) == dca_backward.MIN_ROWS_PER_CALL
