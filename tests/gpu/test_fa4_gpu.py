"""Every FlashAttention-4 path (trainer.attention_kernel=fa4, models/attention/kernels.py) in bf16
against the float64 references: standard causal (flash_attn_func, varlen for packed documents),
the LSE part calls with a merged-LSE backward (DCA's parts; the kept-attention causal path of
full recompute), DCA's own forward and backward kernels (dca/grouped.py), chunked
attention (one varlen call over the chunks); MHA and GQA; outputs and gradients. Each test
also checks that FA4 ran: no call fell back to cuDNN.

Context parallelism's ring parts run the same LSE part calls; their CP=2 test
(test_context_parallel_gpu.py) needs two GPUs.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator

import pytest
import torch

from models.attention import causal, kernels, lse_attention
from models.attention.causal import causal_attention
from models.attention.chunked import chunked_attention
from models.attention.dca import dispatch, dq_parts, fa4_backward, fa4_forward, grouped
from models.attention.dca import graphs as dca_graphs
from models.attention.dca.attention import dual_chunk_attention
from models.attention.dca.plan import DCAPlan
from models.attention.dca.scaling import DCAScaling
from models.fused_qkv import split_grouped
from tests.gpu.test_dca_gpu import dca_reference_by_part, rel_err
from tests.reference import causal_mask, dense_attention, document_ids, positions_in_document


def _fa4_runs() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
            and kernels.fa4_module() is not None)


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _fa4_runs(), reason="needs FlashAttention-4 on an SM90+ GPU")]

D = 128


@contextlib.contextmanager
def counting_fa4_calls() -> Iterator[dict[str, int]]:
    """Count FA4's LSE forward and backward calls (lse_attention's fa4 entries) in the block."""
    counts = {"fwd": 0, "bwd": 0}
    saved = lse_attention._FORWARDS["fa4"], lse_attention._BACKWARDS["fa4"]

    def counted(name: str, fn):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    lse_attention._FORWARDS["fa4"] = counted("fwd", saved[0])
    lse_attention._BACKWARDS["fa4"] = counted("bwd", saved[1])
    try:
        yield counts
    finally:
        lse_attention._FORWARDS["fa4"], lse_attention._BACKWARDS["fa4"] = saved


@pytest.fixture(autouse=True)
def fa4_counted() -> Iterator[dict[str, int]]:
    """Run under kernel fa4, count the FA4 LSE calls, and fail if any call fell back."""
    lse_attention.FALLBACKS.clear()
    with counting_fa4_calls() as counts, kernels.using("fa4"):
        yield counts
    assert not lse_attention.FALLBACKS, f"calls FA4 could not take: {lse_attention.FALLBACKS}"


def _inputs(seq: int, hq: int, hk: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, seq, h, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (hq, hk, hk))
    return q, k, v, torch.randn(1, seq, hq, D, device="cuda", dtype=torch.bfloat16)


def _errors(fn, reference_mask: torch.Tensor, q, k, v, dout) -> list[float]:  # noqa: ANN001
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = dense_attention(*leaves, reference_mask.cuda())
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    errors = [rel_err(out, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
    print("relative errors out, dq, dk, dv:", errors)
    return errors


def _check(errors: list[float]) -> None:
    assert errors[0] < 1e-2
    assert max(errors[1:]) < 2e-2


@pytest.mark.parametrize("hk", [8, 2])
def test_causal(hk: int) -> None:
    seq = 2048
    _check(_errors(causal_attention, causal_mask(seq), *_inputs(seq, 8, hk)))


@pytest.mark.parametrize("hk", [8, 2])
def test_causal_packed_is_one_varlen_call(hk: int) -> None:
    seq = 2048
    cu = torch.tensor([0, 300, 1100, 1100, 1500, seq], dtype=torch.int32)
    doc = document_ids(cu)
    mask = causal_mask(seq) & (doc[:, None] == doc[None, :])
    _check(_errors(lambda q, k, v: causal_attention(q, k, v, cu_seqlens=cu.cuda()), mask,
                   *_inputs(seq, 8, hk)))


@pytest.mark.parametrize("hk", [8, 2])
def test_kept_causal_runs_the_lse_calls(hk: int, fa4_counted: dict[str, int],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under full recompute a layer that keeps (out, lse) (models/recompute.py: inside a
    checkpointed layer) takes FA4's LSE forward/backward pair."""
    monkeypatch.setattr(causal, "keeping", lambda: True)
    seq = 2048
    _check(_errors(causal_attention, causal_mask(seq), *_inputs(seq, 8, hk)))
    assert fa4_counted == {"fwd": 1, "bwd": 1}


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("hk", [8, 2])
def test_chunked(hk: int, packed: bool) -> None:
    seq, chunk = 2048, 384  # 5 chunks and a tail; packed: chunks restart per document
    cu = torch.tensor([0, 700, 1500, seq], dtype=torch.int32) if packed else None
    pos = positions_in_document(cu) if packed else torch.arange(seq)
    doc = document_ids(cu) if packed else torch.zeros(seq, dtype=torch.long)
    same = (doc[:, None] == doc[None, :]) & (pos[:, None] // chunk == pos[None, :] // chunk)
    _check(_errors(lambda q, k, v: chunked_attention(q, k, v, chunk_size=chunk, cu_seqlens=cu),
                   causal_mask(seq) & same, *_inputs(seq, 8, hk)))


# How DCA runs under FA4 (`dca_path`): its kernels, the backward cut four ways, or the part calls
DCA_KERNEL_PATHS = ["head groups", "row pieces", "head and row pieces", "one call"]
DCA_PATHS = ["parts", *DCA_KERNEL_PATHS]
# The backward's cut per path (grouped.Split for (batch, seq, heads, kv_heads)): one key head
# per group (as auto cuts long sequences), all heads in pieces of 1024 rows (as auto cuts short
# ones), or both
CUTS = {"head groups": lambda batch, seq, heads, kv_heads: grouped.Split(1, seq),
        "row pieces": lambda batch, seq, heads, kv_heads: grouped.Split(kv_heads, 1024),
        "head and row pieces": lambda batch, seq, heads, kv_heads: grouped.Split(1, 1024)}
AUTO_SPLIT = grouped.split


@pytest.fixture
def dca_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
             fa4_counted: dict[str, int]) -> Iterator[str]:
    """DCA through FA4 one way (the parameter): "parts" (a kernel call per part and chunk
    group, both passes), one of CUTS (DCA's own kernels, the backward cut so, under
    dca_backward=auto) or "one call" (both kernels, the backward in one piece: one_piece);
    checks that it ran."""
    taken = {"forward": 0, "backward": 0, "forward kernel": 0, "backward kernel": 0}
    route = dispatch.route
    setting = "parts" if request.param == "parts" else (
        "one_piece" if request.param == "one call" else "auto")
    monkeypatch.setattr(dispatch, "route", lambda q, **settings: route(
        q, **(settings | {"backward": setting})))  # dca_backward
    if request.param in CUTS:
        monkeypatch.setattr(grouped, "split", CUTS[request.param])
    # graphs captured under another path's cut would replay it (the cache keys on the setting)
    monkeypatch.setattr(dca_graphs, "_CACHE", {})

    def counting(module, name: str, key: str) -> None:  # noqa: ANN001
        fn = getattr(module, name)

        def counted(*args):  # noqa: ANN002, ANN202
            taken[key] += 1
            return fn(*args)
        monkeypatch.setattr(module, name, counted)

    counting(grouped, "forward", "forward")
    counting(grouped, "backward", "backward")
    counting(fa4_forward, "forward", "forward kernel")
    counting(fa4_backward, "backward", "backward kernel")
    yield request.param
    if request.param == "parts":
        assert fa4_counted["fwd"] > 0 and fa4_counted["bwd"] > 0 and not any(taken.values())
    else:
        assert fa4_counted == {"fwd": 0, "bwd": 0} and all(taken.values())
        assert taken["forward kernel"] == taken["forward"]  # one call
        pieces = taken["backward kernel"] / taken["backward"]
        assert pieces > 1 if request.param in CUTS else pieces == 1


