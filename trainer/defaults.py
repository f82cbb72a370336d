"""Defaults that follow what the user typed, each said once in the log when it is not the plain
value: the lr floor and warm-up of a run, and the DCA and chunked attention sizes of its length.

- `trainer.min_lr` unset: `lr / 10` (a resume with the saved `lr`: the saved floor).
- `trainer.warmup_steps` unset: 5 steps, `max_steps // 2` for a run of under 10 steps (a resume:
  the saved value), so `trainer.max_steps=5` trains rather than being refused.
- `attention.dca_chunk_size`, `attention.chunk_size` unset (`conf/attention/*.yaml` interpolate
  `trainer.seq_length` through `chunk_default`): seq_length / 4, at most 8192 (Llama 4's and the
  DCA paper's chunk), so the default job's sequence spans several chunks and a 32K run keeps 8192;
  `dca_local_size` is an eighth of the chunk (1024 at 8192). That is for a model trained from
  scratch with DCA.
- DCA applied to a model that exists (a checkpoint to evaluate, generate from, fine-tune or
  export) with its sizes unset: the sizes it was trained with when it was trained with DCA, else
  ChunkLlama's split of its own length T (`models.schema.dca_pretrained_split`: 3T/4, T/16;
  measured on a real pretrained model in docs/experiments.md). With the `log` logit scaling on
  such a model and `dca_scaling_floor_scale` unset, the temperature starts at T
  (`models.schema.dca_pretrained_log_floor`: 1 within the length the model was trained to);
  otherwise floor_scale is Llama 4's 8192. A chunk chosen without a local window keeps the
  default window while it is below the chunk (`models.schema.dca_local_within`).
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf, open_dict

from models.schema import (
    AttentionConfig,
    DCAScalingKind,
    dca_local_within,
    dca_pretrained_log_floor,
    dca_pretrained_split,
)

log = logging.getLogger(__name__)

WARMUP_STEPS = 5
LONGEST_CHUNK = 8192


def chunk_default(seq_length: int) -> int:
    """The chunk of a run of `seq_length` tokens: a quarter of it, between 2 and 8192."""
    return max(2, min(LONGEST_CHUNK, int(seq_length) // 4))


def local_default(chunk_size: int) -> int:
    """DCA's local window: an eighth of its chunk (at least 1, below the chunk)."""
    return max(1, int(chunk_size) // 8)


def floor_default() -> int:
    """The `log` scaling's floor_scale where nothing sets it: Llama 4's (AttentionConfig's)."""
    return AttentionConfig.dca_scaling_floor_scale


DCA_SIZES = ("dca_chunk_size", "dca_local_size")
FLOOR = "dca_scaling_floor_scale"


def set_sizes(attention: DictConfig) -> set[str]:
    """The DCA sizes and the log scaling's floor given a value (the rest still hold
    conf/attention/dca.yaml's defaults, the `chunk_default` and `floor_default`
    interpolations)."""
    return {k for k in (*DCA_SIZES, FLOOR)
            if k in attention and not OmegaConf.is_interpolation(attention, k)}


def adopt_dca_split(attention: DictConfig, trained_kind: str, trained_sizes: tuple[int, int],
                    length: int, typed: set[str]) -> str | None:
    """DCA applied to an existing model (trained with `trained_kind`, at `trained_sizes` if that
    was DCA; its own length `length`): fill the sizes not in `typed` (`set_sizes`), and for a
    model trained without DCA the log scaling's floor, in place; returns the one log line that
    says what was chosen (None when nothing was)."""
    if attention.kind != "dca":
        return None
    notes = []
    if not set(DCA_SIZES) <= typed:
        notes.append(_adopt_sizes(attention, trained_kind, trained_sizes, length, typed))
    if trained_kind != "dca" and attention.get("dca_scaling") == DCAScalingKind.log \
            and FLOOR not in typed:
        with open_dict(attention):
            attention[FLOOR] = dca_pretrained_log_floor(length)
        notes.append(f"log scaling from the model's length {length} on (set "
                     f"attention.{FLOOR} to choose)")
    return "; ".join(notes) or None


def _adopt_sizes(attention: DictConfig, trained_kind: str, trained_sizes: tuple[int, int],
                 length: int, typed: set[str]) -> str:
    if trained_kind == "dca":
        chunk, local = trained_sizes
        why = "the sizes the model was trained with"
    else:
        chunk, local = dca_pretrained_split(length)
        why = f"ChunkLlama's split of the model's length {length}: 3T/4 and T/16"
    if "dca_chunk_size" in typed:
        chunk = attention.dca_chunk_size
        local = dca_local_within(local, chunk)
    if "dca_local_size" in typed:
        local = attention.dca_local_size
    with open_dict(attention):
        attention.dca_chunk_size, attention.dca_local_size = int(chunk), int(local)
    return (f"DCA chunk {chunk}, local window {local} ({why}); set attention.dca_chunk_size "
            "and attention.dca_local_size to choose")


def register_resolvers() -> None:
    """The resolvers `conf/attention/*.yaml` use (idempotent)."""
    for name, fn in (("chunk_default", chunk_default), ("local_default", local_default),
                     ("floor_default", floor_default)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def resolve_schedule(cfg: DictConfig, saved: DictConfig | None = None) -> None:
    """Fill the unset `trainer.min_lr` and `trainer.warmup_steps` in place (so the checkpoint's
    config records the values used); `saved` is the resumed checkpoint's config."""
    t = cfg.trainer
    saved_t = saved.trainer if saved is not None and "trainer" in saved else None
    if t.min_lr is None:
        if saved_t is not None and saved_t.get("min_lr") is not None and saved_t.lr == t.lr:
            t.min_lr = saved_t.min_lr
        else:
            t.min_lr = t.lr / 10
    if t.warmup_steps is None:
        if saved_t is not None and saved_t.get("warmup_steps") is not None:
            t.warmup_steps = saved_t.warmup_steps
        else:
            t.warmup_steps = min(WARMUP_STEPS, t.max_steps // 2)
            if t.warmup_steps < WARMUP_STEPS:
                log.info("warm-up shortened to %d steps (trainer.max_steps=%d is under %d; "
                         "set trainer.warmup_steps to choose)", t.warmup_steps, t.max_steps,
                         2 * WARMUP_STEPS)


def degenerate_attention(attention: DictConfig, seq_length: int) -> str | None:
    """One line when the attention variant computes plain causal attention at `seq_length`
    (the whole sequence fits in one chunk), else None."""
    if attention.kind == "dca":
        span = attention.dca_chunk_size - attention.dca_local_size
        if seq_length <= span:
            return (f"attention=dca computes plain causal attention here: {seq_length} tokens fit "
                    f"in one chunk (dca_chunk_size {attention.dca_chunk_size} - dca_local_size "
                    f"{attention.dca_local_size} = {span}); lower attention.dca_chunk_size to "
                    "exercise it")
    if attention.kind == "chunked" and seq_length <= attention.chunk_size:
        return (f"attention=chunked computes plain causal attention here: {seq_length} tokens fit "
                f"in one chunk (attention.chunk_size {attention.chunk_size}); lower "
                "attention.chunk_size to exercise it")
    return None
