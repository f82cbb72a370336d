"""The two-GPU scaling table's plan (bench/scaling.py runs it): the layouts, one case per
(layout, attention, length), the time model that estimates each case from gpt_1p3b's measured
step times, and the order and budget that decide which cases run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.overrides import merge_overrides


@dataclass(frozen=True)
class Setup:
    """One way of running a case: its GPU count, its overrides and its name in tables."""

    gpus: int
    overrides: tuple[str, ...]
    label: str
    sequences: int = 1  # the fewest sequences per step it can run with


LAYOUTS = {
    "1gpu": Setup(1, (), "1 GPU"),
    "cp2": Setup(2, ("parallel.cp=2",), "CP=2"),
    "cp2_serial": Setup(2, ("parallel.cp=2", "parallel.cp_overlap=false"),
                        "CP=2, exchange not overlapped"),
    "dp2": Setup(2, ("parallel.distributed_optimizer=true",), "DP=2 (distributed optimizer)", 2),
    "tp2sp": Setup(2, ("parallel.tp=2", "parallel.sequence_parallel=true",
                       "trainer.fused_norm=true"), "TP=2 + SP, fused norm"),
    "pp2": Setup(2, ("parallel.pp=2",), "PP=2 (1F1B)", 2),
}
ATTENTION_LAYOUTS = {"dca": tuple(LAYOUTS), "standard": ("1gpu", "cp2", "cp2_serial")}
# first-step losses that must equal the 1-GPU row's
COMPARED = {"dp2", "cp2", "cp2_serial"}
NOT_COMPARED = ("not compared: megatron seeds each TP rank's and pipeline stage's initial "
                "weights apart on the GPU, so this layout starts from other weights")
LONG = 131072  # from here: full recompute, one sequence per step
BATCH, LONG_BATCH = 2, 1
STEPS, WARMUP, LONG_STEPS, LONG_WARMUP = 4, 2, 3, 1
LOSS_RTOL = {"cpu": 1e-5, "gpu": 1e-3}  # fp32 on the CPU; bf16 (CP=1/CP=2 differ by ~2e-5)

# ---- the time model ---------------------------------------------------------------------------
# gpt_1p3b, one H100 or H200 at the 700 W cap, cuDNN (docs/benchmarks.md): one sequence's step
# takes ~0.46 x + 0.68 x^2 s at x = seq / 32K (GEMMs grow with the length, attention with its
# square: 1.14 s at 32K, 12.5 s at 128K with full recompute, ~0.40 s at 16K). A process costs
# ~25 s besides its steps (imports, CUDA start, model build, exit: the "process, filled caches"
# figure less its steps), a torchrun of two ~30 s (NCCL), its first step ~4 s more (cuDNN plans,
# compiled kernels loaded), ~10 s more still with a fresh machine's empty compile caches.
PROCESS_S = {1: 25.0, 2: 30.0}
FIRST_STEP_S, COLD_CACHES_S = 4.0, 10.0
# a 2-GPU step over the 1-GPU one of the same global batch
STEP_FACTOR = {"1gpu": 1.0, "dp2": 0.55, "tp2sp": 0.6, "cp2": 0.6, "cp2_serial": 0.65,
               "pp2": 0.8}  # pp2: the 1F1B bubble of 2 micro-batches on 2 stages
SHORT_CP = (32768, 1.1)  # below 32K, CP=2 has run slower than one GPU (GPUs mostly idle)
DEFAULT_BUDGET_S, DEFAULT_DEADLINE_S = 450.0, 540.0


def sequence_step_s(seq: int) -> float:
    x = seq / 32768
    return 0.46 * x + 0.68 * x * x


@dataclass
class Case:
    """One row: what runs, its estimate, then what it gave."""

    layout: str
    attention: str
    seq: int
    steps: int
    warmup: int
    batch: int
    overrides: list[str]
    estimated_s: float = 0.0
    status: str = "planned"  # planned | ok | error | skipped
    reason: str | None = None
    process_s: float | None = None  # wall time of the process that ran it (and others)
    file: Path | None = None  # its bench/train.py result
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.layout}_{self.attention}_{self.seq}"

    @property
    def gpus(self) -> int:
        return LAYOUTS[self.layout].gpus


def step_estimate_s(case: Case) -> float:
    factor = STEP_FACTOR[case.layout]
    if case.layout.startswith("cp2") and case.seq < SHORT_CP[0]:
        factor *= SHORT_CP[1] / STEP_FACTOR["cp2"]
    return case.batch * sequence_step_s(case.seq) * factor


def estimate_s(case: Case, new_process: bool, cold: bool) -> float:
    """Seconds the case takes on gpt_1p3b's time model (above)."""
    return ((PROCESS_S[case.gpus] if new_process else 0.0) + FIRST_STEP_S
            + (COLD_CACHES_S if cold else 0.0) + case.steps * step_estimate_s(case))


def matches(key: str, case: Case) -> bool:
    values = {case.layout, case.attention, str(case.seq)}
    return all(part in values for part in key.split(":"))


def plan(seqs: list[int], attentions: list[str], layouts: list[str], extra: list[str],
         set_for: list[list[str]], budget: float) -> list[Case]:
    """Every case in priority order; those past the budget or unable to run marked skipped."""
    cases = []
    for attention in attentions:
        for seq in seqs:
            long = seq >= LONG
            batch = LONG_BATCH if long else BATCH
            per_seq = [f"trainer.global_batch_size={batch}"]
            per_seq += ["trainer.recompute=full"] if long else []
            for layout in ATTENTION_LAYOUTS[attention]:
                if layout not in layouts:
                    continue
                case = Case(layout, attention, seq, LONG_STEPS if long else STEPS,
                            LONG_WARMUP if long else WARMUP, batch, [])
                case.overrides = merge_overrides(
                    per_seq, extra, list(LAYOUTS[layout].overrides),
                    *[group[1:] for group in set_for if matches(group[0], case)])
                if batch < LAYOUTS[layout].sequences:
                    case.status = "skipped"
                    case.reason = (f"needs {LAYOUTS[layout].sequences} sequences per step; "
                                   f"from {LONG} on a step trains {batch}")
                cases.append(case)
    used, baselines = 0.0, 0
    for case in cases:
        if case.status == "skipped":
            continue
        case.estimated_s = estimate_s(case, new_process=case.gpus > 1 or not baselines,
                                      cold=used == 0.0)
        if budget and used + case.estimated_s > budget:
            case.status = "skipped"
            case.reason = (f"over the time budget: estimated {case.estimated_s:.0f} s after "
                           f"{used:.0f} s of {budget:.0f} s")
            continue
        used += case.estimated_s
        baselines += case.gpus == 1
    for case in cases:  # a 1-GPU row is worth its time only beside a 2-GPU row
        if case.layout == "1gpu" and case.status == "planned" and not any(
                c.status == "planned" and c.gpus > 1 and (c.attention, c.seq) ==
                (case.attention, case.seq) for c in cases):
            case.status = "skipped"
            case.reason = "no 2-GPU row of this length and attention fits the budget"
    return cases
