"""RULER's scores (scripts/eval/synthetic/constants.py) and its effective length.

Per sample, case-insensitive substring matching of the references in the prediction, x100:
    string_match_all  (niah, vt, cwe, fwe): the fraction of references found
                      (a multi-value answer naming 3 of 4 values scores 75)
    string_match_part (qa): 100 when any reference is found, else 0
A (task, length) scores the mean over its samples (RULER rounds it to 2 decimals for display;
kept unrounded here). A length's average is the mean over the tasks scored at it, each task
weighing the same.

Effective length (RULER's paper, Table 3): the longest tested length whose average is above
the threshold (85.6, Llama-2-7B's score at 4K) with every shorter tested length above it too;
"above" is strictly greater. None when the shortest tested length is not above it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from trainer.errors import UserError
from trainer.evals.ruler.specs import Sample

RULER_THRESHOLD = 85.6


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """100 x the fraction of `references` found in `prediction` (case-insensitive)."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    text = prediction.lower()
    return 100.0 * sum(r.lower() in text for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """100 when any of `references` is in `prediction` (case-insensitive), else 0."""
    if not references:
        raise ValueError("string_match_part needs at least one reference")
    text = prediction.lower()
    return 100.0 if any(r.lower() in text for r in references) else 0.0


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


@dataclass
class TaskScore:
    """One (task, length)'s mean score (0..100) over its samples."""

    task: str
    length: int
    score: float
    samples: int


@dataclass
class SuiteResult:
    """Every (task, length) score, each length's average over tasks, the effective length."""

    scores: list[TaskScore]
    averages: dict[int, float]  # length -> mean task score at it
    effective_length: int | None
    threshold: float

    def to_dict(self) -> dict:
        """Plain JSON-ready values (the averages' keys as strings, as JSON has them)."""
        return {"scores": [asdict(s) for s in self.scores],
                "averages": {str(k): v for k, v in self.averages.items()},
                "effective_length": self.effective_length, "threshold": self.threshold}

    @classmethod
    def from_dict(cls, data: Mapping) -> SuiteResult:
        return cls(scores=[TaskScore(**s) for s in data["scores"]],
                   averages={int(k): float(v) for k, v in data["averages"].items()},
                   effective_length=data["effective_length"], threshold=data["threshold"])

    def table(self) -> str:
        """A task x length table of scores, the averages last (for logs)."""
        lengths = sorted(self.averages)
        tasks = list(dict.fromkeys(s.task for s in self.scores))
        cell = {(s.task, s.length): s.score for s in self.scores}
        width = max([len(t) for t in tasks] + [7])
        rows = [" ".join([f"{'task':<{width}}"] + [f"{n:>8}" for n in lengths])]
        for task in tasks:
            rows.append(" ".join([f"{task:<{width}}"] + [
                f"{cell[task, n]:8.2f}" if (task, n) in cell else f"{'-':>8}"
                for n in lengths]))
        rows.append(" ".join([f"{'average':<{width}}"]
                             + [f"{self.averages[n]:8.2f}" for n in lengths]))
        return "\n".join(rows)


def check_threshold(threshold: float) -> float:
    if not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 100.0:
        raise UserError(f"the RULER effective-length threshold must be in (0, 100], "
                        f"got {threshold!r}")
    return float(threshold)


def effective_length(averages_by_length: Mapping[int, float],
                     threshold: float = RULER_THRESHOLD) -> int | None:
    """The longest length L with every tested length <= L averaging above `threshold`."""
    threshold = check_threshold(threshold)
    found = None
    for length in sorted(averages_by_length):
        if not averages_by_length[length] > threshold:
            break
        found = length
    return found


def sample_scores(samples: Sequence[Sample], predictions: Sequence[str]) -> list[float]:
    """Each sample's score (0..100) under its own metric."""
    if len(samples) != len(predictions):
        raise ValueError(f"{len(samples)} samples but {len(predictions)} predictions")
    return [METRICS[s.metric](p, s.references) for s, p in zip(samples, predictions)]


def score_predictions(samples: Sequence[Sample], predictions: Sequence[str],
                      threshold: float = RULER_THRESHOLD) -> SuiteResult:
    """Score `predictions` (the generated text after each sample's prompt, in order)."""
    threshold = check_threshold(threshold)
    per_cell: dict[tuple[str, int], list[float]] = {}
    for sample, score in zip(samples, sample_scores(samples, predictions)):
        per_cell.setdefault((sample.task, sample.length), []).append(score)
    scores = [TaskScore(task, length, sum(v) / len(v), len(v))
              for (task, length), v in per_cell.items()]
    by_length: dict[int, list[float]] = {}
    for s in scores:
        by_length.setdefault(s.length, []).append(s.score)
    averages = {n: sum(v) / len(v) for n, v in sorted(by_length.items())}
    return SuiteResult(scores, averages, effective_length(averages, threshold), threshold)
