"""Context parallelism (CP): CP=2, CP=4 and TP=2 x CP=2 equal CP=1 for every attention kind.

Three levels, all against CP=1: the attention functions (output and dq, dk, dv in float64), the
GPT model (loss and every parameter's gradient), and the loss and gradient norm of a few training
steps. Process start-up dominates on 2 cores, so one 4-process gloo spawn runs every CP check
and writes its findings; the tests below read them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from models.attention.causal import causal_attention
from models.attention.chunked import chunked_attention
from models.attention.context_parallel import PieceLayout
from models.attention.core import CausalCoreAttention
from models.attention.cp_calls import Call as CPCall
from models.attention.cp_calls import join_blocks
from models.attention.cp_variants import (
    chunk_rectangles,
    cp_causal_attention,
    cp_chunked_attention,
    cp_dual_chunk_attention,
)
from models.attention.dca.attention import dual_chunk_attention
from models.gpt import build_gpt, transformer_config
from models.schema import AttentionConfig, ModelConfig, ParallelConfig
from parallel.cpu_mode import enable_cpu_mode
from parallel.distributed import shutdown
from tests.conftest import FAST, compose_config, read_metrics, spawn, train_on_ranks
from trainer import eval as eval_entry
from trainer.step import _forward_step
from trainer.train import train

WORLD = 4
LAYOUTS = [(1, 2), (1, 4), (2, 2)]  # (tp, cp) on 4 processes; dp takes the rest
SEQ, VOCAB = 64, 384
# Model kinds at SEQ = 64. chunked: P = 8 at CP=4 splits chunks of 16 across ranks (direct
# exchange), P = 16 at CP=2 holds whole chunks (local); every 2nd layer is global (standard CP,
# no RoPE). DCA: chunk length 16, so intra, successive and inter all occur.
KINDS: dict[str, dict[str, Any]] = {
    "standard": {},
    "chunked": dict(kind="chunked", chunk_size=16, global_layer_interval=2),
    "dca": dict(kind="dca", dca_chunk_size=24, dca_local_size=8),
}
OVERRIDES = {
    "standard": [],
    "chunked": ["+attention=chunked", "attention.chunk_size=16",
                "attention.global_layer_interval=2"],
    "dca": ["+attention=dca", "attention.dca_chunk_size=24", "attention.dca_local_size=8"],
}
STEPS = 3
# Training runs (kind, tp, cp, recompute): every layout and kind, chunked and DCA at two (the
# model check above covers each kind at each layout; a run adds the trainer's CP data split, loss
# and gradient reduction, which the kind does not change), and full recompute, whose recomputed
# layers reuse the CP attention's kept result and received rows (models/recompute.py).
RUNS = [("standard", 1, 2, "none"), ("chunked", 2, 2, "none"), ("dca", 1, 4, "none"),
        ("chunked", 1, 4, "full"), ("dca", 2, 2, "full")]


def run_name(run: tuple[str, int, int, str]) -> str:
    return "{}-tp{}-cp{}-recompute_{}".format(*run)
pytestmark = pytest.mark.timeout(600)  # a p2p mismatch would hang, not fail


def train_overrides(kind: str, tp: int = 1, cp: int = 1, recompute: str = "none") -> list[str]:
    """A 3-step run with one global batch of 2 sequences at every layout (CP=1: one process),
    on the CPU on every machine (the layouts' runs are gloo workers, compared with CP=1's)."""
    dp = WORLD // (tp * cp) if cp > 1 else 1
    return FAST + OVERRIDES[kind] + [f"trainer.recompute={recompute}",
        f"trainer.seq_length={SEQ}", f"trainer.micro_batch_size={2 // dp}",
        "trainer.global_batch_size=2", f"trainer.max_steps={STEPS}", "checkpoint.save=false",
        f"parallel.tp={tp}", f"parallel.cp={cp}", "trainer.device=cpu"]


# ---- what the workers check --------------------------------------------------------------------

def cp_slice(x: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rank r's pieces r and 2n-1-r of [b, S, ...] (the load-balanced layout)."""
    p = x.shape[1] // (2 * n)
    return torch.cat([x[:, r * p:(r + 1) * p], x[:, (2 * n - 1 - r) * p:(2 * n - r) * p]], dim=1)