def _dca_errors(q, k, v, dout, chunk: int, local: int, cu: torch.Tensor | None = None,  # noqa: ANN001
                factors: torch.Tensor | None = None, **kwargs) -> list[float]:  # noqa: ANN003
    out = dual_chunk_attention(q, k, v, chunk_size=chunk, local_size=local, cu_seqlens=cu,
                               **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, leaves = dca_reference_by_part(q, k, v, chunk, local, cu, part_factors=factors)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    errors = [rel_err(out, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
    print("relative errors out, dq, dk, dv:", errors)
    return errors


@pytest.mark.parametrize("dca_path", DCA_PATHS,
                         indirect=True)
@pytest.mark.parametrize("hk", [8, 2])  # the two cuts of the inter backward (MHA, GQA)
def test_dca(hk: int, dca_path: str) -> None:
    """DCA's intra/successive/inter parts with their LSE, merged; the backward calls FA4 with
    the merged out/LSE (test_dca_gpu.py's shapes: 4 chunks of L = 896 and a tail)."""
    _check(_dca_errors(*_inputs(4096, 8, hk), 1024, 128))


@pytest.mark.parametrize("dca_path", DCA_KERNEL_PATHS,
                         indirect=True)
@pytest.mark.parametrize("hk", [8, 2])
def test_dca_long_chunks_with_log_scaling(hk: int, dca_path: str) -> None:
    """L = 1024 (C = 2048, w = 1024, the 8K benchmark's) over 6 chunks: every part has
    blocks; q scaled on two parts (Llama 4's log scaling, its floor small enough to vary)."""
    seq, chunk, local = 6144, 2048, 1024
    f = [1 + 0.1 * math.log(math.floor((p + 1) / 512) + 1) for p in range(seq)]
    factors = torch.tensor([[1.0, x, x] for x in f], dtype=torch.float64)
    scaling = DCAScaling("log", "succ_inter", attn_scale=0.1, floor_scale=512)
    _check(_dca_errors(*_inputs(seq, 8, hk), chunk, local, factors=factors, scaling=scaling))


def test_dca_kernel_scales_padded_rows_by_their_own_length(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoding engine's prefill of prompts padded to one width (`lengths`): DCA's forward
    kernel with each row's `yarn` factor, against the float64 reference of each row alone (the
    last row: the first piece of a longer prompt)."""
    seq, chunk, local, original = 4096, 1024, 128, 1024
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, seq, h, D, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    lengths = [seq, 2048 + 5, 6000]
    scaling = DCAScaling("yarn", attn_scale=0.5, original_length=original)  # steep: visible
    calls = []
    forward = fa4_forward.forward
    monkeypatch.setattr(fa4_forward, "forward", lambda *a: calls.append(1) or forward(*a))
    args = {"chunk_size": chunk, "local_size": local, "scaling": scaling}
    with torch.no_grad():
        out = dual_chunk_attention(q, k, v, lengths=lengths, **args)
        shared = dual_chunk_attention(q, k, v, **args)  # every row taken as seq tokens long
    assert len(calls) == 2  # DCA's own forward kernel, once a call
    for b, n in enumerate(lengths):
        rows = min(n, seq)
        f = max(1.0, 0.5 * math.log(n / original) + 1) ** 2
        ref, _ = dca_reference_by_part(q[b:b + 1, :rows], k[b:b + 1, :rows], v[b:b + 1, :rows],
                                       chunk, local,
                                       part_factors=torch.full((rows, 3), f, dtype=torch.float64))
        assert rel_err(out[b:b + 1, :rows], ref) < 1e-2
    assert rel_err(shared[1:2, :2053], out[1:2, :2053]) > 5e-2  # a row's own length matters


@pytest.mark.parametrize("dca_path", DCA_KERNEL_PATHS,
                         indirect=True)
@pytest.mark.parametrize("hk", [8, 2])
def test_dca_batch_2_and_head_dim_64(hk: int, dca_path: str) -> None:
    """Batch 2 (the parts part-major in the kernels' query batch; a piece's dK/dV stored into,
    and added to, views of rows across the batch) and head dim 64 (FA4's other tile shapes)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2048, h, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (8, hk, hk))
    dout = torch.randn_like(q)
    _check(_dca_errors(q, k, v, dout, 512, 128))


@pytest.mark.parametrize("dca_path", DCA_KERNEL_PATHS, indirect=True)
@pytest.mark.parametrize("hk", [8, 2])
def test_dca_kernels_on_views_of_a_fused_qkv(hk: int, dca_path: str) -> None:
    """q, k, v as megatron hands them over: views of one [b, s, hk, (hq / hk + 2) d] projection
    (each key head's query heads, then its key and value; with GQA megatron's reshape copies q),
    no copy of k or v made for the kernels."""
    torch.manual_seed(0)
    group = 8 // hk
    mixed = torch.randn(1, 4096, hk, (group + 2) * D, device="cuda", dtype=torch.bfloat16)
    mixed.requires_grad_()
    q = mixed[..., :group * D].reshape(1, 4096, 8, D)
    k, v = mixed[..., group * D:(group + 1) * D], mixed[..., (group + 1) * D:]
    assert not k.is_contiguous() and not v.is_contiguous()
    _check(_dca_errors(q, k, v, torch.randn_like(q), 1024, 128))


@pytest.mark.parametrize("dca_path", DCA_KERNEL_PATHS, indirect=True)
@pytest.mark.parametrize("hk", [8, 2])
def test_dca_kernels_on_query_heads_in_their_groups(hk: int, dca_path: str) -> None:
    """q as GroupedQuerySelfAttention hands it over (models/fused_qkv.py): views of megatron's
    projection [s, b, hk, (hq / hk + 2) d] with the query heads in their groups, read in
    place by the rotations; dq (rotate_back into heads in groups), dk and dv written into one
    gradient of the projection's layout, which the split's backward returns whole."""
    torch.manual_seed(0)
    group = 8 // hk
    fused = torch.randn(4096, 1, hk, (group + 2) * D, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
    seen = []
    fused.register_hook(seen.append)
    q, k, v = (x.transpose(0, 1) for x in split_grouped(fused, group))  # [b, s, ...]
    dout = torch.randn(1, 4096, 8, D, device="cuda", dtype=torch.bfloat16)
    out = dual_chunk_attention(q, k, v, chunk_size=1024, local_size=128)
    (grad,) = torch.autograd.grad(out, fused, dout)
    assert seen[0]._base is not None  # the slots' tensor, not an assembled copy
    flat = [x.detach().flatten(2, 3) if x.dim() == 5 else x.detach() for x in (q, k, v)]
    ref, leaves = dca_reference_by_part(*flat, 1024, 128, None)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    q_grad, k_grad, v_grad = (x.transpose(0, 1) for x in split_grouped(grad, group))
    errors = [rel_err(out, ref)] + [rel_err(g, r) for g, r in zip(
        (q_grad.flatten(2, 3), k_grad, v_grad), ref_grads)]
    print("relative errors out, dq, dk, dv:", errors)
    _check(errors)


@pytest.mark.parametrize("dca_path", DCA_KERNEL_PATHS, indirect=True)
@pytest.mark.parametrize("hk", [8, 2])
def test_dca_kernels_on_the_rotations_the_forward_kept(hk: int, dca_path: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """dca_keep_rotated: the backward kernel reads the forward's rotated q and k (head and row
    slices of them under the cuts) and rotates nothing again."""
    rotations = []
    for name in ("rotate_parts", "rotate_k"):
        method = getattr(DCAPlan, name)
        monkeypatch.setattr(DCAPlan, name, lambda self, *args, _m=method, _n=name: (
            rotations.append(_n) or _m(self, *args)))
    _check(_dca_errors(*_inputs(4096, 8, hk), 1024, 128, keep_rotated=True))
    assert rotations == ["rotate_parts", "rotate_k"]  # the forward's


@pytest.mark.parametrize("dca_path", DCA_KERNEL_PATHS, indirect=True)
def test_dca_successive_rows_in_whole_blocks(dca_path: str) -> None:
    """w = 192 (C = 1088, L = 896): each chunk's first 256 rows (w in whole blocks) take their
    own successive copy, the rest inter's; rows 192-255 have both, the same rotation."""
    _check(_dca_errors(*_inputs(4096, 8, 2), 1088, 192))


@pytest.mark.parametrize("dca_path", ["head groups"], indirect=True)
def test_dca_backward_in_uneven_head_groups(dca_path: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """16 heads without GQA: auto's own cut, six groups of 2 or 3 heads (its floor of blocks
    per launch lifted for this short sequence), head slices at odd offsets into q, out, dout
    and the gradients."""
    monkeypatch.setattr(grouped, "split", AUTO_SPLIT)
    monkeypatch.setattr(grouped, "MIN_GROUP_BLOCKS", 1)
    assert [g.stop - g.start for g in grouped.split(1, 2048, 16, 16).head_groups(16)] == [
        2, 3, 3, 2, 3, 3]
    _check(_dca_errors(*_inputs(2048, 16, 16), 512, 128))


@pytest.mark.parametrize("dca_path", DCA_KERNEL_PATHS, indirect=True)
def test_dca_kernels_at_head_dim_96(dca_path: str) -> None:
    """FA4's configuration with P through shared memory in the forward and one dQ warpgroup in
    the backward, GQA."""
    _check(_dca_errors(*_head_dim_inputs(96), 512, 128))


@pytest.mark.parametrize("head_dim", [72, 80])
def test_head_dims_fa4_leaves_run_on_cudnn(head_dim: int, fa4_counted: dict[str, int],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Head dims FA4's backward pads unlike its post-processing (kernels.fa4_takes_head_dim;
    DCA's kernel gave wrong gradients at 72): causal attention and DCA under kernel fa4 match
    float64 through cuDNN, and no FA4 kernel runs."""

    def refused(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("FA4 ran")
    for module, name in ((kernels, "fa4_causal"), (fa4_forward, "forward"),
                         (fa4_backward, "backward")):
        monkeypatch.setattr(module, name, refused)
    q, k, v, dout = _head_dim_inputs(head_dim)
    _check(_errors(causal_attention, causal_mask(q.shape[1]), q, k, v, dout))
    _check(_dca_errors(q, k, v, dout, 512, 128))
    assert fa4_counted == {"fwd": 0, "bwd": 0}
    # the fallback is the point here: recorded with its reason, then cleared for the fixture
    assert {(a, b) for a, b, _ in lse_attention.FALLBACKS} == {("fa4", "cudnn")}
    assert all(f"head dim {head_dim}" in why for _, _, why in lse_attention.FALLBACKS)
    lse_attention.FALLBACKS.clear()


@pytest.mark.parametrize("head_dim", dq_parts.KERNEL_HEAD_DIMS)
def test_dq_layout_is_the_one_fa4_postprocess_reads(head_dim: int) -> None:
    """dq_parts.fa4_sm90_rows (the order of the kernel's dQ accumulator) against FA4's own
    postprocess: an accumulator holding every float's index, converted by FA4 to [b, s, h, d]
    in digits exact in bf16, gives back the index of each element."""
    from flash_attn.cute import interface as fa

    cfg = fa._tile_size_bwd_sm90(head_dim, head_dim, True, False)
    heads, seq = 2, 4 * cfg.m_block_size
    index = torch.arange(heads * seq * head_dim, device="cuda").view(1, heads, -1)
    found = torch.zeros(1, seq, heads, head_dim, dtype=torch.int64, device="cuda")
    for digit in range(3):  # base 256: integers below 256 are exact in bf16
        accum = (index // 256 ** digit % 256).float()
        dq = torch.empty(1, seq, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        fa._bwd_postprocess_convert(
            accum, dq, 1.0, None, None, 90, fa.torch2cute_dtype_map[torch.bfloat16], head_dim,
            cfg.m_block_size, 128 if cfg.dQ_single_wg else cfg.num_wg * 128,
            cfg.AtomLayoutMdQ, cfg.dQ_swapAB, fake_mode=False, hdim_multiple_of=32)
        found += dq.long() * 256 ** digit
    assert torch.equal(found.transpose(1, 2), dq_parts.fa4_sm90_rows(index, head_dim))


@pytest.mark.parametrize("head_dim", dq_parts.KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("factors", [False, True])
@pytest.mark.parametrize("heads", [4, 3])  # 3: a program's fourth head masked
def test_rotate_back_kernel_matches_torch(head_dim: int, factors: bool, heads: int) -> None:
    """dq_parts.rotate_back's Triton kernel against its torch path (float64 tables): three
    parts in FA4's layout, batch 2, into a view of dq's rows; the successive part holds no
    gradient (position -1, its values NaN) in two 64-row groups and one odd row."""
    torch.manual_seed(0)
    parts, batch, rows, seq = 3, 2, 256, 512
    data = torch.randn(parts * batch, heads, rows * head_dim, device="cuda")
    positions = torch.randint(0, 1000, (parts, seq), dtype=torch.int32, device="cuda")
    unused = torch.tensor([*range(64, 192), 255])  # rows of the span below
    positions[1, 128 + unused] = -1
    offsets = dq_parts.fa4_sm90_rows(torch.arange(rows * head_dim), head_dim)  # [rows, d]
    data.view(parts, batch, heads, -1)[1, ..., offsets[unused].flatten()] = torch.nan
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, device="cuda", dtype=torch.float64)
                           / head_dim)
    angles = torch.arange(1001, device="cuda", dtype=torch.float64)[:, None] * inv_freq
    scale = torch.rand(parts, seq, device="cuda", dtype=torch.float64) + 0.5 if factors else None
    span = slice(128, 128 + rows)
    dq = torch.zeros(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    dq_parts.rotate_back(dq_parts.DQParts(data, "fa4_sm90"), positions[:, span],
                         angles.cos().float(), angles.sin().float(),
                         None if scale is None else scale[:, span].float(), 0.125, dq[:, span])
    expected = torch.zeros(batch, rows, heads, head_dim, device="cuda", dtype=torch.float64)
    dq_parts.rotate_back(dq_parts.DQParts(data.double(), "fa4_sm90"), positions[:, span],
                         angles.cos(), angles.sin(), None if scale is None else scale[:, span],
                         0.125, expected)
    assert rel_err(dq[:, span], expected) < 5e-3
    assert not dq[:, :128].any() and not dq[:, 128 + rows:].any()


def _head_dim_inputs(head_dim: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2048, h, head_dim, device="cuda",
                           dtype=torch.bfloat16).requires_grad_() for h in (8, 2, 2))
    return q, k, v, torch.randn_like(q)


@pytest.mark.parametrize("dca_path", ["one call"], indirect=True)
def test_dca_one_call_two_chunks(dca_path: str) -> None:
    """Two chunks (C < S <= 2L): no inter part, so the kernels' parts are two."""
    _check(_dca_errors(*_inputs(1792, 8, 2), 1024, 128))


@pytest.mark.parametrize("hk", [8, 2])
def test_dca_packed_takes_the_part_calls(hk: int, fa4_counted: dict[str, int]) -> None:
    """Packed documents: DCA's kernels count chunks from the sequence's start, so the part
    calls (LSE calls, which the kernels' path never makes) run though the problem is small."""
    cu = torch.tensor([0, 700, 2500, 2600, 4096], dtype=torch.int32, device="cuda")
    _check(_dca_errors(*_inputs(4096, 8, hk), 1024, 128, cu))
    assert fa4_counted["fwd"] > 0 and fa4_counted["bwd"] > 0


@pytest.mark.parametrize("dca_path", DCA_PATHS,
                         indirect=True)
@pytest.mark.parametrize("hk", [8, 2])
def test_dca_replayed_as_cuda_graphs(hk: int, dca_path: str) -> None:
    """FA4's DCA calls captured in DCA's CUDA graphs (graphs.py): the replays compute the same
    function (fresh inputs copied into the captured ones)."""
    for seed in (0, 1):  # the first call captures, the second replays on new data
        _check(_dca_errors(*_inputs(4096, 8, hk, seed), 1024, 128, cuda_graphs=True))


def test_lse_forward_matches_the_math_path() -> None:
    """FA4's LSE (what the merges weigh parts by) against the float32 math path, full and
    causal, GQA, on [b, h, s, d] views of token-major memory as DCA passes them."""
    q, k, v, _ = _inputs(1024, 8, 2)
    views = [x.detach().transpose(1, 2) for x in (q, k, v)]  # [b, h, s, d]
    for masked in (False, True):
        out, lse = kernels.fa4_forward(*views, masked, D ** -0.5)
        ref_out, ref_lse = lse_attention._math_forward(*(x.float() for x in views), masked,
                                                       D ** -0.5)
        assert rel_err(out, ref_out) < 1e-2
        assert (lse - ref_lse).abs().max() < 1e-2


def test_dca_forward_bench_times_the_kernel_against_causal(tmp_path) -> None:
    """bench/dca_forward.py: DCA's forward kernel with one part is causal attention (what makes
    its row comparable with FA4 causal's forward), and the bench writes every variant's time."""
    from bench import dca_forward

    q, k, v, _ = _inputs(1024, 8, 2)
    q, k, v = (x.detach() for x in (q, k, v))
    out, lse = torch.empty_like(q), torch.empty(1, 8, 1024, device="cuda")
    fa4_forward.forward(q, k, v, D ** -0.5, 256, 256, out, lse)  # one part: L = 256
    assert rel_err(out, causal_attention(q, k, v)) < 1e-2
    path = tmp_path / "fwd.json"
    dca_forward.main(["--cases", "1024:8:256:128", "--rounds", "2", "--back-to-back", "1",
                      "--out", str(path)])
    (row,) = json.loads(path.read_text())["rows"]
    assert set(row["median_ms"]) == {"fa4_causal", "dca_one_part", "dca", "dca_unshared"}
    assert all(t > 0 for t in row["median_ms"].values())
