"""Head-gated checkpoints reshard across TP sizes: the [QKV; Gate] factory, the naive layout that
loads silently wrong, and a TP=2 training run resumed at TP=1 and TP=2."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule

from ckpt.save import _collect_results_in_process
from models.attention.head_gate import HeadGatedSelfAttention
from models.gpt import build_gpt, transformer_config
from models.schema import AttentionConfig, ModelConfig, ParallelConfig
from parallel.distributed import initialize_parallel
from tests.conftest import (
    FAST,
    assert_tp2_checkpoint_resumes_at_tp1_and_tp2,
    spawn,
    train_on_ranks,
)

VOCAB, SEQ = 128, 16
SHAPES = {  # both allow TP=4: heads and query groups divide by 4
    "mha": dict(hidden_size=32, num_attention_heads=4, num_query_groups=None),
    "gqa": dict(hidden_size=64, num_attention_heads=8, num_query_groups=4),
}
PAIRS = [(1, 2), (2, 1), (2, 4)]  # (save TP, load TP)
CASES = [(shape, bias, save, load) for shape in SHAPES for bias in (False, True)
         for save, load in PAIRS]


def case_id(shape: str, bias: bool, save: int, load: int) -> str:
    return f"{shape}-{'bias' if bias else 'nobias'}-tp{save}-to-tp{load}"


def tiny_gpt(shape: str, bias: bool, tp: int, seed: int) -> GPTModel:
    model = ModelConfig(num_layers=2, ffn_hidden_size=64, qkv_bias=bias, init_std=0.2,
                        **SHAPES[shape])
    config = transformer_config(model, AttentionConfig(head_wise_attn_gate=True),
                                ParallelConfig(tp=tp))
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return build_gpt(config, VOCAB, SEQ).eval()


def full_logits(model: GPTModel) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens, torch.arange(SEQ).expand_as(tokens), None)  # [b, s, V / tp]
        return tensor_parallel.gather_from_tensor_model_parallel_region(logits)  # [b, s, V]


def use_tp(tp: int) -> None:
    parallel_state.destroy_model_parallel()
    initialize_parallel(torch.device("cpu"), tp=tp, seed=0)


def _state(model: GPTModel, name: str, layout: str) -> dict:
    """The model's sharded state dict under the key prefix `name.`, in the case's layout."""
    naive = mock.patch.object(HeadGatedSelfAttention, "sharded_state_dict",
                              MegatronModule.sharded_state_dict)
    with naive if layout == "naive" else nullcontext():
        return model.sharded_state_dict(prefix=f"{name}.")


def _reshard_every_case(root: str) -> None:
    """Every case with the factory, and with megatron's plain TP split of the fused tensor: saved
    at its save TP from a model seeded 1, loaded at its load TP into one seeded 2; the relative
    logit error is recorded. At each TP one checkpoint holds every model saved there (each under
    its own key prefix) and one load per checkpoint reads every model loaded there: 5 saves and
    loads in all instead of 48, each with its integrity checks, plans and writer processes."""
    # A few TP changes in all (megatron never frees the gloo groups of a past TP size): each
    # case is saved at its save TP before it is loaded at its load TP.
    # megatron's writers report to a queue; left alone, a rank's first save spawns a
    # multiprocessing Manager for it (a new interpreter: ~10 s on 2 cores, the ranks waiting at
    # the save's barrier). The synchronous saves here put and get in this process, as the
    # trainer's own saves do (ckpt/save.py).
    _collect_results_in_process()
    before: dict[str, torch.Tensor] = {}
    saved_in: dict[str, Path] = {}
    errors: dict[str, float] = {}
    for n, tp in enumerate((1, 2, 4, 1)):
        use_tp(tp)
        due = [(f"{case_id(*case)}-{layout}", case, layout) for case in CASES
               for layout in ("factory", "naive")]
        saves = [(name, case, layout) for name, case, layout in due
                 if case[2] == tp and name not in before]
        if saves:
            ckpt = Path(root) / f"saved-{n}-at-tp{tp}"
            if dist.get_rank() == 0:
                ckpt.mkdir()
            dist.barrier()
            state = {}
            for name, (shape, bias, _, _), layout in saves:
                model = tiny_gpt(shape, bias, tp, seed=1)
                before[name] = full_logits(model)
                state.update(_state(model, name, layout))
                saved_in[name] = ckpt
            dist_checkpointing.save(state, str(ckpt))
        loads = [(name, case, layout) for name, case, layout in due
                 if case[3] == tp and name in before and name not in errors]
        for ckpt in sorted({saved_in[name] for name, _, _ in loads}):
            models, state = {}, {}
            for name, (shape, bias, _, _), layout in loads:
                if saved_in[name] == ckpt:
                    models[name] = tiny_gpt(shape, bias, tp, seed=2)
                    state.update(_state(models[name], name, layout))
            loaded = dist_checkpointing.load(state, str(ckpt))
            for name, model in models.items():
                prefix = f"{name}."
                model.load_state_dict({key.removeprefix(prefix): value
                                       for key, value in loaded.items()
                                       if key.startswith(prefix)})
                after = full_logits(model)
                errors[name] = ((after - before[name]).abs().max()
                                / before[name].abs().max()).item()
    if dist.get_rank() == 0:
        (Path(root) / "errors.json").write_text(json.dumps(errors))


@pytest.fixture(scope="module")
def reshard_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """Every case's relative logit error after loading, from one 4-process gloo job."""
    root = tmp_path_factory.mktemp("reshard")
    spawn(_reshard_every_case, str(root), world=4, tp=1)
    return json.loads((root / "errors.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case_id(*c) for c in CASES])
def test_logits_survive_resharding_and_the_naive_layout_does_not(
        reshard_errors: dict[str, float], case: tuple) -> None:
    name = case_id(*case)
    assert reshard_errors[f"{name}-factory"] < 1e-5
    # The same test fails without the factory: gate rows load onto K/V rows (and back).
    assert reshard_errors[f"{name}-naive"] > 1e-2


def test_factory_stores_qkv_and_gate_and_rebuilds_for_optimizer_state(single_process) -> None:
    model = tiny_gpt("gqa", True, tp=1, seed=0)
    state = model.sharded_state_dict()
    key = "decoder.layers.self_attention.linear_qkv.weight"
    factory = state[key.replace("layers.", "layers.0.")]
    assert isinstance(factory, ShardedTensorFactory) and factory.key == key
    # megatron swaps in the optimizer's tensor and key; the build must follow them alone.
    exp_avg = torch.randn_like(factory.data)
    qkv, gate = make_sharded_optimizer_tensor(factory, exp_avg, "optimizer.state.exp_avg").build()
    assert qkv.key == f"optimizer.state.exp_avg.{key}._qkv"
    assert gate.key == f"optimizer.state.exp_avg.{key}._gate"
    rows = (8 + 2 * 4) * 8  # (heads + 2 groups) * head dim
    assert qkv.global_shape == (2, rows, 64) and gate.global_shape == (2, 8, 64)  # [layers, ...]
    assert torch.equal(qkv.data, exp_avg[:rows]) and torch.equal(gate.data, exp_avg[rows:])
    assert torch.equal(factory.merge_fn([qkv.data, gate.data]), exp_avg)


@pytest.mark.slow
def test_tp2_gated_checkpoint_resumes_at_tp1_and_tp2_with_the_same_losses(tmp_path: Path) -> None:
    common = FAST + ["+attention=head_gate", "model.qkv_bias=true", "trainer.max_steps=6",
                     "trainer.save_interval=3"]
    train_on_ranks(common + ["parallel.tp=2"], tmp_path / "tp2", nproc=2)
    # Model and optimizer state reshard: steps 5 and 6 use the resumed Adam moments.
    assert_tp2_checkpoint_resumes_at_tp1_and_tp2(tmp_path, common)