Attention = Callable[..., torch.Tensor]
FUNCTIONS: dict[str, tuple[Attention, Attention]] = {  # (CP=1 function, CP function)
    "standard": (causal_attention, cp_causal_attention),
    **{f"chunked C={c}": (lambda q, k, v, c=c: chunked_attention(q, k, v, chunk_size=c),
                          lambda q, k, v, c=c, **kw: cp_chunked_attention(q, k, v, chunk_size=c,
                                                                          **kw))
       for c in (6, 5, 20)},  # S=48: 6 divides P at CP=2 and 4 (local); 5 and 20 straddle pieces
    **{f"dca C={c} local={w}": (
        lambda q, k, v, c=c, w=w: dual_chunk_attention(q, k, v, chunk_size=c, local_size=w),
        lambda q, k, v, c=c, w=w, **kw: cp_dual_chunk_attention(q, k, v, chunk_size=c,
                                                                local_size=w, **kw))
       for c, w in ((7, 2), (16, 4), (40, 8))},  # chunk lengths 5, 12, 32 vs P = 12 and 6
}


@contextlib.contextmanager
def counting_sends() -> Iterator[dict[str, int]]:
    """Count the elements this rank sends (every CP exchange goes through batch_isend_irecv)."""
    sent = {"elements": 0}
    real = dist.batch_isend_irecv

    def counting(ops: list) -> list:
        sent["elements"] += sum(op.tensor.numel() for op in ops if op.op is dist.isend)
        return real(ops)

    dist.batch_isend_irecv = counting
    try:
        yield sent
    finally:
        dist.batch_isend_irecv = real


@contextlib.contextmanager
def fresh_groups(root: str, name: str, tp: int | None = 1, cp: int = 1) -> Iterator[None]:
    """A new process group (`name` unique per use) for one layout, torn down after it: megatron's
    destroy_model_parallel keeps its gloo groups (and their threads) alive, and a few dozen
    layouts' worth of them swamp two cores. A FileStore per layout needs no port.
    With tp=None megatron's groups are left to the caller (the Trainer makes its own).
    megatron runs in CPU mode, a GPU host's too (shutdown ends it)."""
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/{name}.store", WORLD),
                            rank=int(os.environ["RANK"]), world_size=WORLD)
    enable_cpu_mode()
    if tp is not None:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 context_parallel_size=cp)
    try:
        yield
    finally:
        shutdown()


