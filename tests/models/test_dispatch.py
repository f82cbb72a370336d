"""Which path a DCA call and a dense kernel call take: DCA's dispatcher (one decision per call,
logged once per path with its reason) and lse_attention's explicit fallbacks (a check, never an
exception caught; the math path's memory bound)."""

from __future__ import annotations

import logging

import pytest
import torch

from models.attention import kernels, lse_attention
from models.attention.dca import dispatch
from models.attention.dca.attention import dual_chunk_attention
from models.attention.dca.dispatch import DCAPath
from models.errors import AttentionTooLarge


@pytest.fixture(autouse=True)
def fresh_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.setattr(lse_attention, "FALLBACKS", set())


def route(q: torch.Tensor, **settings) -> dispatch.Route:
    base = dict(chunk_size=1024, local_size=128, longest=q.shape[1], packed=False, scaled=False,
                backward="auto", keep_rotated=False, cuda_graphs=False)
    return dispatch.route(q, **(base | settings))


def test_each_condition_picks_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.zeros(1, 4096, 4, 64)
    assert route(q, longest=1024).path == DCAPath.PLAIN_CAUSAL  # fits in C and 2L
    assert route(q, longest=1024, scaled=True).path == DCAPath.PART_CALLS  # scaling: not plain
    assert route(q) == (DCAPath.PART_CALLS, "not CUDA bf16/fp16 (DCA's kernels run through "
                        "FA4)", dispatch.KernelPaths())
    assert route(q, cuda_graphs=True).path == DCAPath.PART_CALLS  # graphs need CUDA
    monkeypatch.setattr(kernels, "fa4_applies", lambda x: True)
    monkeypatch.setattr(kernels, "hopper", lambda device: True)
    assert route(q).path == DCAPath.KERNELS
    assert route(q, packed=True).reason.startswith("packed documents")
    assert route(q, backward="parts").reason == "dca_backward=parts"
    assert route(q, local_size=100).reason.startswith("chunk length C - w or the sequence")
    assert dispatch.route_cp().path == DCAPath.CONTEXT_PARALLEL


def test_a_path_is_logged_once_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    q, k, v = (torch.randn(1, 64, 2, 8, dtype=torch.float64) for _ in range(3))
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        for _ in range(3):
            dual_chunk_attention(q, k, v, chunk_size=16, local_size=4)
        dual_chunk_attention(q, k, v, chunk_size=64, local_size=8)  # fits: plain causal
    lines = [r.getMessage() for r in caplog.records if r.name == dispatch.__name__]
    assert lines == ["DCA runs through part_calls: not CUDA bf16/fp16 (DCA's kernels run "
                     "through FA4)",
                     "DCA runs through plain_causal: every document fits in the chunk: one "
                     "causal call"]


def test_the_forward_follows_the_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call runs what the dispatcher said: a sequence that fits in one chunk, routed to
    the part calls, never reaches the causal call, and gives the same attention (plain causal
    is exact there)."""
    from models.attention.dca import attention

    q, k, v = (torch.randn(1, 64, 2, 8, dtype=torch.float64) for _ in range(3))
    plain = dual_chunk_attention(q, k, v, chunk_size=64, local_size=8)
    monkeypatch.setattr(dispatch, "route", lambda q, **_: dispatch.Route(
        DCAPath.PART_CALLS, "forced"))
    monkeypatch.setattr(attention, "causal_attention", lambda *a, **kw: pytest.fail("causal"))
    parts = dual_chunk_attention(q, k, v, chunk_size=64, local_size=8)
    torch.testing.assert_close(parts, plain, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("kernel", "head_dim", "taken", "why"), [
    ("fa4", 72, "cudnn", "fa4: head dim 72 (FA4 here: multiples of 32 up to 128, or up to 256)"),
    ("cudnn", 192, "flash", "cudnn: head dim 192 above 128"),
    ("fa4", 12, "math", "fa4: head dim 12 (FA4 here: multiples of 32 up to 128, or up to 256); "
                        "cudnn: head dim 12 not a multiple of 8; flash: head dim 12 not a "
                        "multiple of 8"),
])
def test_a_kernel_that_cannot_take_a_shape_is_passed_over_and_logged_once(
        kernel: str, head_dim: int, taken: str, why: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A shape the run's kernel cannot take goes to the next kernel by a check; the fallback
    is logged once (and recorded in FALLBACKS), naming the reason."""
    monkeypatch.setattr(lse_attention, "_fused", lambda q: True)
    monkeypatch.setattr(kernels, "active", lambda: kernel)
    q = torch.zeros(1, 4, 256, head_dim, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger=lse_attention.__name__):
        assert lse_attention._backend(q, q, q) == taken
        assert lse_attention._backend(q, q, q) == taken
    assert lse_attention.FALLBACKS == {(kernel, taken, why)}
    assert [r.getMessage() for r in caplog.records] == [
        f"attention kernel {kernel} cannot take a call ({why}): {taken} runs it"]


def test_a_shape_the_kernel_takes_runs_there_silently(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(lse_attention, "_fused", lambda q: True)
    monkeypatch.setattr(kernels, "active", lambda: "fa4")
    q = torch.zeros(1, 4, 256, 128, dtype=torch.bfloat16)
    strided = torch.zeros(1, 4, 256, 256, dtype=torch.bfloat16)[..., ::2]  # last stride 2
    with caplog.at_level(logging.WARNING, logger=lse_attention.__name__):
        assert lse_attention._backend(q, q, q) == "fa4"
        assert not caplog.records
        assert lse_attention._backend(strided, q, q) == "math"
    assert "fa4: a last stride other than 1" in caplog.text
    misaligned = torch.zeros(1, 4, 256, 129, dtype=torch.bfloat16)[..., :128]  # rows of 129
    assert lse_attention.refusal("fa4", misaligned, q, q) == "inputs not 16-byte aligned"
    assert lse_attention.refusal("cudnn", misaligned, q, q) is None


def test_the_math_path_refuses_scores_past_its_bound() -> None:
    """Refused in one message before any S x S tensor exists (the inputs are broadcast views
    of one element: the refusal allocates nothing)."""
    q = torch.zeros(1, 1, 1, 1).expand(1, 32, 65536, 64)
    with pytest.raises(AttentionTooLarge, match=r"65536 x 65536 scores of 32 heads needs "
                                                r"512\.0 GiB .* \(bound 8 GiB\)"):
        lse_attention.attention_forward(q, q, q, causal=True, scale=1.0)
    small = torch.randn(1, 2, 16, 8)
    out, lse = lse_attention.attention_forward(small, small, small, causal=True, scale=1.0)
    assert out.shape == small.shape and lse.shape == (1, 2, 16)
