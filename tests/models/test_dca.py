"""Dual Chunk Attention against a dense float64 reference built from DCA's position table
(models/attention/dca/attention.py).

The reference rotates every (query i, key j) pair explicitly: the key to r_j, the query to the
position its part prescribes (intra r_i, successive min(r_i + L, C), inter min(2L - 1, C)), then
takes one softmax over all allowed keys. It shares no code with models.attention.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from models.attention.dca import attention as dca
from models.attention.dca import dispatch
from models.attention.dca.attention import dual_chunk_attention
from models.attention.dca.plan import DCAPlan
from models.attention.dca.scaling import DCAScaling
from tests.reference import (
    causal_mask,
    dense_attention,
    document_ids,
    positions_in_document,
    rope_rotate,
)


def dca_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int,
                  local_size: int, theta: float = 10000.0, mscale: float = 1.0,
                  softmax_scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
                  table_rows: int | None = None,
                  part_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Dense DCA in float64; `table_rows` clamps positions to a too-short RoPE table (the trap).

    `part_factors` [s, 3]: multiplies the logit of (query i, key j) by part_factors[i, part of
    (i, j)] (0 intra, 1 successive, 2 inter), the length-dependent scaling's definition.
    """
    batch, seq, hq, d = q.shape
    length = chunk_size - local_size
    if cu_seqlens is None:
        pos, doc = torch.arange(seq), torch.zeros(seq, dtype=torch.long)
    else:
        pos, doc = positions_in_document(cu_seqlens), document_ids(cu_seqlens)
    n, r = pos // length, pos % length
    same = n[:, None] == n[None, :]
    previous = n[None, :] == n[:, None] - 1
    q_pos = torch.where(same, r[:, None],  # [s_i, s_j], the table's query column
                        torch.where(previous, torch.clamp(r[:, None] + length, max=chunk_size),
                                    torch.full((seq, seq), min(2 * length - 1, chunk_size))))
    k_pos = r
    if table_rows is not None:
        q_pos, k_pos = q_pos.clamp(max=table_rows - 1), k_pos.clamp(max=table_rows - 1)
    allowed = causal_mask(seq) & (doc[:, None] == doc[None, :])
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    if part_factors is None:
        logit_factor = torch.ones(seq, seq, dtype=torch.float64)
    else:
        part = torch.where(same, 0, torch.where(previous, 1, 2))  # [s_i, s_j]
        logit_factor = part_factors.double().gather(1, part)
    groups = hq // k.shape[2]
    outs = []
    for b in range(batch):
        qb = q[b].double().unsqueeze(1).expand(seq, seq, hq, d)  # [s_i, s_j, h, d]
        q_rot = rope_rotate(qb, q_pos, theta, mscale)  # query i rotated for key j
        k_rot = rope_rotate(k[b:b + 1], k_pos, theta, mscale)[0]  # [s_j, hk, d]
        k_rot = k_rot.repeat_interleave(groups, dim=1)
        scores = torch.einsum("ijhd,jhd->hij", q_rot, k_rot) * scale * logit_factor
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = scores.softmax(dim=-1)
        vb = v[b].double().repeat_interleave(groups, dim=1)  # [s_j, h, d]
        outs.append(torch.einsum("hij,jhd->ihd", probs, vb))
    return torch.stack(outs)


def make_qkv(batch: int, seq: int, hq: int, hk: int, d: int, seed: int = 0,
             dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, seq, h, d, generator=gen, dtype=dtype).requires_grad_()
            for h in (hq, hk, hk)]


def grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64).to(out.dtype)
    return list(torch.autograd.grad(out, inputs, dout))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def assert_matches_reference(batch: int, seq: int, hq: int, hk: int, d: int, chunk_size: int,
                             local_size: int, tol: float = 1e-10, **kwargs) -> None:
    q, k, v = make_qkv(batch, seq, hq, hk, d)
    ours = dual_chunk_attention(q, k, v, chunk_size=chunk_size, local_size=local_size, **kwargs)
    rename = {"rope_theta": "theta"}
    ref = dca_reference(q, k, v, chunk_size, local_size,
                        **{rename.get(key, key): val for key, val in kwargs.items()})
    assert ours.shape == q.shape and ours.dtype == q.dtype
    assert rel_err(ours, ref) < tol
    for g_ours, g_ref in zip(grads(ours, [q, k, v]), grads(ref, [q, k, v])):
        assert rel_err(g_ours, g_ref) < tol