def cp_inputs() -> tuple[torch.Tensor, ...]:
    """q, k, v, dout of the function checks (float64, GQA 4/2, 48 tokens, seeded)."""
    gen = torch.Generator().manual_seed(0)
    b, s, hq, hk, d = 2, 48, 4, 2, 8
    q, do = (torch.randn(b, s, hq, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, s, hk, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, do


def check_functions(n: int) -> dict[str, dict[str, Any]]:
    """Max |CP - reference| of out, dq, dk, dv and the elements sent, per function, at CP=n."""
    q, k, v, do = cp_inputs()
    group = parallel_state.get_context_parallel_group()
    r = dist.get_rank(group)
    found: dict[str, dict[str, Any]] = {}
    for name, (reference, cp_fn) in FUNCTIONS.items():
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        expected = reference(*full)
        expected.backward(do)
        local = [cp_slice(x, n, r).clone().requires_grad_() for x in (q, k, v)]
        with counting_sends() as sent:
            out = cp_fn(*local, group=group)
            out.backward(cp_slice(do, n, r))
        errors = [(out - cp_slice(expected, n, r)).abs().max().item()]
        errors += [(x.grad - cp_slice(f.grad, n, r)).abs().max().item()
                   for x, f in zip(local, full)]
        found[f"{name} cp={n}"] = {"error": max(errors), "sent": sent["elements"]}
    return found


def backward_one_batch(kind: str, parallel: ParallelConfig,
                       scale: float = 1.0) -> tuple[torch.Tensor, torch.nn.Module]:
    """The 2-layer model of `kind` at `parallel`, the training step's own forward and loss
    (trainer/step.py) on one fixed batch, the loss times `scale` backpropagated: (loss, model
    with its gradients). Megatron's groups must be set up."""
    gen = torch.Generator().manual_seed(1)
    batch = {"tokens": torch.randint(0, 256, (2, SEQ), generator=gen),
             "labels": torch.randint(0, 256, (2, SEQ), generator=gen),
             "loss_mask": torch.ones(2, SEQ)}
    model_cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                            num_query_groups=2, init_std=0.1)
    config = transformer_config(model_cfg, AttentionConfig(**KINDS[kind]), parallel)
    torch.manual_seed(7)  # CPU initialisation: the same weights (TP shards) at every CP size
    model = build_gpt(config, VOCAB, SEQ)
    output, loss_func = _forward_step(torch.device("cpu"), 1, iter([batch]), model)
    loss = loss_func(output)[0] * scale
    loss.backward()
    return loss.detach(), model


def model_loss_and_grads(kind: str, tp: int,
                         cp: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and parameter gradients of one fixed batch as DDP sees them after its reduction
    over the CP ranks (the mean of the ranks' gradients); megatron's groups must be set up."""
    # megatron's schedule multiplies the loss by the CP size, so the mean over DDP's dp x cp
    # ranks is the batch's
    loss, model = backward_one_batch(kind, ParallelConfig(tp=tp, cp=cp), scale=cp)
    value = loss.clone()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    if cp > 1:
        for tensor in [value, *grads.values()]:
            dist.all_reduce(tensor, group=parallel_state.get_context_parallel_group())
            tensor /= cp
    return value.item(), grads


def packed_sequence_error() -> str:
    """The error a CP core attention gives for packed (THD) input."""
    config = transformer_config(ModelConfig(), AttentionConfig(), ParallelConfig(
        cp=parallel_state.get_context_parallel_world_size()))
    core = CausalCoreAttention(config, 1, None, "self")
    x = torch.zeros(8, 4, 32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 8]))
    try:
        core(x, x, x, None, packed_seq_params=packed)
    except NotImplementedError as error:
        return str(error)
    return "no error"


def _all_checks(root: str) -> None:
    """One rank of the spawn: every check, one fresh process group per layout; findings go to
    rank<r>.pt and each training run's metrics (rank 0) to runs/<run_name>."""
    shutdown()  # the spawn's own group: each layout below brings its own
    found: dict[str, Any] = {"functions": {}, "model": {}}
    for n in (2, 4):
        with fresh_groups(root, f"functions{n}", cp=n):
            found["functions"].update(check_functions(n))
            if n == 2:
                found["packed"] = packed_sequence_error()
    for tp, cp in LAYOUTS:
        with fresh_groups(root, f"model-tp{tp}-for-cp{cp}", tp=tp):
            reference = {kind: model_loss_and_grads(kind, tp, 1) for kind in KINDS}
        with fresh_groups(root, f"model-tp{tp}-cp{cp}", tp=tp, cp=cp):
            for kind in KINDS:
                ref_loss, ref_grads = reference[kind]
                loss, grads = model_loss_and_grads(kind, tp, cp)
                worst = max(((grads[n] - g).abs().max() / g.abs().max()).item()
                            for n, g in ref_grads.items())
                found["model"][f"{kind} tp={tp} cp={cp}"] = {
                    "loss": abs(loss - ref_loss) / ref_loss, "grad": worst}
    for run in RUNS:
        run_dir = Path(root) / "runs" / run_name(run)
        run_dir.mkdir(parents=True, exist_ok=True)  # every rank
        with fresh_groups(root, f"train-{run_dir.name}", tp=None):
            train(compose_config(train_overrides(*run)), run_dir)
    torch.save(found, Path(root) / f"rank{os.environ['RANK']}.pt")


# ---- the tests ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cp_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    root = tmp_path_factory.mktemp("cp")
    spawn(_all_checks, str(root), world=WORLD, tp=1)
    return [torch.load(root / f"rank{r}.pt") for r in range(WORLD)], root


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"{f} cp={n}" for n in (2, 4) for f in FUNCTIONS])
def test_cp_attention_functions_match_cp1(cp_results, name: str) -> None:
    for rank in cp_results[0]:
        assert rank["functions"][name]["error"] < 1e-10, (name, rank["functions"][name])


@pytest.mark.slow
def test_chunked_cp_exchanges_only_what_chunks_need(cp_results) -> None:
    functions = cp_results[0][0]["functions"]
    for n in (2, 4):
        assert functions[f"chunked C=6 cp={n}"]["sent"] == 0  # whole chunks: no communication
        assert 0 < functions[f"chunked C=5 cp={n}"]["sent"] < functions[f"standard cp={n}"]["sent"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"{k} tp={tp} cp={cp}" for k in KINDS for tp, cp in LAYOUTS])
def test_cp_model_loss_and_gradients_match_cp1(cp_results, name: str) -> None:
    for rank in cp_results[0]:
        assert rank["model"][name]["loss"] < 1e-6 and rank["model"][name]["grad"] < 1e-5, (
            name, rank["model"][name])


