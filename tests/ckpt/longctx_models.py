"""Tiny random checkpoints of each attention variant, written as the trainer writes them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ckpt.load import load_model_weights
from ckpt.meta import CheckpointMeta
from ckpt.paths import resolve_checkpoint
from ckpt.reader import Checkpoint
from ckpt.save import write_checkpoint
from models.gpt import build_model
from models.schema import AttentionConfig, ModelConfig, ParallelConfig
from parallel.distributed import initialize_parallel, shutdown
from parallel.placement import Layout

VOCAB = 300
CHUNK = 16  # every chunk size below: tests run at 4x it
SEQ = 4 * CHUNK
# init_std 0.2: peaked attention, so a wrong position or mask moves the logits visibly
MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=96, kv_channels=16, init_std=0.2, layernorm_epsilon=1e-6,
                    untie_embeddings=True)
DCA = AttentionConfig(kind="dca", dca_chunk_size=CHUNK, dca_local_size=4)
VARIANTS = {
    # sglang-servable: Qwen2-shaped DCA, no RoPE scaling, no gate
    "dca-qwen2": (replace(MODEL, qkv_bias=True, rope_theta=1e6), DCA),
    "dca-yarn-gated": (replace(MODEL, rope_scaling_type="yarn", rope_scaling_factor=4.0,
                               rope_original_max_position=CHUNK),
                       replace(DCA, head_wise_attn_gate=True)),
    "chunked-llama3": (replace(MODEL, rope_theta=500.0, rope_scaling_type="llama3",
                               rope_scaling_factor=8.0, rope_original_max_position=CHUNK,
                               untie_embeddings=False),
                       AttentionConfig(kind="chunked", chunk_size=CHUNK, global_layer_interval=2)),
    "gated-qwen2": (replace(MODEL, qkv_bias=True),
                    AttentionConfig(head_wise_attn_gate=True)),
}


def write_variant(root: Path, name: str, seed: int = 0, seq_length: int = SEQ,
                  **attention_settings) -> Path:
    """A model-only checkpoint of VARIANTS[name] (its attention settings replaced by
    `attention_settings`), trained length `seq_length`, with random weights (TP=1, fp32)."""
    model, attention = VARIANTS[name]
    attention = replace(attention, **attention_settings)
    initialize_parallel(torch.device("cpu"), tp=1, seed=seed)
    try:
        built = build_model(model, attention, ParallelConfig(), vocab_size=VOCAB,
                            max_sequence_length=seq_length)
        meta = CheckpointMeta(model=model, attention=attention, layout=Layout(),
                              seq_length=seq_length, vocab_size=VOCAB, tokenizer="byte",
                              model_only=True)
        write_checkpoint(root, 0, {"model": built.gpt.sharded_state_dict(),
                                   "extra": meta.to_saved()})
    finally:
        shutdown()
    return root


def trainer_logits(root: Path, tokens: torch.Tensor,
                   attention: AttentionConfig | None = None) -> torch.Tensor:
    """The trainer's logits for `tokens` [b, s]: the checkpoint's model with its own attention
    (or `attention`)."""
    ckpt = resolve_checkpoint(root)
    saved = Checkpoint(ckpt).meta
    initialize_parallel(torch.device("cpu"), tp=1, seed=0)
    try:
        built = build_model(saved.model, attention or saved.attention, ParallelConfig(),
                            vocab_size=VOCAB,
                            max_sequence_length=tokens.shape[1])
        load_model_weights(ckpt, built.gpt)
        with torch.no_grad():
            out = built.gpt.eval()(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    finally:
        shutdown()
    return out[..., :VOCAB]