def test_one_chunk_equals_causal_rope_attention() -> None:
    q, k, v = make_qkv(2, 12, 4, 4, 8)
    ours = dual_chunk_attention(q, k, v, chunk_size=16, local_size=4)  # L = 12 >= S
    pos = torch.arange(12)
    plain = dense_attention(rope_rotate(q, pos), rope_rotate(k, pos), v, causal_mask(12))
    assert rel_err(ours, plain) < 1e-12
    for g_ours, g_plain in zip(grads(ours, [q, k, v]), grads(plain, [q, k, v])):
        assert rel_err(g_ours, g_plain) < 1e-12
    assert_matches_reference(2, 12, 4, 4, 8, chunk_size=16, local_size=4)


def test_two_chunks() -> None:
    assert_matches_reference(1, 20, 2, 2, 8, chunk_size=12, local_size=2)  # L = 10


def test_many_chunks() -> None:
    assert_matches_reference(1, 48, 2, 2, 8, chunk_size=11, local_size=3)  # 6 chunks of 8


def test_seq_not_multiple_of_chunk_length() -> None:
    assert_matches_reference(2, 45, 2, 2, 8, chunk_size=11, local_size=3)  # 5 chunks + 5


def test_gqa() -> None:
    assert_matches_reference(1, 40, 6, 2, 8, chunk_size=10, local_size=3)
    assert_matches_reference(1, 30, 4, 1, 8, chunk_size=10, local_size=3)


def test_packed_sequences() -> None:
    cu = torch.tensor([0, 5, 30, 31, 52], dtype=torch.int32)  # 1, 4, 1 and 3 chunks of L = 7
    assert_matches_reference(1, 52, 4, 2, 8, chunk_size=10, local_size=3, cu_seqlens=cu)
    q, k, v = make_qkv(1, 52, 4, 2, 8)
    packed = dual_chunk_attention(q, k, v, chunk_size=10, local_size=3, cu_seqlens=cu)
    alone = dual_chunk_attention(q[:, 5:30], k[:, 5:30], v[:, 5:30], chunk_size=10, local_size=3)
    assert rel_err(packed[:, 5:30], alone) < 1e-12  # a document does not see its neighbours


def test_mscale_theta_and_softmax_scale() -> None:
    assert_matches_reference(1, 33, 2, 2, 8, chunk_size=9, local_size=2, mscale=1.3,
                             rope_theta=500.0, softmax_scale=0.2)


def test_largest_position_c_is_used() -> None:
    # C = 10, L = 7: successive queries with r >= 3 and every inter query sit at position C.
    q, k, v = make_qkv(1, 28, 2, 2, 8)
    ours = dual_chunk_attention(q, k, v, chunk_size=10, local_size=3)
    right = dca_reference(q, k, v, 10, 3)
    short_table = dca_reference(q, k, v, 10, 3, table_rows=10)  # rows 0..C-1 only
    assert rel_err(ours, right) < 1e-10
    assert rel_err(short_table, right) > 1e-3


def detached_merge_dca(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int,
                       local_size: int) -> torch.Tensor:
    """The public implementations' merge: per-part softmax, merge weights from *detached* LSEs."""
    seq, d = q.shape[1], q.shape[-1]
    length = chunk_size - local_size
    pos = torch.arange(seq)
    n, r = pos // length, pos % length
    masks = [causal_mask(seq) & (n[:, None] == n[None, :]),
             n[None, :] == n[:, None] - 1,
             n[None, :] <= n[:, None] - 2]
    q_pos = [r, torch.clamp(r + length, max=chunk_size),
             torch.full((seq,), min(2 * length - 1, chunk_size))]
    k_rot = rope_rotate(k, r)
    outs, lses = [], []
    for mask, qp in zip(masks, q_pos):
        q_rot = rope_rotate(q, qp)
        scores = torch.einsum("bihd,bjhd->bhij", q_rot, k_rot) * d ** -0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        lses.append(scores.logsumexp(dim=-1))  # [b, h, s]; -inf where the part is empty
        outs.append(dense_attention(q_rot, k_rot, v, mask | ~mask.any(-1, keepdim=True)))
    lse = torch.stack(lses).logsumexp(dim=0)
    weights = [(part - lse).exp().detach().transpose(1, 2).unsqueeze(-1) for part in lses]
    return sum(w * o for w, o in zip(weights, outs))