@pytest.mark.slow
def test_cp_rejects_packed_sequences(cp_results) -> None:
    assert "packed sequences" in cp_results[0][0]["packed"]


@pytest.fixture(scope="module")
def cp1_metrics(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """The CP=1 reference runs, in this process."""
    root = tmp_path_factory.mktemp("cp1")
    for kind in KINDS:
        (root / kind).mkdir()
        train(compose_config(train_overrides(kind)), root / kind)
    return {kind: read_metrics(root / kind) for kind in KINDS}


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=run_name)
def test_cp_training_matches_cp1(cp_results, cp1_metrics, run: tuple) -> None:
    rows = read_metrics(cp_results[1] / "runs" / run_name(run))
    reference = cp1_metrics[run[0]]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row, ref in zip(rows, reference):
        assert row["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert rows[-1]["loss"] < rows[0]["loss"]


def _pairs(calls: list[CPCall]) -> set[tuple[int, int, int]]:
    """Every (part, query row, key row) the calls compute, block by block."""
    pairs = set()
    for c in calls:
        rows, keys = (c.q1 - c.q0) // c.blocks, (c.k1 - c.k0) // c.blocks
        for j in range(c.blocks):
            for i in range(rows):
                for k in range(keys):
                    if not c.causal or k <= i:
                        pairs.add((c.part, c.q0 + j * rows + i, c.k0 + j * keys + k))
    return pairs


@pytest.mark.parametrize("n, length", [(2, 5), (2, 12), (4, 5), (4, 12), (2, 7)])
def test_joined_blocks_compute_the_same_pairs_in_fewer_calls(n: int, length: int) -> None:
    joined_any = False
    for rank in range(n):
        layout = PieceLayout(n, rank, 96 // n)
        for src in range(n):
            separate = chunk_rectangles(layout, rank, src, length, True)
            joined = join_blocks(separate)
            assert _pairs(joined) == _pairs(separate)
            assert sum(c.blocks for c in joined) == len(separate)
            joined_any |= len(joined) < len(separate)
            for c in joined:  # equal blocks on both axes
                assert (c.q1 - c.q0) % c.blocks == 0 and (c.k1 - c.k0) % c.blocks == 0
    assert joined_any


def test_join_blocks_needs_both_axes_to_continue() -> None:
    stairs = [CPCall(1, 8, 12, 4, 8, False), CPCall(1, 12, 16, 8, 12, False)]
    assert join_blocks(stairs) == [CPCall(1, 8, 16, 4, 12, False, blocks=2)]
    same_keys = [CPCall(2, 8, 12, 0, 4, False), CPCall(2, 12, 16, 0, 4, False)]
    assert join_blocks(same_keys) == same_keys  # coalesce's case (one taller call), not blocks
    other_kind = [CPCall(0, 0, 4, 0, 4, True), CPCall(1, 4, 8, 4, 8, False)]
    assert join_blocks(other_kind) == other_kind


def test_seq_length_must_split_into_2cp_pieces(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"divisible by 2 x parallel.cp \(4\)"):
        train(compose_config(FAST + ["trainer.seq_length=36", "parallel.cp=4"]), tmp_path)


@pytest.mark.slow
def test_cp2_checkpoint_resumes_at_cp2_exactly_and_at_cp1_and_evaluates(tmp_path: Path) -> None:
    common = FAST + ["trainer.max_steps=4", "trainer.save_interval=2"]
    cp2 = train_on_ranks(common + ["parallel.cp=2"], tmp_path / "cp2", nproc=2)
    ckpt = tmp_path / "cp2" / "checkpoints" / "iter_0000002"
    resume = common + [f"checkpoint.load={ckpt}", "checkpoint.save=false"]
    at_cp2 = train_on_ranks(resume + ["parallel.cp=2"], tmp_path / "at_cp2", nproc=2)
    at_cp1 = train_on_ranks(resume, tmp_path / "at_cp1")
    assert [r["loss"] for r in at_cp2] == [r["loss"] for r in cp2[2:]]
    for a, b in zip(at_cp1, at_cp2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-4)
    (tmp_path / "eval").mkdir()
    results = eval_entry.evaluate(compose_config([
        f"checkpoint.load={ckpt}", "eval.lengths=[128]", "eval.depths=[0.5]",
        "eval.multikey_trials=0", "eval.passkey_trials=1", "eval.perplexity_windows=1",
        "logger=none"]), tmp_path / "eval")
    assert results["step"] == 2 and 1 < results["perplexity"][0]["perplexity"] < 384
