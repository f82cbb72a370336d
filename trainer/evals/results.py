"""`eval.json`: what `trainer.eval` measured, typed, read and written here alone.

One `EvalResults` per evaluation: where the model came from and how it ran (checkpoint, step,
attention, RoPE, trained length, the label that names them), then the suite's measurements:
passkey, multi-key, perplexity by position and the attention probe (`suite` passkey), or the
RULER-style suite's scores (`suite` ruler). The JSON keeps each cell's derived accuracy and
perplexity beside its counts, for readers without this module.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainer.evals.ruler.scoring import SuiteResult


@dataclass
class PasskeyCell:
    length: int
    depth: float
    correct: int
    trials: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials


@dataclass
class PositionBucket:
    """Next-token loss of the predictions made at input positions [start, end) of a window."""

    start: int
    end: int
    nll: float  # mean over the bucket's tokens (nats)
    tokens: int

    @property
    def perplexity(self) -> float:
        return _perplexity(self.nll)


@dataclass
class PerplexityPoint:
    length: int
    nll: float  # mean next-token loss (nats) over the windows
    windows: int
    buckets: list[PositionBucket] = field(default_factory=list)

    @property
    def perplexity(self) -> float:
        return _perplexity(self.nll)


def _perplexity(nll: float) -> float:
    """e^nll; inf where that overflows a float (a diverged model's loss, above ~709 nats)."""
    try:
        return math.exp(nll)
    except OverflowError:
        return math.inf


@dataclass
class AttentionPoint:
    """Where the model's attention goes at one length (models/attention/probe.py): per layer,
    the mean entropy (nats) of queries at positions [length/2, length) and their probability
    mass on keys at each distance bucket [edges[k], edges[k + 1])."""

    length: int
    rows: list[int]
    edges: list[int]
    entropy: list[float]  # per layer, layer 1 first
    mass: list[list[float]]  # per layer, per distance bucket


@dataclass
class MultiKeyCell:
    length: int
    depth: float
    correct: int
    distractor: int  # trials answered with a distractor's value
    trials: int
    keys: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials


@dataclass
class EvalResults:
    checkpoint: str
    step: int
    trained_attention: str  # the attention kind the checkpoint was trained with
    attention: dict[str, Any]  # the attention settings evaluated with, resolved
    label: str  # attention kind, DCA scaling and RoPE scaling, e.g. "dca+yarn(...)"
    rope: dict[str, Any]  # the model's rope_* settings evaluated with
    trained_length: int
    suite: str = "passkey"  # passkey | ruler
    passkey: list[PasskeyCell] = field(default_factory=list)
    multikey: list[MultiKeyCell] = field(default_factory=list)
    perplexity: list[PerplexityPoint] = field(default_factory=list)
    attention_by_distance: list[AttentionPoint] = field(default_factory=list)
    ruler: SuiteResult | None = None
    ruler_settings: dict[str, Any] | None = None  # tasks, samples, template, seed
    # wall seconds per phase (trainer/timing.py): "before" is the process's age when timing
    # began; "engine.*" split the decoding phases' time
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("checkpoint", "step", "trained_attention",
                                              "attention", "label", "rope", "trained_length",
                                              "suite", "seconds")}
        if self.suite == "ruler":
            return out | {"ruler": self.ruler.to_dict() if self.ruler else None,
                          "ruler_settings": self.ruler_settings}
        return out | {
            "passkey": [asdict(c) | {"accuracy": c.accuracy} for c in self.passkey],
            "multikey": [asdict(c) | {"accuracy": c.accuracy} for c in self.multikey],
            "perplexity": [asdict(p) | {"perplexity": p.perplexity, "buckets": [
                asdict(b) | {"perplexity": b.perplexity} for b in p.buckets]}
                for p in self.perplexity],
            "attention_by_distance": [asdict(a) for a in self.attention_by_distance]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResults:
        def fields(row: dict, *derived: str) -> dict:
            return {k: v for k, v in row.items() if k not in derived}

        return cls(
            checkpoint=d["checkpoint"], step=d["step"], trained_attention=d["trained_attention"],
            attention=d["attention"], label=d["label"], rope=d["rope"],
            trained_length=d["trained_length"], suite=d.get("suite", "passkey"),
            passkey=[PasskeyCell(**fields(c, "accuracy")) for c in d.get("passkey", [])],
            multikey=[MultiKeyCell(**fields(c, "accuracy")) for c in d.get("multikey", [])],
            perplexity=[PerplexityPoint(**fields(p, "perplexity", "buckets"), buckets=[
                PositionBucket(**fields(b, "perplexity")) for b in p["buckets"]])
                for p in d.get("perplexity", [])],
            attention_by_distance=[AttentionPoint(**a)
                                   for a in d.get("attention_by_distance", [])],
            ruler=SuiteResult.from_dict(d["ruler"]) if d.get("ruler") else None,
            ruler_settings=d.get("ruler_settings"), seconds=d.get("seconds", {}))

    def write(self, run_dir: Path) -> Path:
        """run_dir/eval.json, whole or not at all (a temporary name renamed)."""
        path = Path(run_dir) / "eval.json"
        tmp = path.with_name(f".eval.json.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: str | os.PathLike) -> EvalResults:
        return cls.from_dict(json.loads(Path(path).read_text()))
