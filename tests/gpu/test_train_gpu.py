"""End-to-end training on the GPU: a 350M DCA model at 32K still trains, and full
recompute that keeps the core attention (models/recompute.py) gives the gradients of no
recompute on the cuDNN paths."""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from models.fused_rmsnorm import FusedRMSNorm  # noqa: E402
from models.gpt import build_gpt, transformer_config  # noqa: E402
from models.options import BuildOptions  # noqa: E402
from parallel.distributed import initialize_parallel, shutdown  # noqa: E402
from tests.ckpt import hf_models  # noqa: E402
from tests.conftest import compose_config  # noqa: E402
from trainer.config import AttentionConfig, ModelConfig  # noqa: E402
from trainer.train import train  # noqa: E402

hf_imported = hf_models.hf_imported  # the shared fixture
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("hidden", [1024, 2048, 1000])
def test_fused_rmsnorm_matches_torch(hidden: int) -> None:
    torch.manual_seed(0)
    config = transformer_config(ModelConfig(hidden_size=hidden, num_attention_heads=8,
                                            kv_channels=128), AttentionConfig())
    fused = FusedRMSNorm(config, hidden).cuda().bfloat16()
    plain = torch.nn.RMSNorm(hidden, eps=1e-5).cuda().bfloat16()
    weight = torch.randn(hidden) * 0.1 + 1
    with torch.no_grad():
        for norm in (fused, plain):
            norm.weight.copy_(weight)
    x = torch.randn(4099, 2, hidden, device="cuda", dtype=torch.bfloat16) * 3
    dy = torch.randn_like(x)
    outs = []
    for norm in (fused, plain):
        xi = x.clone().requires_grad_()
        y = norm(xi)
        y.backward(dy)
        outs.append((y.float(), xi.grad.float(), norm.weight.grad.float()))
    for name, a, b in zip(("y", "dx", "dw"), *outs):
        err = float((a - b).norm() / b.norm())
        assert err < 1e-2, (name, err)


@pytest.mark.parametrize("kind", ["standard", "dca"])
def test_full_recompute_keeping_attention_gives_the_same_gradients(kind: str) -> None:
    initialize_parallel(torch.device("cuda"), tp=1, seed=0)
    try:
        seq = 4096
        model = ModelConfig(num_layers=2, hidden_size=512, num_attention_heads=4,
                            num_query_groups=2, init_std=0.05)
        attention = AttentionConfig(kind=kind, dca_chunk_size=1024, dca_local_size=128)
        grads, state = [], None
        for recompute, keep in (("none", False), ("full", True)):
            config = transformer_config(model, attention, options=BuildOptions(
                bf16=True, on_gpu=True, recompute=recompute, recompute_keep_attention=keep))
            gpt = build_gpt(config, 256, seq).cuda().bfloat16().train()
            # GPU init draws from megatron's RNG tracker: copy the first model's weights.
            state = state or {k: v.clone() if torch.is_tensor(v) else v
                              for k, v in gpt.state_dict().items()}
            gpt.load_state_dict(state)
            tokens = torch.randint(0, 256, (1, seq), device="cuda",
                                   generator=torch.Generator("cuda").manual_seed(1))
            positions = torch.arange(seq, device="cuda").expand_as(tokens)
            gpt(tokens, positions, None, labels=tokens).float().mean().backward()
            grads.append({n: p.grad.float() for n, p in gpt.named_parameters()})
            assert all(len(m.keeper) == 0 for m in gpt.modules() if hasattr(m, "keeper"))
        for name, ref in grads[0].items():
            err = float((grads[1][name] - ref).norm() / ref.norm())
            assert err < 2e-2, (name, err)  # bf16: SDPA vs the LSE kernels, summation order
    finally:
        shutdown()


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_dca_cuda_graphs_give_the_eager_loss_and_gradients(recompute: str) -> None:
    """Two DCA layers share one captured graph; under full recompute the backward graph runs on
    the kept output and the recomputed q, k, v. Two steps: the second replays."""
    from models.attention.dca import graphs as dca_graphs

    initialize_parallel(torch.device("cuda"), tp=1, seed=0)
    dca_graphs.release()
    try:
        seq = 4096
        model = ModelConfig(num_layers=2, hidden_size=512, num_attention_heads=4,
                            num_query_groups=2, init_std=0.05)
        attention = AttentionConfig(kind="dca", dca_chunk_size=1024, dca_local_size=128)
        runs, state = [], None
        for graphs in (False, True):
            config = transformer_config(model, attention, options=BuildOptions(
                bf16=True, on_gpu=True, recompute=recompute,
                recompute_keep_attention=recompute == "full", dca_cuda_graphs=graphs))
            gpt = build_gpt(config, 256, seq).cuda().bfloat16().train()
            state = state or {k: v.clone() if torch.is_tensor(v) else v
                              for k, v in gpt.state_dict().items()}
            gpt.load_state_dict(state)
            for step in range(2):
                tokens = torch.randint(0, 256, (1, seq), device="cuda",
                                       generator=torch.Generator("cuda").manual_seed(step))
                positions = torch.arange(seq, device="cuda").expand_as(tokens)
                gpt.zero_grad()
                loss = gpt(tokens, positions, None, labels=tokens).float().mean()
                loss.backward()
            runs.append((loss.item(), {n: p.grad.float() for n, p in gpt.named_parameters()}))
        assert len(dca_graphs._CACHE) == 1
        assert runs[1][0] == runs[0][0]  # the forward: same kernels, same inputs
        for name, ref in runs[0][1].items():
            err = float((runs[1][1][name] - ref).norm() / ref.norm())
            assert err < 1e-2, (name, err)  # cuDNN's backward sums dq in any order
    finally:
        dca_graphs.release()
        shutdown()


