"""The attention probe on a CUDA model (its rows are made on the CPU): the summaries equal the
CPU's for the same probabilities, and a DCA model on the GPU records every layer (the fourth
extrapolation run's first DCA evaluation failed there on mixed devices)."""

from __future__ import annotations

import pytest
import torch

from models.attention.probe import causal_probabilities, probing, record
from models.schema import AttentionConfig
from parallel.distributed import initialize_parallel, shutdown
from tests.models.test_probe import probe_a_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_summaries_on_the_gpu_equal_the_cpus() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 64, 4, 8, dtype=torch.float64, generator=g) for _ in range(2))
    rows = torch.tensor([3, 40, 63])
    summaries = []
    for device in ("cpu", "cuda"):
        with probing(rows, [0, 8, 32]) as probe:
            on = rows.to(device)
            record(0, causal_probabilities(q.to(device), k.to(device), on, 0.5), on)
        summaries.append(probe.layers[0])
    assert summaries[1].entropy == pytest.approx(summaries[0].entropy)
    assert summaries[1].mass == pytest.approx(summaries[0].mass)


@pytest.fixture
def single_gpu():
    initialize_parallel(torch.device("cuda"), tp=1, seed=0)
    yield
    shutdown()


def test_a_dca_model_on_the_gpu_records_every_layer(single_gpu) -> None:
    probe_a_model(AttentionConfig(kind="dca", dca_chunk_size=32, dca_local_size=8), "cuda")