def test_detached_lse_merge_gives_wrong_dq() -> None:
    q, k, v = make_qkv(1, 30, 2, 2, 8)
    ref = dca_reference(q, k, v, 10, 3)
    detached = detached_merge_dca(q, k, v, 10, 3)
    ours = dual_chunk_attention(q, k, v, chunk_size=10, local_size=3)
    assert rel_err(detached, ref) < 1e-10  # the forward is right ...
    dq_ref, dk_ref, _ = grads(ref, [q, k, v])
    dq_det, dk_det, _ = grads(detached, [q, k, v])
    dq_ours, dk_ours, _ = grads(ours, [q, k, v])
    assert rel_err(dq_det, dq_ref) > 0.05  # ... the gradients are not
    assert rel_err(dk_det, dk_ref) > 0.05
    assert rel_err(dq_ours, dq_ref) < 1e-10 and rel_err(dk_ours, dk_ref) < 1e-10


def test_float32_math_path() -> None:
    q, k, v = make_qkv(1, 40, 4, 2, 16, dtype=torch.float32)
    ours = dual_chunk_attention(q, k, v, chunk_size=12, local_size=4)
    ref = dca_reference(q, k, v, 12, 4)
    assert ours.dtype == torch.float32 and rel_err(ours, ref) < 1e-5
    for g_ours, g_ref in zip(grads(ours, [q, k, v]), grads(ref, [q, k, v])):
        assert rel_err(g_ours, g_ref) < 1e-5


def test_non_contiguous_inputs() -> None:
    q, k, v = make_qkv(1, 26, 2, 2, 8)
    k_t, v_t = (x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
                for x in (k, v))  # an sbhd buffer viewed as bshd
    q_s = torch.stack([q.detach(), q.detach()], dim=3)[..., 0, :].requires_grad_()  # strided heads
    ours = dual_chunk_attention(q_s, k_t, v_t, chunk_size=9, local_size=2)
    ref = dca_reference(q, k, v, 9, 2)
    assert rel_err(ours, ref) < 1e-10
    for g_ours, g_ref in zip(grads(ours, [q_s, k_t, v_t]), grads(ref, [q, k, v])):
        assert rel_err(g_ours, g_ref) < 1e-10


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"chunk_size": 64, "local_size": 64}, r"chunk_size \(64\) must exceed local_size \(64\)"),
    ({"chunk_size": 0, "local_size": 4}, "chunk_size must be a positive integer"),
    ({"chunk_size": 16, "local_size": -1}, "local_size must be a positive integer"),
    ({"chunk_size": 16.0, "local_size": 4}, "chunk_size must be a positive integer"),
    ({"chunk_size": 16, "local_size": 4, "rope_theta": 0.0}, "rope_theta must be positive"),
    ({"chunk_size": 16, "local_size": 4, "cu_seqlens": [0, 3, 9]}, r"run from 0 to seq \(8\)"),
    ({"chunk_size": 16, "local_size": 4, "cu_seqlens": [0, 5, 3, 8]}, "non-decreasing"),
])
def test_bad_arguments(kwargs: dict, message: str) -> None:
    q, k, v = make_qkv(1, 8, 4, 2, 8)
    with pytest.raises(ValueError, match=message):
        dual_chunk_attention(q, k, v, **kwargs)


def test_bad_shapes() -> None:
    q, k, v = make_qkv(1, 8, 4, 2, 8)
    with pytest.raises(ValueError, match=r"kv heads \(3\) must divide query heads \(4\)"):
        dual_chunk_attention(q, k[:, :, :1].expand(1, 8, 3, 8), v[:, :, :1].expand(1, 8, 3, 8),
                             chunk_size=16, local_size=4)
    with pytest.raises(ValueError, match="must agree in batch, seq and head_dim"):
        dual_chunk_attention(q[:, :6], k, v, chunk_size=16, local_size=4)
    with pytest.raises(ValueError, match="same shape"):
        dual_chunk_attention(q, k, v[:, :, :1], chunk_size=16, local_size=4)
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        dual_chunk_attention(q[0], k[0], v[0], chunk_size=16, local_size=4)
    with pytest.raises(ValueError, match="need batch 1"):
        q2, k2, v2 = make_qkv(2, 8, 2, 2, 8)
        dual_chunk_attention(q2, k2, v2, chunk_size=16, local_size=4, cu_seqlens=[0, 8])


def _general_path(q, k, v, chunk_size: int, local_size: int, cu_seqlens=None) -> torch.Tensor:
    """DCA through the per-part kernels, bypassing the S <= C shortcut."""
    bounds = None if cu_seqlens is None else cu_seqlens.tolist()
    plan = DCAPlan(q, chunk_size, local_size, 10000.0, 1.0, bounds, DCAScaling())
    return dca._DualChunkAttention.apply(q, k, v, plan, q.shape[-1] ** -0.5, None)


