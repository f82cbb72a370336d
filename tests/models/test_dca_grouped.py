"""DCA on FA4's one call each way and DCA's backward kernel (models/attention/dca/grouped.py,
fa4_backward.py), the CPU-checkable half: the forward's block-sparse lists and the backward
kernel's tile-to-part rule against the dense part masks of SPEC.md's table, when each path
applies, and the backward's pieces and rotations around the kernel, with a float64 stand-in of
the kernel's contract, against the dense reference. The kernels themselves run in
tests/gpu/test_fa4_gpu.py."""

from __future__ import annotations

import pytest
import torch

from models.attention import kernels
from models.attention.dca import backward as dca_backward
from models.attention.dca import fa4_backward, grouped
from models.attention.dca.attention import dual_chunk_attention
from models.attention.dca.scaling import DCAScaling
from tests.models.test_dca import assert_matches_reference
from tests.models.test_dca_scaling import check, log_factor, part_factors

BLOCK = grouped.BLOCK


def part_masks(seq: int, length: int) -> torch.Tensor:
    """[3, s_q, s_k] which keys each query meets in each part (SPEC.md), from positions."""
    pos = torch.arange(seq)
    n_q, n_k = (pos // length)[:, None], (pos // length)[None, :]
    causal = pos[None, :] <= pos[:, None]
    return torch.stack([(n_k == n_q) & causal, n_k == n_q - 1, n_k <= n_q - 2])


def listed(count: torch.Tensor, index: torch.Tensor, blocks: int) -> torch.Tensor:
    """[p, rows, blocks] bool: the blocks a count/index list names."""
    out = torch.zeros(*count.shape, blocks, dtype=torch.bool)
    for p, r in torch.cartesian_prod(torch.arange(count.shape[0]), torch.arange(count.shape[1])):
        out[p, r, index[p, r, :count[p, r]].long()] = True
    return out


@pytest.mark.parametrize(("seq", "length"), [(2048, 256), (3072, 512), (1024, 128)])
def test_block_lists_match_the_dense_part_masks(seq: int, length: int) -> None:
    blocks = seq // BLOCK
    masks = part_masks(seq, length)  # [3, sq, sk]
    tiles = masks.unflatten(1, (blocks, BLOCK)).unflatten(3, (blocks, BLOCK))  # [3, R, B, C, B]
    every, some = tiles.all(dim=(2, 4)), tiles.any(dim=(2, 4))  # [3, rows, cols]
    masked_count, masked_index, full_count, full_index = grouped.block_lists(
        seq, length, 3)
    full = listed(full_count, full_index, blocks)
    masked = listed(masked_count, masked_index, blocks)
    assert torch.equal(full, every)  # full blocks: every pair meets
    assert torch.equal(masked, some & ~every)  # the rest of what any pair meets: masked
    # ascending, packed left
    for p, r in zip(*torch.nonzero(full_count > 1, as_tuple=True)):
        named = full_index[p, r, :full_count[p, r]]
        assert torch.all(named.diff() > 0)
    # the masked blocks are intra's diagonal, where the kernel's causal mask (key <= query) is
    # exactly the part's mask
    assert masked_count[1:].sum() == 0 and torch.all(masked_count[0] == 1)
    diagonal = tiles[0, torch.arange(blocks), :, torch.arange(blocks)]  # [blocks, B, B]
    causal = torch.ones(BLOCK, BLOCK, dtype=torch.bool).tril()
    assert torch.equal(diagonal, causal.expand_as(diagonal))


@pytest.mark.parametrize(("tile_m", "tile_n"), [(64, 128), (128, 128)])  # FA4's SM90 tiles
@pytest.mark.parametrize(("seq", "length"), [(2048, 256), (1536, 384), (1024, 512)])
def test_backward_kernel_tiles_each_meet_one_part(seq: int, length: int, tile_m: int,
                                                 tile_n: int) -> None:
    """fa4_backward.py's premise: with L and S multiples of 128, a (query tile m, key tile n)
    of the causal loop (n's first row <= m's last) meets keys in one part only, the one of
    its chunk distance min(m // (L / tile_m) - n // (L / tile_n), 2); all of it but the
    causal mask's diagonal; and tiles above the diagonal meet nothing."""
    masks = part_masks(seq, length)  # [3, sq, sk]
    tiles = masks.unflatten(1, (-1, tile_m)).unflatten(3, (-1, tile_n))  # [3, M, tm, N, tn]
    meets = tiles.any(dim=(2, 4))  # [3, M, N]
    for m in range(seq // tile_m):
        for n in range(seq // tile_n):
            if n * tile_n > (m + 1) * tile_m - 1:  # outside the causal loop
                assert not meets[:, m, n].any()
                continue
            part = min(m // (length // tile_m) - n // (length // tile_n), 2)
            assert meets[:, m, n].tolist() == [p == part for p in range(3)], (m, n)
            rows = torch.arange(m * tile_m, (m + 1) * tile_m)[:, None]
            cols = torch.arange(n * tile_n, (n + 1) * tile_n)[None, :]
            assert torch.equal(tiles[part, m, :, n, :], cols <= rows)  # the causal mask


def test_block_lists_drop_parts_a_short_sequence_lacks() -> None:
    lists = grouped.block_lists(512, 256, 2)  # two chunks: no inter part
    assert all(x.shape[0] == 2 for x in lists)


@pytest.mark.parametrize(("seq", "chunk", "local", "cu", "expected"), [
    (4096, 1024, 128, None, True),  # L = 896 = 7 blocks
    (4096, 1024, 100, None, False),  # L = 924: blocks would straddle chunks
    (4000, 1024, 128, None, False),  # a partial last block
    (4096, 1024, 128, [0, 1000, 4096], False),  # packed: chunks from the sequence's start
    (32768, 8192, 1024, None, False),  # above MAX_TOKENS: part calls, the kernel in pieces
])
def test_applies_only_where_the_one_call_is_exact_and_small(
        seq: int, chunk: int, local: int, cu: list[int] | None, expected: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.zeros(1, seq, 4, 64)
    monkeypatch.setattr(kernels, "fa4_applies", lambda x: True)
    assert grouped.applies(q, chunk - local, cu is not None) is expected
    # the backward kernel: the same rule without the size limit
    assert grouped.kernel_applies(q, chunk - local, cu is not None) is (expected or seq > 16384)
    monkeypatch.setattr(kernels, "fa4_applies", lambda x: False)  # CPU, other kernels
    assert grouped.applies(q, chunk - local, cu is not None) is False
    assert grouped.kernel_applies(q, chunk - local, cu is not None) is False


@pytest.mark.parametrize(("backward", "seq", "expected"), [
    ("auto", 4096, (True, True)), ("auto", 32768, (False, False)),
    ("kernel", 4096, (True, True)), ("kernel", 32768, (False, True)),
    ("parts", 4096, (False, False)), ("parts", 32768, (False, False)),
])
def test_dca_backward_setting_picks_the_paths(backward: str, seq: int, expected: tuple,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """(one call, kernel backward) per `dca_backward`, where the kernel applies (FA4, aligned)."""
    monkeypatch.setattr(kernels, "fa4_applies", lambda x: True)
    assert grouped.paths(torch.zeros(1, seq, 4, 64), 896, False, backward) == expected
    monkeypatch.setattr(kernels, "fa4_applies", lambda x: False)
    assert grouped.paths(torch.zeros(1, seq, 4, 64), 896, False, backward) == (False, False)


def test_dca_backward_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="dca_backward must be one of auto | kernel | parts"):
        grouped.paths(torch.zeros(1, 64, 2, 8), 16, False, "fast")
    q = torch.zeros(1, 64, 2, 8)
    with pytest.raises(ValueError, match="dca_backward"):
        dual_chunk_attention(q, q, q, chunk_size=16, local_size=4, backward="fast")


def test_the_choice_is_made_once_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward and the backward follow the plan's choice, not the rule at their own time
    (a benchmark forcing a path around the forward only must still time that path)."""
    monkeypatch.setattr(grouped, "applies", lambda q, length, packed: True)
    taken: list[str] = []
    monkeypatch.setattr(grouped, "forward", lambda *args: taken.append("forward") or (
        torch.zeros_like(args[0]), torch.zeros(args[0].shape[0], args[0].shape[2],
                                               args[0].shape[1], dtype=torch.float64)))
    monkeypatch.setattr(grouped, "backward", lambda plan, scale, q, k, v, *rest: taken.append(
        "backward") or (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))
    q, k, v = (torch.randn(1, 64, 2, 8, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    out = dual_chunk_attention(q, k, v, chunk_size=16, local_size=4)
    monkeypatch.setattr(grouped, "applies", lambda q, length, packed: False)
    out.sum().backward()
    assert taken == ["forward", "backward"]


def dense_kernel_backward(q_rot: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, scale: float,
                          length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fa4_backward.backward's contract in dense float64: queries are the last s_q of the s_k
    key rows; each part p meets the keys of its chunk distance (SPEC.md) with its rotated q;
    P from the merged lse, dS from the merged out (the global-LSE recipe)."""
    batch, seq_q, heads, _ = out.shape
    seq_k, heads_kv = k_rot.shape[1], k_rot.shape[2]
    parts, group = q_rot.shape[0] // batch, heads // heads_kv
    k, vv = (x.repeat_interleave(group, 2) for x in (k_rot, v))  # [b, s_k, hq, d]
    i = torch.arange(seq_k - seq_q, seq_k)[:, None]
    j = torch.arange(seq_k)[None, :]
    distance = i // length - j // length
    masks = [(distance == 0) & (j <= i), distance == 1, distance >= 2]
    q_parts = q_rot.unflatten(0, (parts, batch))
    delta = (out * dout).sum(-1).transpose(1, 2)[..., None]  # [b, hq, s_q, 1]
    dq, dk, dv = torch.zeros_like(q_parts), torch.zeros_like(k), torch.zeros_like(vv)
    for p in range(parts):
        scores = torch.einsum("bqhd,bkhd->bhqk", q_parts[p], k) * scale
        prob = torch.where(masks[p], torch.exp(scores - lse[..., None]), 0.0)
        dv += torch.einsum("bhqk,bqhd->bkhd", prob, dout)
        d_scores = prob * (torch.einsum("bqhd,bkhd->bhqk", dout, vv) - delta)
        dq[p] = torch.einsum("bhqk,bkhd->bqhd", d_scores, k) * scale
        dk += torch.einsum("bhqk,bqhd->bkhd", d_scores, q_parts[p]) * scale
    return (dq.flatten(0, 1), dk.unflatten(2, (heads_kv, group)).sum(3),
            dv.unflatten(2, (heads_kv, group)).sum(3))


@pytest.fixture
def kernel_backward_in_pieces(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """DCA's part-call forward with the kernel backward (its stand-in above, recorded as
    (query rows, key rows)), pieces of any row count (BLOCK 1)."""
    calls: list[tuple[int, int]] = []

    def recorded(q_rot, k_rot, *args):  # noqa: ANN001, ANN002, ANN202
        calls.append((q_rot.shape[1], k_rot.shape[1]))
        return dense_kernel_backward(q_rot, k_rot, *args)
    paths = grouped.paths
    monkeypatch.setattr(grouped, "kernel_applies", lambda q, length, packed: True)
    monkeypatch.setattr(grouped, "paths", lambda q, length, packed, backward: paths(
        q, length, packed, "kernel"))  # dca_backward=kernel
    monkeypatch.setattr(grouped, "MAX_TOKENS", 0)
    monkeypatch.setattr(grouped, "BLOCK", 1)
    monkeypatch.setattr(fa4_backward, "backward", recorded)
    return calls


@pytest.mark.parametrize("budget", [5, 16, 23, 10_000])
@pytest.mark.parametrize(("batch", "hq", "hk"), [(1, 2, 2), (1, 6, 2), (2, 4, 2)])
def test_kernel_backward_pieces_match_the_reference(
        budget: int, batch: int, hq: int, hk: int, monkeypatch: pytest.MonkeyPatch,
        kernel_backward_in_pieces: list[tuple[int, int]]) -> None:
    """The queries in even pieces of at most `budget` rows, the last first, each with the keys
    up to its end; gradients (dq complete per piece, dk/dv summed over pieces) are the
    reference's. 52 tokens with L = 7: 7 chunks and a tail."""
    monkeypatch.setattr(dca_backward, "rows_per_call", lambda tokens: budget)
    assert_matches_reference(batch, 52, hq, hk, 8, chunk_size=10, local_size=3)
    size = -(-52 // -(-52 // budget))  # even pieces
    expected = [(min(size, end), end) for end in range(52, 0, -size)]
    assert max(rows for rows, _ in expected) <= budget
    assert kernel_backward_in_pieces == expected


def test_kernel_backward_pieces_with_length_scaling(
        monkeypatch: pytest.MonkeyPatch,
        kernel_backward_in_pieces: list[tuple[int, int]]) -> None:
    """Llama 4's log scaling on the successive and inter parts: dq carries each part's factor
    piece by piece."""
    monkeypatch.setattr(dca_backward, "rows_per_call", lambda tokens: 13)
    seq, chunk, local = 45, 11, 3
    factors = part_factors([log_factor(p, 0.3, 6) for p in range(seq)], "succ_inter")
    check(DCAScaling("log", "succ_inter", attn_scale=0.3, floor_scale=6), factors, seq, chunk,
          local)
    assert len(kernel_backward_in_pieces) == 4
