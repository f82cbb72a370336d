"""DCA replayed as CUDA graphs (models/attention/dca/graphs.py) against the eager path: the same
output, gradients within cuDNN's backward noise, for several "layers" whose forwards all run
before their backwards (the graph's buffers are shared), and one capture per shape."""

from __future__ import annotations

import pytest
import torch

from models.attention.dca import graphs as dca_graphs
from models.attention.dca.attention import dual_chunk_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SETTINGS = {"chunk_size": 1024, "local_size": 128}


def _inputs(seed: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, 4096, h, 128, device="cuda", dtype=torch.bfloat16)
               for h in (8, kv_heads, kv_heads))
    return q, k, v, torch.randn_like(q)


def _run(inputs: list[tuple[torch.Tensor, ...]], cuda_graphs: bool
         ) -> list[tuple[torch.Tensor, ...]]:
    """Every layer's forward first, then the backwards in reverse (a model's order)."""
    leaves = [tuple(x.clone().requires_grad_() for x in layer[:3]) for layer in inputs]
    outs = [dual_chunk_attention(*qkv, **SETTINGS, cuda_graphs=cuda_graphs) for qkv in leaves]
    loss = sum((out.float() * layer[3].float()).sum() for out, layer in zip(outs, inputs))
    loss.backward()
    return [(out.detach(), *(x.grad for x in qkv)) for out, qkv in zip(outs, leaves)]


@pytest.mark.parametrize("kv_heads", [8, 2])  # MHA and GQA cut the inter backward differently
def test_graphs_match_the_eager_path_over_several_layers(kv_heads: int) -> None:
    dca_graphs.release()
    inputs = [_inputs(seed, kv_heads) for seed in range(3)]
    eager = _run(inputs, cuda_graphs=False)
    for _ in range(2):  # the second round replays the graphs captured in the first
        graphed = _run(inputs, cuda_graphs=True)
        assert len(dca_graphs._CACHE) == 1
        for (out_e, *grads_e), (out_g, *grads_g) in zip(eager, graphed):
            assert torch.equal(out_g, out_e)  # same kernels on the same inputs
            for g, e in zip(grads_g, grads_e):  # cuDNN's dq accumulates in any order
                torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-3)
    dca_graphs.release()


def test_a_new_shape_captures_its_own_graphs() -> None:
    dca_graphs.release()
    q, k, v, _ = _inputs(0, 2)
    dual_chunk_attention(q, k, v, **SETTINGS, cuda_graphs=True)
    dual_chunk_attention(q[:, :3072], k[:, :3072], v[:, :3072], **SETTINGS, cuda_graphs=True)
    assert len(dca_graphs._CACHE) == 2
    dca_graphs.release()
