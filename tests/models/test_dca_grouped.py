"""DCA's FA4 kernels (models/attention/dca/grouped.py, fa4_forward.py, fa4_backward.py), the
CPU-checkable half: the kernels' tile-to-part rule against the dense part masks of DCA's part table
(models/attention/dca/attention.py), when each path applies, and the rotations (made again or kept
from the forward) and the backward's pieces around the kernels, with float64 stand-ins of the
kernels' contracts, against the dense reference. The dQ accumulators: test_dca_dq_parts.py. The
kernels themselves run in tests/gpu/test_fa4_gpu.py."""

from __future__ import annotations

import pytest
import torch

from models.attention import kernels
from models.attention.dca import dispatch, fa4_backward, fa4_forward, grouped
from models.attention.dca import plan as dca_plan
from models.attention.dca.attention import dual_chunk_attention
from models.attention.dca.dq_parts import DQParts
from models.attention.dca.plan import DCAPlan, KernelPaths
from models.attention.dca.scaling import DCAScaling
from models.fused_qkv import split_grouped
from tests.models.test_dca import assert_matches_reference, dca_reference, grads, make_qkv, rel_err
from tests.models.test_dca_scaling import check, log_factor, part_factors

BLOCK = grouped.BLOCK


def part_masks(seq: int, length: int) -> torch.Tensor:
    """[3, s_q, s_k] which keys each query meets in each part, from positions."""
    pos = torch.arange(seq)
    n_q, n_k = (pos // length)[:, None], (pos // length)[None, :]
    causal = pos[None, :] <= pos[:, None]
    return torch.stack([(n_k == n_q) & causal, n_k == n_q - 1, n_k <= n_q - 2])


@pytest.mark.parametrize(("tile_m", "tile_n"), [(64, 128), (128, 128)])  # FA4's SM90 tiles
@pytest.mark.parametrize(("seq", "length"), [(2048, 256), (1536, 384), (1024, 512)])
def test_kernel_tiles_each_meet_one_part(seq: int, length: int, tile_m: int,
                                        tile_n: int) -> None:
    """The kernels' premise (fa4_forward.py: 128 x 128 tiles, fa4_backward.py: both): with L
    and S multiples of 128, a (query tile m, key tile n)
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


@pytest.mark.parametrize(("seq", "chunk", "local", "cu", "expected"), [
    (4096, 1024, 128, None, True),  # L = 896 = 7 blocks
    (32768, 8192, 1024, None, True),  # any length
    (4096, 1024, 100, None, False),  # L = 924: blocks would straddle chunks
    (4000, 1024, 128, None, False),  # a partial last block
    (4096, 1024, 128, [0, 1000, 4096], False),  # packed: chunks from the sequence's start
])
def test_kernels_apply_only_where_they_are_exact(
        seq: int, chunk: int, local: int, cu: list[int] | None, expected: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.zeros(1, seq, 4, 64)
    monkeypatch.setattr(kernels, "fa4_applies", lambda x: True)
    monkeypatch.setattr(kernels, "hopper", lambda device: True)
    applies = lambda q, packed=cu is not None: (  # noqa: E731
        dispatch.kernel_refusal(q, chunk - local, packed) is None)
    assert applies(q) is expected
    for head_dim in (192, 72, 80, 32):  # above 128; not checked on the GPU (72: wrong there)
        assert dispatch.kernel_refusal(torch.zeros(1, 4096, 4, head_dim), 896,
                                       False) == "head dim not one of (64, 96, 128)"
    for head_dim in (96, 128):
        assert applies(torch.zeros(1, seq, 4, head_dim)) is expected
    monkeypatch.setattr(kernels, "hopper", lambda device: False)  # FA4 on a later GPU
    assert "not a Hopper GPU" in dispatch.kernel_refusal(q, chunk - local, cu is not None)
    monkeypatch.setattr(kernels, "hopper", lambda device: True)
    monkeypatch.setattr(kernels, "fa4_applies", lambda x: False)  # CPU, other kernels
    assert dispatch.kernel_refusal(q, chunk - local, cu is not None) == (
        "not CUDA bf16/fp16 (DCA's kernels run through FA4)")


@pytest.mark.parametrize(("backward", "expected"), [
    ("auto", (True, False)), ("one_piece", (True, True)), ("parts", (False, False)),
])
def test_dca_backward_setting_picks_the_paths(backward: str, expected: tuple,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """(DCA's kernels, the backward in one piece) per `dca_backward`, where the kernels apply
    (FA4, aligned); the part calls where they do not."""
    monkeypatch.setattr(kernels, "fa4_applies", lambda x: True)
    monkeypatch.setattr(kernels, "hopper", lambda device: True)
    q = torch.zeros(1, 4096, 4, 64)

    def route(keep_rotated: bool = False) -> dispatch.Route:
        return dispatch.route(q, chunk_size=1024, local_size=128, longest=4096, packed=False,
                              scaled=False, backward=backward, keep_rotated=keep_rotated,
                              cuda_graphs=False)
    assert route().paths == (*expected, False)
    assert route().path == ("kernels" if expected[0] else "part_calls")
    assert route(keep_rotated=True).paths == (*expected, expected[0])  # only for the kernels
    monkeypatch.setattr(kernels, "fa4_applies", lambda x: False)
    assert route(keep_rotated=True) == (dispatch.DCAPath.PART_CALLS, (
        "not CUDA bf16/fp16 (DCA's kernels run through FA4)" if backward != "parts"
        else "dca_backward=parts"), KernelPaths())


def test_auto_backward_cuts_heads_first_within_the_memory_budget() -> None:
    """Groups of key heads where each launches at least MIN_GROUP_BLOCKS blocks (6 of 16 heads
    without GQA, 4 with 16/4 and 32/8), else all heads at once in pieces of rows (16/1; short
    sequences), never fewer than MIN_PIECE_ROWS rows; in each case the fewest within the
    budget."""
    split, cut_of = grouped.split, grouped.Split
    for seq in (32768, 131072):
        assert split(1, seq, 16, 16) == cut_of(3, seq)
        assert split(1, seq, 16, 4) == cut_of(1, seq)
        assert split(1, seq, 32, 8) == cut_of(2, seq)
        assert split(1, seq, 16, 1) == cut_of(1, seq // 4)
    assert split(1, 16384, 16, 16) == cut_of(16, 8192)  # groups of 3 heads: 384 blocks
    assert split(2, 16384, 16, 16) == cut_of(3, 16384)  # batch 2: 768 blocks
    assert split(1, 16384, 16, 4) == cut_of(1, 16384)  # one key head, 4 query heads: 512
    for kv_heads in (16, 4, 1):  # 8K: one piece
        assert split(1, 8192, 16, kv_heads) == cut_of(kv_heads, grouped.MIN_PIECE_ROWS)
    budget = grouped.MEMORY_OVER_CAUSAL
    for heads, kv_heads in ((16, 16), (16, 4), (32, 8), (12, 12), (16, 1)):
        cut = split(1, 32768, heads, kv_heads)
        groups, pieces = len(cut.head_groups(kv_heads)), -(-32768 // cut.rows)
        share = cut.kv_per_group / kv_heads
        assert grouped.memory_over_causal(share, pieces, heads, kv_heads) <= budget
        if pieces == 1:  # one group fewer would be over
            fewer = -(-kv_heads // (groups - 1)) / kv_heads
            assert grouped.memory_over_causal(fewer, 1, heads, kv_heads) > budget
        else:  # all heads at once, one piece fewer would be over
            assert share == 1
            assert grouped.memory_over_causal(share, pieces - 1, heads, kv_heads) > budget


def test_head_groups_are_even_and_cover_every_head() -> None:
    assert grouped.Split(3, 1).head_groups(16) == [
        slice(0, 2), slice(2, 5), slice(5, 8), slice(8, 10), slice(10, 13), slice(13, 16)]
    assert grouped.Split(1, 1).head_groups(4) == [slice(i, i + 1) for i in range(4)]
    assert grouped.Split(4, 1).head_groups(4) == [slice(0, 4)]


# Peak MiB of one fwd+bwd at 32K (16 heads of 128, C = 8192) on the H100, DCA's backward in
# 1-5 pieces of rows (all heads at once), then FA4 causal's
# (docs/results/dca_b2b_2026-11-27/pieces_b2b.txt)
MEASURED_PEAKS = {16: ((1798, 1220, 1030, 931, 877), 774), 4: ((1638, 1060, 870, 771, 717), 710)}


# The same, the backward in groups of at most G key heads (all rows at once): {kv_heads: ({G:
# peak}, FA4 causal's)} (docs/results/dca_heads_2026-11-27/cuts_32k.txt)
MEASURED_GROUP_PEAKS = {16: ({4: 931, 3: 859, 2: 786, 1: 714}, 774), 4: ({2: 996, 1: 675}, 710)}


def test_memory_model_matches_the_measured_peaks() -> None:
    for kv_heads, (peaks, causal) in MEASURED_PEAKS.items():
        for count, peak in enumerate(peaks, 1):
            model = grouped.memory_over_causal(1, count, 16, kv_heads)
            assert model == pytest.approx(peak / causal - 1, abs=0.02), (kv_heads, count)
    for kv_heads, (group_peaks, causal) in MEASURED_GROUP_PEAKS.items():
        for size, peak in group_peaks.items():
            largest = -(-kv_heads // -(-kv_heads // size))  # of the even groups
            model = grouped.memory_over_causal(largest / kv_heads, 1, 16, kv_heads)
            assert model == pytest.approx(peak / causal - 1, abs=0.02), (kv_heads, size)


def test_dca_backward_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="dca_backward must be one of auto | one_piece | parts"):
        dispatch.route(torch.zeros(1, 64, 2, 8), chunk_size=16, local_size=4, longest=64,
                       packed=False, scaled=False, backward="fast", keep_rotated=False,
                       cuda_graphs=False)
    q = torch.zeros(1, 64, 2, 8)
    with pytest.raises(ValueError, match="dca_backward"):
        dual_chunk_attention(q, q, q, chunk_size=16, local_size=4, backward="fast")


def test_the_choice_is_made_once_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward and the backward follow the plan's choice, not the rule at their own time
    (a benchmark forcing a path around the forward only must still time that path)."""
    monkeypatch.setattr(dispatch, "kernel_refusal", lambda q, length, packed: None)
    taken: list[str] = []
    monkeypatch.setattr(grouped, "forward", lambda *args: taken.append("forward") or (
        torch.zeros_like(args[0]), torch.zeros(args[0].shape[0], args[0].shape[2],
                                               args[0].shape[1], dtype=torch.float64), None))
    monkeypatch.setattr(grouped, "backward", lambda plan, scale, q, k, v, out, lse, dout, cut,
                        grads, rotated: taken.append(f"backward({cut.kv_per_group}, {cut.rows})")
                        or (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))
    q, k, v = (torch.randn(1, 64, 2, 8, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    out = dual_chunk_attention(q, k, v, chunk_size=16, local_size=4, backward="one_piece")
    monkeypatch.setattr(dispatch, "kernel_refusal", lambda q, length, packed: "no")
    monkeypatch.setattr(grouped, "split", lambda *shape: grouped.Split(1, 1))
    out.sum().backward()
    assert taken == ["forward", "backward(2, 64)"]  # in one piece, as planned


def dense_kernel_forward(q_rot: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
                         scale: float, length: int, successive_rows: int, out: torch.Tensor,
                         lse: torch.Tensor) -> None:
    """fa4_forward.forward's contract in dense float64: queries are the last s_q of the s_k key
    rows; each part p meets the keys of its chunk distance with its rotated q, the
    successive part from the inter copy past a chunk's first `successive_rows` rows; one
    softmax over all of them, out and lse written in place."""
    batch, seq_q, heads, _ = out.shape
    seq_k, heads_kv = k_rot.shape[1], k_rot.shape[2]
    parts, group = q_rot.shape[0] // batch, heads // heads_kv
    k, vv = (x.repeat_interleave(group, 2) for x in (k_rot, v))  # [b, s_k, hq, d]
    q_parts = q_rot.unflatten(0, (parts, batch))
    scores = torch.full((batch, heads, seq_q, seq_k), -torch.inf, dtype=q_rot.dtype)
    for p, mask in enumerate(_part_masks(seq_q, seq_k, length, successive_rows)[:parts]):
        part_scores = torch.einsum("bqhd,bkhd->bhqk", q_parts[p], k) * scale
        scores = torch.where(mask, part_scores, scores)
    lse.copy_(torch.logsumexp(scores, -1))
    out.copy_(torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), vv))


def _part_masks(seq_q: int, seq_k: int, length: int,
                successive_rows: int) -> list[torch.Tensor]:
    """[s_q, s_k] per part (the last part taking every farther chunk, and the successive
    pairs of queries past their chunk's first successive_rows rows), queries being the last s_q
    of the s_k rows."""
    i = torch.arange(seq_k - seq_q, seq_k)[:, None]
    j = torch.arange(seq_k)[None, :]
    distance = i // length - j // length
    shared = (distance == 1) & (i % length >= successive_rows)
    return [(distance == 0) & (j <= i), (distance == 1) & ~shared, (distance >= 2) | shared]


def dense_kernel_backward(q_rot: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, scale: float,
                          length: int, successive_rows: int, dk_out: torch.Tensor,
                          dv_out: torch.Tensor, accumulate: bool) -> DQParts:
    """fa4_backward.backward's contract in dense float64: queries are the last s_q of the s_k
    key rows; each part p meets the keys of its chunk distance with its rotated q,
    the successive part from the inter copy past a chunk's first `successive_rows` rows; P
    from the merged lse, dS from the merged out (the global-LSE recipe). dK and dV are written
    to (or added to) dk_out, dv_out, or with GQA added, dK unscaled, to the sums of
    `rows_kv_accumulators`; each part's dQ is returned unscaled, in rows, the successive
    part's NaN where it holds none (the kernel neither zeroes nor writes those rows)."""
    batch, seq_q, heads, head_dim = out.shape
    seq_k, heads_kv = k_rot.shape[1], k_rot.shape[2]
    parts, group = q_rot.shape[0] // batch, heads // heads_kv
    k, vv = (x.repeat_interleave(group, 2) for x in (k_rot, v))  # [b, s_k, hq, d]
    masks = _part_masks(seq_q, seq_k, length, successive_rows)
    q_parts = q_rot.unflatten(0, (parts, batch))
    delta = (out * dout).sum(-1).transpose(1, 2)[..., None]  # [b, hq, s_q, 1]
    dq, dk, dv = torch.zeros_like(q_parts), torch.zeros_like(k), torch.zeros_like(vv)
    for p in range(parts):
        scores = torch.einsum("bqhd,bkhd->bhqk", q_parts[p], k) * scale
        prob = torch.where(masks[p], torch.exp(scores - lse[..., None]), 0.0)
        dv += torch.einsum("bhqk,bqhd->bkhd", prob, dout)
        d_scores = prob * (torch.einsum("bqhd,bkhd->bhqk", dout, vv) - delta)
        dq[p] = torch.einsum("bhqk,bkhd->bqhd", d_scores, k)
        dk += torch.einsum("bhqk,bqhd->bkhd", d_scores, q_parts[p])
    if parts == 3:
        dq[1, :, torch.arange(seq_k - seq_q, seq_k) % length >= successive_rows] = torch.nan
    for grad, total, grad_scale in ((dk, dk_out, scale), (dv, dv_out, 1.0)):
        grad = grad.unflatten(2, (heads_kv, group)).sum(3)
        if group > 1:  # FA4's float32 sums, converted (and dK scaled) by store_kv
            total[:, :seq_k] += grad
        else:
            total.copy_(total + grad * grad_scale if accumulate else grad * grad_scale)
    data = dq.flatten(0, 1).transpose(1, 2).reshape(parts * batch, heads, seq_q * head_dim)
    return DQParts(data, "rows")


@pytest.mark.parametrize(("seq", "chunk", "local", "kernels", "scaling", "expected"), [
    (32768, 8192, 1024, True, "none", 1024),  # the goal shapes: rows from 1024 on share
    (4096, 1088, 192, True, "none", 256),  # w in whole kernel blocks
    (32768, 8192, 1024, False, "none", 7168),  # the part calls: every part its own
    (4096, 1024, 768, True, "none", 256),  # inter at 2L - 1 = 511, not C: nothing shared
    (4096, 1024, 128, True, "log", 896),  # a factor per part: nothing shared
    (1792, 1024, 128, True, "none", 896),  # two chunks: no inter part
])
def test_successive_rows_share_the_inter_copy_only_where_it_is_the_same(
        seq: int, chunk: int, local: int, kernels: bool, scaling: str, expected: int) -> None:
    """DCAPlan.successive_rows, and part_positions -1 exactly where the successive position
    equals the inter one (each chunk's rows from successive_rows on)."""
    q = torch.zeros(1, seq, 1, 8)
    dca = DCAPlan(q, chunk, local, 10000.0, 1.0, None,
                  DCAScaling(scaling, "succ_inter", 0.1, 512), paths=KernelPaths(kernels))
    assert dca.successive_rows == expected
    shared = dca.part_positions[1] < 0
    r = torch.arange(seq) % dca.length
    assert torch.equal(shared, (r >= expected) & (dca.num_parts == 3))
    assert torch.equal(dca.part_positions[:, ~shared], dca.positions[:, ~shared])
    if shared.any():  # the successive rotation there is the inter one
        assert (dca.positions[1, shared] == dca.positions[2, shared]).all()


def rows_kv_accumulators(k_rot: torch.Tensor, v: torch.Tensor,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """fa4_backward.kv_accumulators's contract, in rows: zeroed sums like k_rot and v."""
    return torch.zeros_like(k_rot), torch.zeros_like(v)


def rows_store_kv(sums: tuple[torch.Tensor, torch.Tensor], dk: torch.Tensor, dv: torch.Tensor,
                  scale: float) -> None:
    """fa4_backward.store_kv's contract, in rows: dk = scale * sums[0], dv = sums[1]."""
    dk.copy_(sums[0] * scale)
    dv.copy_(sums[1])


@pytest.fixture
def kernel_backward_in_pieces(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """DCA's kernels (their stand-ins above), the backward's calls recorded as (query rows, key
    rows, query heads), in pieces of any row count (BLOCK 1)."""
    calls: list[tuple[int, int, int]] = []

    def recorded(q_rot, k_rot, *args):  # noqa: ANN001, ANN002, ANN202
        calls.append((q_rot.shape[1], k_rot.shape[1], q_rot.shape[2]))
        return dense_kernel_backward(q_rot, k_rot, *args)
    monkeypatch.setattr(dispatch, "kernel_refusal", lambda q, length, packed: None)
    monkeypatch.setattr(grouped, "BLOCK", 1)
    monkeypatch.setattr(dca_plan, "KERNEL_BLOCK", 1)
    monkeypatch.setattr(fa4_backward, "backward", recorded)
    monkeypatch.setattr(fa4_backward, "kv_accumulators", rows_kv_accumulators)
    monkeypatch.setattr(fa4_backward, "store_kv", rows_store_kv)
    monkeypatch.setattr(fa4_forward, "forward", dense_kernel_forward)
    return calls


@pytest.mark.parametrize("budget", [5, 16, 23, 10_000])
@pytest.mark.parametrize("group_size", [1, 2, 8])  # key heads per group
@pytest.mark.parametrize(("batch", "hq", "hk"), [(1, 2, 2), (1, 6, 2), (2, 4, 2), (1, 3, 3)])
def test_kernel_backward_pieces_match_the_reference(
        budget: int, group_size: int, batch: int, hq: int, hk: int,
        monkeypatch: pytest.MonkeyPatch,
        kernel_backward_in_pieces: list[tuple[int, int, int]]) -> None:
    """Key heads in even groups of at most `group_size` (each with its query heads), each
    group's queries in even pieces of at most `budget` rows, the last first, each with the keys
    up to its end; gradients (every head's from its group, dq complete per piece, dk/dv summed
    over pieces) are the reference's. 52 tokens with L = 7: 7 chunks and a tail."""
    monkeypatch.setattr(grouped, "split", lambda *shape: grouped.Split(group_size, budget))
    assert_matches_reference(batch, 52, hq, hk, 8, chunk_size=10, local_size=3)
    groups = -(-hk // group_size)
    sizes = [hk * (i + 1) // groups - hk * i // groups for i in range(groups)]
    size = -(-52 // -(-52 // budget))  # even pieces
    expected = [(min(size, end), end, kv * hq // hk) for kv in sizes
                for end in range(52, 0, -size)]
    assert max(rows for rows, _, _ in expected) <= budget
    assert kernel_backward_in_pieces == expected


def test_kernel_backward_pieces_with_length_scaling(
        monkeypatch: pytest.MonkeyPatch,
        kernel_backward_in_pieces: list[tuple[int, int, int]]) -> None:
    """Llama 4's log scaling on the successive and inter parts: dq carries each part's factor
    piece by piece and head group by head group."""
    monkeypatch.setattr(grouped, "split", lambda *shape: grouped.Split(1, 13))
    seq, chunk, local = 45, 11, 3
    factors = part_factors([log_factor(p, 0.3, 6) for p in range(seq)], "succ_inter")
    check(DCAScaling("log", "succ_inter", attn_scale=0.3, floor_scale=6), factors, seq, chunk,
          local)
    assert len(kernel_backward_in_pieces) == 4 * 2  # check's heads: 4 query, 2 key


@pytest.mark.parametrize(("batch", "hq", "hk"), [(1, 2, 2), (1, 6, 2), (2, 4, 2)])
@pytest.mark.parametrize("seq", [20, 52])  # two chunks (two parts), 7 chunks and a tail
def test_kernel_forward_matches_the_reference(
        batch: int, hq: int, hk: int, seq: int, monkeypatch: pytest.MonkeyPatch,
        kernel_backward_in_pieces: list[tuple[int, int]]) -> None:
    """The forward kernel's rotations around it (every part's q, part-major; k) and its one
    call; L = 7."""
    calls: list[int] = []
    monkeypatch.setattr(fa4_forward, "forward", lambda q_rot, *args: calls.append(
        q_rot.shape[0]) or dense_kernel_forward(q_rot, *args))
    assert_matches_reference(batch, seq, hq, hk, 8, chunk_size=10, local_size=3)
    assert calls == [batch * min(3, -(-seq // 7))]  # one call, every part


@pytest.mark.parametrize(("hq", "hk"), [(2, 2), (6, 2)])
@pytest.mark.parametrize("group_size", [1, 2])  # key heads per backward group
def test_kernels_on_query_heads_in_their_groups(
        hq: int, hk: int, group_size: int, monkeypatch: pytest.MonkeyPatch,
        kernel_backward_in_pieces: list[tuple[int, int, int]]) -> None:
    """q as GroupedQuerySelfAttention hands it over (models/fused_qkv.py): views of megatron's
    projection [s, b, hk, (hq / hk + 2) d], the query heads in their groups, read by the
    rotations in place; dq, dk and dv written into one gradient of the projection's layout,
    which the split returns whole. Against the same call on 4-D copies (L = 7, 52 tokens)."""
    monkeypatch.setattr(grouped, "split", lambda *shape: grouped.Split(group_size, 13))
    seq, d, g = 52, 8, hq // hk
    fused = torch.randn(seq, 2, hk, (g + 2) * d, dtype=torch.float64, requires_grad=True)
    seen = []
    fused.register_hook(seen.append)
    q, k, v = (x.transpose(0, 1) for x in split_grouped(fused, g))  # [b, s, ...]
    out = dual_chunk_attention(q, k, v, chunk_size=10, local_size=3)
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, fused, dout)
    assert seen[0]._base is not None  # the slots' tensor, not an assembled copy
    flat = [x.detach().clone().requires_grad_() for x in (q.flatten(2, 3), k, v)]
    expected = dual_chunk_attention(*flat, chunk_size=10, local_size=3)
    torch.testing.assert_close(out, expected)
    dq, dk, dv = torch.autograd.grad(expected, flat, dout)
    q_grad, k_grad, v_grad = (x.transpose(0, 1) for x in split_grouped(grad, g))
    torch.testing.assert_close((q_grad.flatten(2, 3), k_grad, v_grad), (dq, dk, dv))


@pytest.mark.parametrize(("batch", "hq", "hk", "group_size", "budget"), [
    (1, 2, 2, 1, 13), (1, 6, 2, 1, 52), (2, 4, 2, 2, 23),
])
def test_kernel_backward_reads_the_rotations_the_forward_kept(
        batch: int, hq: int, hk: int, group_size: int, budget: int,
        monkeypatch: pytest.MonkeyPatch,
        kernel_backward_in_pieces: list[tuple[int, int, int]]) -> None:
    """keep_rotated: the backward's kernel calls (every group and piece) read the forward's
    rotated q and k, never rotating again, and the gradients are the reference's (the kept
    successive copy's unwritten rows included: the stand-ins read them nowhere)."""
    monkeypatch.setattr(grouped, "split", lambda *shape: grouped.Split(group_size, budget))
    rotations: list[str] = []
    for name in ("rotate_parts", "rotate_k"):
        method = getattr(DCAPlan, name)
        monkeypatch.setattr(DCAPlan, name, lambda self, *args, _m=method, _n=name: (
            rotations.append(_n) or _m(self, *args)))
    q, k, v = make_qkv(batch, 52, hq, hk, 8)
    out = dual_chunk_attention(q, k, v, chunk_size=10, local_size=3, keep_rotated=True)
    ref = dca_reference(q, k, v, 10, 3)
    assert rel_err(out, ref) < 1e-10
    for ours, expected in zip(grads(out, [q, k, v]), grads(ref, [q, k, v])):
        assert rel_err(ours, expected) < 1e-10
    assert rotations == ["rotate_parts", "rotate_k"]  # the forward's, once
    pieces = -(-hk // group_size) * -(-52 // budget)
    assert len(kernel_backward_in_pieces) == pieces
    rotations.clear()  # without keeping: the forward's, then one per piece
    assert_matches_reference(batch, 52, hq, hk, 8, chunk_size=10, local_size=3)
    assert rotations.count("rotate_parts") == 1 + pieces


def test_kept_rotations_serve_query_heads_in_their_groups(
        monkeypatch: pytest.MonkeyPatch,
        kernel_backward_in_pieces: list[tuple[int, int, int]]) -> None:
    """keep_rotated with q in its groups (models/fused_qkv.py): the kept copies are in the
    flat head order the backward's groups slice; the gradient is the one without keeping."""
    monkeypatch.setattr(grouped, "split", lambda *shape: grouped.Split(1, 13))
    seq, d, hk, g = 52, 8, 2, 3
    fused = torch.randn(seq, 2, hk, (g + 2) * d, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, seq, hk * g, d, dtype=torch.float64)
    grads = []
    for keep in (True, False):
        q, k, v = (x.transpose(0, 1) for x in split_grouped(fused, g))
        out = dual_chunk_attention(q, k, v, chunk_size=10, local_size=3, keep_rotated=keep)
        grads.append(torch.autograd.grad(out, fused, dout)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_kept_rotations_are_not_held_across_a_recompute(
        monkeypatch: pytest.MonkeyPatch,
        kernel_backward_in_pieces: list[tuple[int, int, int]]) -> None:
    """keep_rotated inside a recomputed layer (models/recompute.py): the checkpointed forward
    keeps only (out, lse), the recompute reuses them without the forward kernel, and the
    backward rotates q and k itself; the gradients are the reference's."""
    from models import recompute
    monkeypatch.setattr(recompute, "is_checkpointing", lambda: True)
    monkeypatch.setattr(grouped, "split", lambda *shape: grouped.Split(1, 52))
    rotations: list[str] = []
    method = DCAPlan.rotate_parts
    monkeypatch.setattr(DCAPlan, "rotate_parts", lambda self, *args: (
        rotations.append("rotate_parts") or method(self, *args)))
    keeper = recompute.AttentionKeeper()
    q, k, v = make_qkv(1, 52, 4, 2, 8)
    with torch.no_grad(), keeper.scope(True):  # the checkpointed forward: record
        dual_chunk_attention(q, k, v, chunk_size=10, local_size=3, keep_rotated=True)
    assert len(keeper) == 1 and rotations == ["rotate_parts"]
    with keeper.scope(True):  # the recompute: replay
        out = dual_chunk_attention(q, k, v, chunk_size=10, local_size=3, keep_rotated=True)
    assert len(keeper) == 0 and rotations == ["rotate_parts"]  # no forward kernel
    ref = dca_reference(q, k, v, 10, 3)
    for ours, expected in zip(grads(out, [q, k, v]), grads(ref, [q, k, v])):
        assert rel_err(ours, expected) < 1e-10
    assert rotations == ["rotate_parts"] * 3  # the backward's, one per group of heads
