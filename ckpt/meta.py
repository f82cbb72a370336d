"""What a checkpoint says about itself beside its tensors: one typed record, `CheckpointMeta`.

Every writer (the trainer, `reshape`, `import-hf`) saves it with `to_saved` as the common state's
`extra`, and every reader (`Checkpoint.meta`) gets it back with `from_saved`, so the model, its
attention, its layout and its vocabulary are read without the run config that trained it (as
litgpt keeps a model config beside the weights). The run config itself is carried verbatim
(`run_config`) for the trainer's own resume checks; ckpt never reads it.

Checkpoints saved before this record existed (`extra` without `meta_version`: the run config's
`model`, `attention`, `trainer` and `data` groups, `tp` and `layout` at the top) are read into the
same record. The model's record holds what the model is; how a run ran it (the attention kernel,
DCA's backward path and kept rotations) is in the run config's `trainer` group alone. Records
written while the attention block still held those (`MOVED_FROM_ATTENTION`) read with them
dropped.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import OmegaConf

from ckpt.saved_config import read_saved_config
from models.options import MOVED_FROM_ATTENTION
from models.schema import AttentionConfig, ModelConfig
from models.validation import (
    SettingError,
    check_length,
    check_settings,
    check_value,
    check_vocab,
    flag,
    text,
    whole,
)
from parallel.placement import Layout

META_VERSION = 2
# The byte tokenizer's vocabulary (256 bytes + end of document), for runs saved before the
# vocabulary was recorded.
BYTE_VOCAB = 257
# Bounds of the record's own values (the model's are models.validation's).
MAX_STEP = 1 << 40
MAX_WORLD = 1 << 20  # ranks along any one layout axis
WANDB_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # wandb's run ids: letters, digits, '-', '_'


class MetaError(ValueError):
    """A saved record that cannot be read (a missing or mistyped field); the message names it."""


@dataclass(frozen=True)
class HFSource:
    """The Hugging Face model a checkpoint was imported from."""

    path: str
    architecture: str  # e.g. LlamaForCausalLM
    vocab_size: int
    config_json: str  # its config.json, verbatim


@dataclass(frozen=True)
class CheckpointMeta:
    """A checkpoint's model, layout and provenance (see the module docstring)."""

    model: ModelConfig
    attention: AttentionConfig
    layout: Layout
    seq_length: int  # the sequence length it was trained (or, imported: is documented) at
    vocab_size: int  # the real vocabulary: the embedding's rows without padding
    tokenizer: str  # byte | a `tokenizers` JSON file | a Hugging Face model directory
    step: int = 0
    consumed_samples: int = 0  # the data position, in samples
    seed: int | None = None
    wandb_id: str | None = None
    model_only: bool = False  # weights alone (import-hf, reshape --model-only): a fine-tune start
    hf_source: HFSource | None = None
    reshaped_from: Layout | None = None
    run_config: str | None = field(default=None, repr=False)  # the trainer's resolved config

    def replace(self, **changes: Any) -> CheckpointMeta:
        return dataclasses.replace(self, **changes)

    def to_saved(self) -> dict[str, Any]:
        """Plain Python values only, so the common state loads with `weights_only=True` (a
        choice, a `StrEnum` member, as its string)."""
        saved = _plain(dataclasses.asdict(self))
        saved["meta_version"] = META_VERSION
        return saved

    @classmethod
    def from_saved(cls, extra: dict[str, Any], embedding_rows: int, where: str) -> CheckpointMeta:
        """The record in a checkpoint's `extra` (either format); `embedding_rows` stands in for
        a vocabulary an older checkpoint did not record; `where` names it in errors."""
        if not isinstance(extra, dict):
            raise MetaError(f"{where}: the saved extra state is a {type(extra).__name__}, not a "
                            "mapping")
        try:
            if extra.get("meta_version") == META_VERSION:
                meta = _current(extra)
            elif "meta_version" in extra:
                raise MetaError(f"meta_version {extra['meta_version']!r} is not one this version"
                                f" reads ({META_VERSION})")
            else:
                meta = _legacy(extra, embedding_rows)
            check_record(meta)
            return meta
        except SettingError as e:
            raise MetaError(f"{where}: the checkpoint's record is damaged or edited: {e}") from e
        except (KeyError, TypeError, ValueError) as e:
            raise MetaError(f"{where}: cannot read the checkpoint's record: "
                            f"{type(e).__name__}: {e}") from e


