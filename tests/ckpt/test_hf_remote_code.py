"""Exports that run as trained: DCA, chunked and head-gated models in transformers (remote code)
against the trainer's own logits (whole sequences and prompts ending around chunk edges), cached
generation (dynamic and static caches) and a cache filled in pieces against recomputation, the
export -> import round trip, and loading without a warning. The attention functions themselves:
test_hf_remote_code_attention.py."""

from __future__ import annotations

import inspect
import json
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaModel, StaticCache

from ckpt.hf_export import export_hf
from ckpt.hf_import import import_hf
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from tests.ckpt import hf_models
from tests.ckpt.longctx_models import (
    CHUNK,
    DCA,
    SEQ,
    VARIANTS,
    VOCAB,
    trainer_logits,
    write_variant,
)
from tests.ckpt.test_hf_export import tensors

hf_imported = hf_models.hf_imported  # the shared fixture
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
_EXPORTED: dict[str, tuple[Path, Path]] = {}
_TRAINER: dict[str, torch.Tensor] = {}
L = DCA.dca_chunk_size - DCA.dca_local_size  # DCA's chunk length (12); chunked layers' is CHUNK


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    """`get(name)` -> (checkpoints root, export) of VARIANTS[name], made once per module."""

    def get(name: str) -> tuple[Path, Path]:
        if name not in _EXPORTED:
            d = tmp_path_factory.mktemp(name)
            export_hf(write_variant(d / "ckpt", name), d / "hf")
            _EXPORTED[name] = d / "ckpt", d / "hf"
        return _EXPORTED[name]

    return get


def load(directory: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True,
                                                dtype=torch.float32).eval()


def trainer(root: Path, name: str) -> torch.Tensor:
    """The trainer's logits of TOKENS for VARIANTS[name], computed once."""
    if name not in _TRAINER:
        _TRAINER[name] = trainer_logits(root, TOKENS)
    return _TRAINER[name]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_exported_model_computes_the_trainers_logits(exported, name: str) -> None:
    """64 tokens: several chunks, the last one partial for DCA (L = 12), GQA (4:2 heads), the
    chunked model's second layer global and without RoPE."""
    root, hf = exported(name)
    ours = trainer(root, name)
    with torch.no_grad():
        theirs = load(hf)(TOKENS).logits
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-4, diff
    _, attention = VARIANTS[name]
    if attention.kind != "standard":  # the test can fail: standard attention is far off
        standard = trainer_logits(root, TOKENS, replace(attention, kind="standard"))
        assert (standard - theirs).abs().max().item() > 0.1


@pytest.mark.parametrize(("name", "lengths"), [
    ("dca-qwen2", [L - 1, L, L + 1, 2 * L + 1, 3 * L - 1]),
    ("dca-yarn-gated", [L - 1, L, L + 1, 2 * L, 4 * L + 1]),
    ("chunked-llama3", [CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1, 3 * CHUNK - 1]),
])
def test_prompts_ending_around_chunk_edges_compute_the_trainers_logits(
        exported, name: str, lengths: list[int]) -> None:
    """Causal models: a prompt's logits are the first rows of the whole sequence's."""
    root, hf = exported(name)
    ours, model = trainer(root, name), load(hf)
    for n in lengths:
        with torch.no_grad():
            theirs = model(TOKENS[:, :n]).logits
        diff = (ours[:, :n] - theirs).abs().max().item()
        assert diff <= 1e-4, (n, diff)


def _recomputed_greedy(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding by a forward of the whole prefix per token (no cache)."""
    seq = prompt
    for _ in range(steps):
        with torch.no_grad():
            logits = model(seq, use_cache=False).logits[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompt.shape[1]:]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_generate_with_the_cache_is_greedy_recomputation(exported, name: str,
                                                         cache: str) -> None:
    """64 new tokens after a 20-token prompt (prefilled in one call, then token by token) cross
    four chunk boundaries (16, 32, ...); a static cache is transformers' preallocated one."""
    model = load(exported(name)[1])
    prompt = TOKENS[:1, :20]
    static = {"cache_implementation": "static"} if cache == "static" else {}
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                attention_mask=torch.ones_like(prompt), **static)[:, 20:]
    assert cached.shape[1] == 64
    assert torch.equal(cached, _recomputed_greedy(model, prompt, 64))


