"""The attention probe on a CUDA model (its rows come from the CPU): the summaries equal the
CPU's for the same probabilities, and a DCA model on the GPU records every layer."""

from __future__ import annotations

import math

import pytest
import torch

from models.attention.probe import causal_probabilities, probing, record
from models.gpt import build_gpt, transformer_config
from models.schema import AttentionConfig, ModelConfig
from parallel.distributed import initialize_parallel, shutdown

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_summaries_on_the_gpu_equal_the_cpus() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 64, 4, 8, dtype=torch.float64, generator=g) for _ in range(2))
    rows = torch.tensor([3, 40, 63])
    summaries = []
    for device in ("cpu", "cuda"):
        with probing(rows, [0, 8, 32]) as probe:
            record(0, causal_probabilities(q.to(device), k.to(device), rows, 0.5))
        summaries.append(probe.layers[0])
    assert summaries[1].entropy == pytest.approx(summaries[0].entropy)
    assert summaries[1].mass == pytest.approx(summaries[0].mass)


@pytest.fixture
def single_gpu():
    initialize_parallel(torch.device("cuda"), tp=1, seed=0)
    yield
    shutdown()


def test_a_dca_model_on_the_gpu_records_every_layer(single_gpu) -> None:
    attention = AttentionConfig(kind="dca", dca_chunk_size=32, dca_local_size=8)
    config = transformer_config(ModelConfig(), attention, on_gpu=True)
    model = build_gpt(config, 256, 128).cuda().eval()
    tokens = torch.randint(0, 256, (1, 96), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(96, device="cuda")[None]
    with torch.no_grad(), probing(torch.tensor([10, 95]), [0, 32, 64]) as probe:
        model(tokens, positions, None)
    assert sorted(probe.layers) == [1, 2]
    for summary in probe.layers.values():
        assert 0 < summary.entropy <= math.log(96)
        assert sum(summary.mass) == pytest.approx(1.0)