def check_record(meta: CheckpointMeta) -> None:
    """Every value of the record typed and in range (`SettingError` naming it): the model and
    attention through `models.validation`, the one check every model source shares; the
    layout, length, vocabulary, step, data position, seed, wandb id and source here."""
    check_settings(meta.model, meta.attention)
    for name, layout in (("layout", meta.layout), ("reshaped_from", meta.reshaped_from)):
        if layout is not None:
            for key in ("tp", "cp", "pp", "vpp", "dp"):
                check_value(getattr(layout, key), whole(1, MAX_WORLD), f"{name}.{key}")
            check_value(layout.distributed_optimizer, flag, f"{name}.distributed_optimizer")
    check_length(meta.seq_length, "seq_length")
    check_vocab(meta.vocab_size, "vocab_size")
    check_value(meta.tokenizer, text(4096), "tokenizer")
    check_value(meta.step, whole(0, MAX_STEP), "step")
    check_value(meta.consumed_samples, whole(0, 1 << 62), "consumed_samples")
    check_value(meta.seed, whole(-(1 << 63), (1 << 64) - 1, optional=True), "seed")
    check_value(meta.wandb_id, _run_id, "wandb_id")
    check_value(meta.model_only, flag, "model_only")
    if meta.run_config is not None:
        check_value(meta.run_config, text(1 << 20), "run_config")
    if meta.hf_source is not None:
        source = meta.hf_source
        check_value(source.path, text(4096), "hf_source.path")
        check_value(source.architecture, text(200), "hf_source.architecture")
        check_vocab(source.vocab_size, "hf_source.vocab_size")
        check_value(source.config_json, text(1 << 20), "hf_source.config_json")


def _run_id(value: Any) -> str | None:
    """None for null or a wandb run id (the trainer resumes its wandb run by it)."""
    if value is None or (isinstance(value, str) and WANDB_ID.fullmatch(value)):
        return None
    return "null or a wandb run id (1 to 128 letters, digits, '-' or '_')"


def _typed(cls: type, values: dict[str, Any] | None) -> Any:
    """A schema dataclass from saved values; keys it does not know are refused."""
    if values is not None and not isinstance(values, dict):
        raise TypeError(f"{cls.__name__}: the record holds a {type(values).__name__} "
                        f"({values!r:.60}), not a mapping of settings")
    values = dict(values or {})
    unknown = sorted(set(values) - set(cls.__dataclass_fields__))
    if unknown:
        raise KeyError(f"{cls.__name__} has no field(s) {unknown}")
    return cls(**values)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Enum):
        return value.value
    return value


def _attention(values: Any) -> AttentionConfig:
    """The model's attention from a record's attention block, without the run settings a record
    written before they moved out of it holds (`MOVED_FROM_ATTENTION`: the kernel, DCA's
    backward path and kept rotations; not the model, whatever their value)."""
    if isinstance(values, dict):
        values = {k: v for k, v in values.items() if k not in MOVED_FROM_ATTENTION}
    return _typed(AttentionConfig, values)


def _current(extra: dict[str, Any]) -> CheckpointMeta:
    values = {k: v for k, v in extra.items() if k != "meta_version"}
    values["model"] = _typed(ModelConfig, values["model"])
    values["attention"] = _attention(values["attention"])
    values["layout"] = _layout(values["layout"])
    if values.get("reshaped_from") is not None:
        values["reshaped_from"] = _layout(values["reshaped_from"])
    if values.get("hf_source") is not None:
        values["hf_source"] = _typed(HFSource, values["hf_source"])
    return _typed(CheckpointMeta, values)


def _layout(saved: Any) -> Layout:
    if not isinstance(saved, dict):
        raise TypeError(f"layout: the record holds a {type(saved).__name__} ({saved!r:.60}), "
                        "not a mapping of sizes")
    return Layout.from_dict(saved)


def _legacy(extra: dict[str, Any], embedding_rows: int) -> CheckpointMeta:
    """An `extra` written before `meta_version` 2: the run config as YAML, layout at the top."""
    if "config" not in extra:
        raise KeyError("config: the checkpoint holds no run config")
    # read as data (no interpolation, bounded), then the literal strings back
    config = OmegaConf.to_container(read_saved_config(extra["config"]), resolve=True)
    trainer, data = config.get("trainer") or {}, config.get("data") or {}
    hf = extra.get("hf_source")
    layout = Layout.from_dict({"tp": int(extra.get("tp", 1)), **(extra.get("layout") or {})})
    reshaped = extra.get("reshaped_from")
    return CheckpointMeta(
        model=_typed(ModelConfig, config["model"]),
        attention=_attention(config.get("attention")),
        layout=layout,
        seq_length=int(trainer["seq_length"]),
        vocab_size=int((hf or {}).get("vocab_size") or extra.get("vocab_size")
                       or (BYTE_VOCAB if data.get("tokenizer", "byte") == "byte" else 0)
                       or embedding_rows),
        tokenizer=str(data.get("tokenizer", "byte")),
        step=int(extra.get("step", 0)),
        consumed_samples=int(extra.get("consumed_samples", 0)),
        # import-hf wrote a placeholder seed into the run config it made up
        seed=None if hf else trainer.get("seed"),
        wandb_id=extra.get("wandb_id"),
        model_only=bool(extra.get("model_only", False)),
        hf_source=_typed(HFSource, hf) if hf else None,
        reshaped_from=Layout.from_dict(reshaped) if reshaped else None,
        # imports made the run config up; trained checkpoints keep theirs for resume checks
        run_config=None if hf else extra["config"],
    )