# a prompt in one call, single tokens across an edge (12, 16), new tokens in calls of several
# (starting inside a chunk, against the cache), single tokens again: 64 tokens in all
PIECES = [11, 1, 1, 1, 1, 18, 1, 1, 1, 1, 25, 1, 1]
# the model's keyword for a cache: `cache` in recent transformers releases (5.24),
# `past_key_values` in earlier ones (5.17); the other one would reach the layers but not the
# model's positions
CACHE_KEYWORD = next(name for name in ("cache", "past_key_values")
                     if name in inspect.signature(LlamaModel.forward).parameters)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_cache_filled_in_pieces_gives_the_logits_of_one_forward(exported, name: str,
                                                                  cache: str) -> None:
    model = load(exported(name)[1])
    kv = (DynamicCache(config=model.config) if cache == "dynamic"
          else StaticCache(config=model.config, max_cache_len=SEQ + 16))
    logits, start = [], 0
    with torch.no_grad():
        for n in PIECES:
            logits.append(model(TOKENS[:, start:start + n], use_cache=True,
                                **{CACHE_KEYWORD: kv}).logits)
            start += n
        whole = model(TOKENS, use_cache=False).logits
    assert start == SEQ
    diff = (torch.cat(logits, dim=1) - whole).abs().max().item()
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("name", ["dca-qwen2", "dca-yarn-gated", "chunked-llama3"])
def test_export_import_round_trip_keeps_every_tensor_and_setting(exported, tmp_path: Path,
                                                                 name: str) -> None:
    root, hf = exported(name)
    import_hf(hf, tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    first, second = tensors(hf), tensors(tmp_path / "hf")
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
    assert json.loads((hf / "config.json").read_text()) == \
        json.loads((tmp_path / "hf" / "config.json").read_text())
    model, attention = VARIANTS[name]
    saved = Checkpoint(resolve_checkpoint(tmp_path / "ckpt")).meta
    assert saved.attention == attention
    assert {k: v for k, v in asdict(saved.model).items()
            if k.startswith("rope_") or k == "qkv_bias"} \
        == {k: v for k, v in asdict(model).items() if k.startswith("rope_") or k == "qkv_bias"}


def test_sglang_reads_dual_chunk_attention_from_a_qwen2_dca_export(exported) -> None:
    """sglang serves DCA for Qwen2 configs with `dual_chunk_attention_config`; its rotary uses
    min(r + L, C) and min(2L - 1, C) as ours, and original_max_position_embeddings > 0 would turn
    on a length-dependent scaling the trainer did not use."""
    cfg = json.loads((exported("dca-qwen2")[1] / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert cfg["dual_chunk_attention_config"] == {
        "chunk_size": 16, "local_size": 4, "original_max_position_embeddings": 0}
    for name in ("dca-yarn-gated", "chunked-llama3", "gated-qwen2"):  # nothing sglang can run
        cfg = json.loads((exported(name)[1] / "config.json").read_text())
        assert cfg["model_type"] == "longctx" and "dual_chunk_attention_config" not in cfg


@contextmanager
def no_warnings() -> Iterator[list[logging.LogRecord]]:
    """Python warnings raise; transformers' logger warnings are collected (the caller asserts
    there are none)."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("transformers")
    handler = Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield records
    finally:
        logger.removeHandler(handler)


def test_loading_an_export_emits_no_warning(exported, hf_imported, tmp_path: Path) -> None:
    """Remote-code exports, a llama3-rope Llama (only its rope keys) and a Mistral (exported as
    Mistral) load without a single warning."""
    _, llama = hf_imported("llama", False)
    _, mistral = hf_imported("mistral", True)
    export_hf(llama, tmp_path / "llama")
    export_hf(mistral, tmp_path / "mistral")
    assert set(json.loads((tmp_path / "llama" / "config.json").read_text())["rope_scaling"]) \
        == {"rope_type", "factor", "original_max_position_embeddings", "low_freq_factor",
            "high_freq_factor"}
    directories = [exported(name)[1] for name in VARIANTS] + [tmp_path / "llama",
                                                               tmp_path / "mistral"]
    for directory in directories:
        with no_warnings() as records:
            model = load(directory)
        assert not records, (directory.name, [r.getMessage() for r in records])
    assert type(model).__name__ == "MistralForCausalLM"


# DCA's logit scalings, steep enough to move these models' logits (CHUNK = 16, L = 12)
SCALED = {"log": {"dca_scaling": "log", "dca_scaling_parts": "succ_inter",
                  "dca_scaling_attn_scale": 0.5, "dca_scaling_floor_scale": 8},
          "yarn": {"dca_scaling": "yarn", "dca_scaling_attn_scale": 0.5,
                   "dca_scaling_original_length": 16}}


def _engine_greedy(root: Path, prompt: list[int], steps: int) -> list[int]:
    """The trainer's engine (trainer/engine) decoding the checkpoint's model, greedy, fp32."""
    from models.gpt import build_model
    from models.schema import ParallelConfig
    from parallel.distributed import initialize_parallel, shutdown
    from trainer.engine import DecodeEngine

    ckpt = resolve_checkpoint(root)
    saved = Checkpoint(ckpt).meta
    initialize_parallel(torch.device("cpu"), tp=1, seed=0)
    try:
        built = build_model(saved.model, saved.attention, ParallelConfig(), vocab_size=VOCAB,
                            max_sequence_length=SEQ)
        from ckpt.load import load_model_weights
        load_model_weights(ckpt, built.gpt)
        return DecodeEngine(built.gpt.eval(), VOCAB).generate([prompt], steps)[0]
    finally:
        shutdown()


@pytest.mark.parametrize("kind", list(SCALED))
def test_a_scaled_dca_export_runs_as_the_trainer_and_decodes_as_its_engine(
        tmp_path: Path, kind: str) -> None:
    """DCA with a logit scaling exports with it: whole-sequence logits equal the trainer's
    (1e-4, fp32; and differ from the unscaled model's), transformers' cached greedy decoding
    equals the trainer's engine (`yarn`: both give a token the factor of the sequence's length
    when it is computed), and import-hf reads the scaling back."""
    root = write_variant(tmp_path / "ckpt", "dca-qwen2", **SCALED[kind])
    export_hf(root, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["longctx"]["dca_scaling"] == kind
    assert config["model_type"] == "longctx"  # attn_scale 0.5: no serving engine's scaling
    if kind == "yarn":  # with its source's constants sglang computes it from this length
        export_hf(write_variant(tmp_path / "src", "dca-qwen2", dca_scaling="yarn"),
                  tmp_path / "served")
        served = json.loads((tmp_path / "served" / "config.json").read_text())
        assert served["model_type"] == "qwen2"
        assert served["dual_chunk_attention_config"]["original_max_position_embeddings"] == CHUNK
    model = load(tmp_path / "hf")
    ours = trainer_logits(root, TOKENS)
    with torch.no_grad():
        theirs = model(TOKENS).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    _, attention = VARIANTS["dca-qwen2"]
    assert (trainer_logits(root, TOKENS, attention) - theirs).abs().max().item() > 1e-2
    prompt = TOKENS[:1, :20]
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                                attention_mask=torch.ones_like(prompt))[0, 20:].tolist()
    assert cached == _engine_greedy(root, prompt[0].tolist(), 40)
    import_hf(tmp_path / "hf", tmp_path / "back")
    back = Checkpoint(resolve_checkpoint(tmp_path / "back")).meta.attention
    saved = Checkpoint(resolve_checkpoint(root)).meta.attention
    assert back == replace(saved, dca_scaling_original_length=saved.dca_scaling_original_length
                           or saved.dca_chunk_size)