@pytest.mark.parametrize(("seq", "cu"), [(12, None), (16, None), (10, None),
                                         (40, [0, 16, 17, 30, 40])])
def test_documents_within_a_chunk_take_one_causal_call(seq: int, cu: list[int] | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """C = 16, w = 4 (L = 12): documents of up to 16 tokens span chunks 0 and 1 at most; the
    shortcut (one causal call at the document's positions) equals the per-part computation."""
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    q, k, v = make_qkv(1, seq, 4, 2, 8)
    general = _general_path(q, k, v, 16, 4, cu_seqlens)
    expected = grads(general, [q, k, v])
    monkeypatch.setattr(dca._DualChunkAttention, "apply", None)  # the shortcut must not need it
    ours = dual_chunk_attention(q, k, v, chunk_size=16, local_size=4, cu_seqlens=cu_seqlens)
    assert rel_err(ours, general) < 1e-12
    for g_ours, g_general in zip(grads(ours, [q, k, v]), expected):
        assert rel_err(g_ours, g_general) < 1e-12
    assert_matches_reference(1, seq, 4, 2, 8, chunk_size=16, local_size=4, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize(("seq", "local_size", "scaling"), [
    (17, 4, "none"),  # longer than C
    (16, 10, "none"),  # C = 16, L = 6: token 12 on is in chunk 2 (inter part)
    (16, 4, "log"),  # a logit factor per part
])
def test_the_shortcut_is_not_taken_where_dca_is_not_causal(seq: int, local_size: int,
                                                           scaling: str) -> None:
    q, _, _ = make_qkv(1, seq, 2, 2, 8)
    route = dispatch.route(q, chunk_size=16, local_size=local_size, longest=seq, packed=False,
                           scaled=DCAScaling(kind=scaling, floor_scale=4).active,
                           backward="auto", keep_rotated=False, cuda_graphs=False)
    assert route.path != dispatch.DCAPath.PLAIN_CAUSAL
    assert dispatch.route(q, chunk_size=16, local_size=4, longest=16, packed=False, scaled=False,
                          backward="auto", keep_rotated=False,
                          cuda_graphs=False).path == dispatch.DCAPath.PLAIN_CAUSAL  # the shortcut


@pytest.mark.parametrize(("hq", "hk", "cu"), [(2, 2, None), (6, 2, None),
                                              (4, 2, [0, 5, 30, 31, 52])])
def test_forward_rotates_one_query_at_a_time(hq: int, hk: int, cu: list[int] | None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward rotates all of q for one part at a time and drops it before the next part;
    the backward rotates only the rows of each kernel call (test_dca_backward.py), never all
    of q. Packed documents included."""
    rotations: list[weakref.ref] = []
    rotate_q = DCAPlan.rotate_q

    def tracked(plan: DCAPlan, q: torch.Tensor, part: int,
                rows: slice = slice(None)) -> torch.Tensor:
        if rows != slice(None):  # a row range: the backward's per-call rotation
            return rotate_q(plan, q, part, rows)
        assert all(ref() is None for ref in rotations), "an earlier part's rotated q is alive"
        q_rot = rotate_q(plan, q, part)
        rotations.append(weakref.ref(q_rot))
        return q_rot

    monkeypatch.setattr(DCAPlan, "rotate_q", tracked)
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    q, k, v = make_qkv(1, 52, hq, hk, 8)
    out = dual_chunk_attention(q, k, v, chunk_size=10, local_size=3, cu_seqlens=cu_seqlens)
    grads(out, [q, k, v])
    assert len(rotations) == 3  # all of q: three parts in the forward, none in the backward


@pytest.mark.parametrize(("hq", "hk"), [(2, 2), (6, 2)])
def test_token_major_kernel_gradients(hq: int, hk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN returns gradients in its inputs' (token-major) layout, which the backward reads as
    one piece per call; the math kernel's head-major ones are read block by block. Both give
    the reference's gradients."""
    from models.attention.dca import backward as dca_backward

    kernel = dca_backward.attention_backward

    def token_major(*args, **kwargs) -> tuple[torch.Tensor, ...]:
        return tuple(g.transpose(1, 2).contiguous().transpose(1, 2)
                     for g in kernel(*args, **kwargs))

    monkeypatch.setattr(dca_backward, "attention_backward", token_major)
    assert_matches_reference(1, 45, hq, hk, 8, chunk_size=11, local_size=3)
    assert_matches_reference(2, 30, hq, hk, 8, chunk_size=8, local_size=2)
