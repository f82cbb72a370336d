"""Every FlashAttention-4 path (attention.kernel=fa4, models/attention/kernels.py) in bf16
against the float64 references: standard causal (flash_attn_func, varlen for packed documents),
the LSE part calls with a merged-LSE backward (DCA's parts; the kept-attention causal path of
full recompute), chunked attention (one varlen call over the chunks); MHA and GQA; outputs and
gradients. Each test also checks that FA4 ran: no call fell back to cuDNN.

Context parallelism's ring parts run the same LSE part calls; their CP=2 test
(test_context_parallel_gpu.py) needs two GPUs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from models.attention import causal, kernels, lse_attention
from models.attention.causal import causal_attention
from models.attention.chunked import chunked_attention
from models.attention.dca.attention import dual_chunk_attention
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
    lse_attention.REFUSED.clear()
    with counting_fa4_calls() as counts, kernels.using("fa4"):
        yield counts
    assert not lse_attention.REFUSED, f"FA4 refused calls: {lse_attention.REFUSED}"


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


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("hk", [8, 2])  # the two cuts of the inter backward (MHA, GQA)
def test_dca_parts(hk: int, packed: bool, fa4_counted: dict[str, int]) -> None:
    """DCA's intra/successive/inter part calls with their LSE, merged; the backward calls FA4
    with the merged out/LSE (test_dca_gpu.py's shapes: 4 chunks of L = 896 and a tail)."""
    seq, hq, chunk, local = 4096, 8, 1024, 128
    q, k, v, dout = _inputs(seq, hq, hk)
    cu = torch.tensor([0, 700, 2500, 2600, seq], dtype=torch.int32, device="cuda") if packed \
        else None
    out = dual_chunk_attention(q, k, v, chunk_size=chunk, local_size=local, cu_seqlens=cu)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, leaves = dca_reference_by_part(q, k, v, chunk, local, cu)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    errors = [rel_err(out, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
    print("relative errors out, dq, dk, dv:", errors)
    _check(errors)
    assert fa4_counted["fwd"] > 0 and fa4_counted["bwd"] > 0


@pytest.mark.parametrize("hk", [8, 2])
def test_dca_parts_replayed_as_cuda_graphs(hk: int, fa4_counted: dict[str, int]) -> None:
    """FA4's part calls captured in DCA's CUDA graphs (dca_graphs.py): the replays compute
    the same function (fresh inputs copied into the captured ones)."""
    seq, hq, chunk, local = 4096, 8, 1024, 128
    for seed in (0, 1):  # the first call captures, the second replays on new data
        q, k, v, dout = _inputs(seq, hq, hk, seed)
        out = dual_chunk_attention(q, k, v, chunk_size=chunk, local_size=local,
                                   cuda_graphs=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref, leaves = dca_reference_by_part(q, k, v, chunk, local)
        ref_grads = torch.autograd.grad(ref, leaves, dout.double())
        errors = [rel_err(out, ref)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
        print("graphs, relative errors out, dq, dk, dv:", errors)
        _check(errors)
    assert fa4_counted["fwd"] > 0 and fa4_counted["bwd"] > 0


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