def test_350m_dca_at_32k_trains(tmp_path: Path) -> None:
    # Half the layers recompute (keeping their attention), half do not: both paths train.
    cfg = compose_config([
        "model=gpt_350m", "+attention=dca", "trainer.seq_length=32768",
        "trainer.micro_batch_size=1", "trainer.global_batch_size=1", "trainer.max_steps=30",
        "trainer.warmup_steps=5", "trainer.lr=3e-4", "trainer.min_lr=3e-5",
        "trainer.eval_interval=0", "checkpoint.save=false", "logger=none",
        "trainer.recompute=full", "trainer.recompute_num_layers=12",
    ])
    train(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert len(losses) == 30 and all(torch.isfinite(torch.tensor(losses))), losses
    first, last = losses[0], sum(losses[-5:]) / 5
    assert last < 0.75 * first, (first, last, losses)
    assert max(r["memory_gb"] for r in rows) < 70, rows[-1]


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_a_bf16_fine_tune_steps_from_the_imported_weights(tmp_path: Path, hf_imported,
                                                          distributed_optimizer: bool) -> None:
    """bf16 on the GPU: megatron's optimizer steps fp32 main copies and writes them back, so a
    step at a learning rate of ~0 leaves every imported weight as it was (copies taken before
    the import made the model its random init again after one step)."""
    from ckpt.load import load_model_weights
    from ckpt.paths import resolve_checkpoint
    from models.gpt import build_model
    from parallel.distributed import unwrap_model
    from tests.conftest import FAST
    from trainer.train import Trainer

    _, imported = hf_imported("llama", False)
    cfg = compose_config(FAST + [
        f"checkpoint.load={imported}", "trainer.precision=bf16", "trainer.max_steps=2",
        "trainer.lr=1e-30", "trainer.min_lr=0.0", "trainer.weight_decay=0.0",
        f"parallel.distributed_optimizer={distributed_optimizer}", "checkpoint.save=false"])
    (tmp_path / "run").mkdir()
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        trainer.run()
        plain = build_model(cfg.model, AttentionConfig(), cfg.parallel,
                            vocab_size=trainer.vocab_size, max_sequence_length=64).gpt
        load_model_weights(resolve_checkpoint(imported), plain)
        stepped = dict(unwrap_model(trainer.model[0]).named_parameters())
        for name, ref in plain.named_parameters():
            torch.testing.assert_close(stepped[name].detach().float().cpu(),
                                       ref.detach().to(torch.bfloat16).float(), msg=name)
    finally:
        trainer.close()
