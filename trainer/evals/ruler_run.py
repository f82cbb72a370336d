"""The RULER-style suite (trainer/evals/ruler) run on a model: samples built from the run's own
validation text, decoded by the engine (trainer/engine), scored, plotted.

`trainer.eval ... eval.suite=ruler` runs it on a checkpoint; `eval.train_tasks` runs a subset at
every `trainer.eval_interval` of a training run. Data-parallel ranks share the samples (each
decodes every world-size-th one) and gather the texts, so every rank returns the same result.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from trainer.engine import DecodeEngine, EngineOptions
from trainer.evals.decoding import engine_takes
from trainer.evals.ruler import SuiteResult, score_predictions
from trainer.evals.ruler.specs import Sample, TaskSpec
from trainer.evals.ruler.suite import build_samples, check_lengths, select_tasks, write_jsonl
from trainer.evals.ruler.templates import load_chat_template
from trainer.timing import Phases

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SuiteSettings:
    """What the suite runs (the `eval` group's suite fields, checked)."""

    tasks: tuple[str, ...] | None  # None: every task that can run
    lengths: tuple[int, ...]
    samples: int
    seed: int
    template: str  # base | chat | auto
    threshold: float
    qa_file: str | None


def chat_template_of(tokenizer_spec: str) -> str | None:
    """The chat template beside a tokenizer (a Hugging Face model directory or its
    tokenizer.json), if it has one."""
    if tokenizer_spec == "byte":
        return None
    path = Path(tokenizer_spec)
    return load_chat_template(path if path.is_dir() else path.parent)


def haystack_text(tokenizer, stream, tokens: int) -> str:
    """About `tokens` tokens of the validation stream as text (document separators dropped):
    the essay tasks' haystack, text the model did not train on."""
    ids = np.asarray(stream[:tokens]).astype(np.int64)
    return tokenizer.decode(ids[ids != tokenizer.eod].tolist())


def prepare(settings: SuiteSettings, tokenizer, tokenizer_spec: str, stream
            ) -> tuple[list[TaskSpec], list[Sample]]:
    """The task specs (checked: names, QA file, lengths) and every sample."""
    specs = select_tasks(list(settings.tasks) if settings.tasks else None, settings.qa_file)
    chat = chat_template_of(tokenizer_spec) if settings.template != "base" else None
    check_lengths(specs, settings.lengths, tokenizer, template=settings.template,
                  chat_template=chat, seed=settings.seed)
    text = haystack_text(tokenizer, stream, 4 * max(settings.lengths)) \
        if any(s.needs_text for s in specs) else None
    samples = build_samples(specs, settings.lengths, settings.samples, tokenizer,
                            settings.seed, text, settings.template, chat)
    return specs, samples


def decode(model: torch.nn.Module, tokenizer, samples: list[Sample], options: EngineOptions,
           progress: bool = True, phases: Phases | None = None) -> list[str]:
    """Every sample's generated text, greedy up to its task's budget, until the end-of-text
    token; on data-parallel ranks each decodes its share and the texts are gathered. The
    engine's time split goes to `phases`."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = list(range(rank, len(samples), world))
    if not engine_takes(model):
        texts = _recomputed(model, tokenizer, samples, mine, options.max_batch, rank == 0)
        return _gathered(texts, world, len(samples))
    engine = DecodeEngine(model, tokenizer.vocab_size, options)
    if mine:  # one cache (and one captured step) for every cell: the largest first
        engine.reserve(min(options.max_batch, len(mine)),
                       max(len(samples[i].prompt_ids) + samples[i].max_new_tokens
                           for i in mine))
    texts: dict[int, str] = {}
    cells: dict[tuple[str, int], list[int]] = {}
    for i in mine:
        cells.setdefault((samples[i].task, samples[i].length), []).append(i)
    bar = tqdm(total=len(mine), desc="RULER", disable=not progress or rank != 0)
    for (task, length), index in cells.items():
        bar.set_postfix_str(f"{task} @ {length}")
        new = engine.generate([samples[i].prompt_ids for i in index],
                              [samples[i].max_new_tokens for i in index],
                              stop_tokens=[tokenizer.eod])
        for i, tokens in zip(index, new):
            texts[i] = tokenizer.decode(tokens)
        bar.update(len(index))
    bar.close()
    engine.release()
    if phases is not None:
        phases.add_all(engine.stats.seconds())
    return _gathered(texts, world, len(samples))


def _recomputed(model: torch.nn.Module, tokenizer, samples: list[Sample], mine: list[int],
                batch_size: int, log_once: bool) -> dict[int, str]:
    """The texts of samples `mine` decoded without a cache, for a model the engine does not
    take (tensor-parallel): a forward of the whole sequence per token, equal-length prompts
    batched, each text cut after its first end-of-text token, as the engine stops (greedy's
    tokens up to there are the same)."""
    from trainer.evals.decoding import Greedy

    if log_once:
        log.warning("RULER: the decoding engine runs at TP=1 only; decoding recomputes the "
                    "whole sequence per token (slow at long lengths)")
    device = next(model.parameters()).device
    greedy = Greedy(model, tokenizer.vocab_size, device, batch_size)
    tokens = greedy.continuations([samples[i].prompt_ids for i in mine],
                                  [samples[i].max_new_tokens for i in mine])
    texts = {}
    for i, row in zip(mine, tokens):
        end = row.index(tokenizer.eod) + 1 if tokenizer.eod in row else len(row)
        texts[i] = tokenizer.decode(row[:end])
    return texts


def _gathered(texts: dict[int, str], world: int, count: int) -> list[str]:
    """Every rank's texts, in sample order."""
    if world > 1:
        parts: list[dict[int, str]] = [{} for _ in range(world)]
        dist.all_gather_object(parts, texts)
        texts = {k: v for part in parts for k, v in part.items()}
    return [texts[i] for i in range(count)]


def run_suite(model: torch.nn.Module, tokenizer, tokenizer_spec: str, stream,
              settings: SuiteSettings, options: EngineOptions, out_dir: Path | None = None,
              write_inputs: bool = False, progress: bool = True
              ) -> tuple[SuiteResult, list[dict]]:
    """Build, decode and score the suite; returns the result and one row per sample (task,
    length, index, prediction, score). `write_inputs`: the inputs as `ruler_inputs.jsonl` in
    `out_dir`, for any other harness to score the same prompts."""
    from trainer.evals.ruler import sample_scores

    _, samples = prepare(settings, tokenizer, tokenizer_spec, stream)
    if write_inputs and out_dir is not None:
        write_jsonl(samples, out_dir / "ruler_inputs.jsonl")
    texts = decode(model, tokenizer, samples, options, progress)
    result = score_predictions(samples, texts, settings.threshold)
    rows = [{"task": s.task, "length": s.length, "index": s.index, "prediction": t,
             "references": s.references, "score": score}
            for s, t, score in zip(samples, texts, sample_scores(samples, texts))]
    return result, rows


def plot_suite(result: SuiteResult, path: Path, label: str) -> Path:
    """A task x length heatmap of scores (annotated) beside the average by length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(result.averages)
    tasks = list(dict.fromkeys(s.task for s in result.scores))
    cell = {(s.task, s.length): s.score for s in result.scores}
    grid = np.array([[cell.get((t, n), np.nan) for n in lengths] for t in tasks])
    fig, (heat, line) = plt.subplots(1, 2, figsize=(11, 0.35 * len(tasks) + 2.5),
                                     gridspec_kw={"width_ratios": [3, 2]})
    heat.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto")
    heat.set(xticks=range(len(lengths)), xticklabels=[f"{n:,}" for n in lengths],
             yticks=range(len(tasks)), yticklabels=tasks, xlabel="context length (tokens)",
             title=f"RULER score: {label}")
    for i in range(len(tasks)):
        for j in range(len(lengths)):
            if np.isfinite(grid[i, j]):
                heat.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=7,
                          color="white" if grid[i, j] < 60 else "black")
    line.plot(lengths, [result.averages[n] for n in lengths], marker="o")
    line.axhline(result.threshold, color="gray", linestyle="--", linewidth=1,
                 label=f"threshold {result.threshold:g}")
    line.set(xscale="log", ylim=(-2, 102), xlabel="context length (tokens)",
             ylabel="average over tasks", title=f"effective length: {result.effective_length}")
    line.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def settings_of(e, lengths, tasks=None, samples: int | None = None) -> SuiteSettings:
    """The suite settings of the `eval` group (`tasks`, `samples`: the in-training subset's)."""
    chosen = tasks if tasks is not None else e.tasks
    return SuiteSettings(tasks=tuple(chosen) if chosen else None,
                         lengths=tuple(int(n) for n in lengths),
                         samples=int(samples or e.samples), seed=int(e.seed),
                         template=e.template, threshold=float(e.threshold), qa_file=e.qa_file)


def engine_options(decode_cfg, batch_size: int) -> EngineOptions:
    return EngineOptions(max_batch=batch_size, prefill_tokens=decode_cfg.prefill_tokens,
                         cuda_graphs=decode_cfg.cuda_graphs)


def evaluate_ruler(cfg, model_cfg, tokenizer_spec: str, stream, model_loader, summary: dict,
                   run_dir: Path, device: torch.device, bf16: bool, is_main: bool,
                   phases: Phases) -> dict:
    """`trainer.eval eval.suite=ruler`: every input checked and built before the model loads
    (`model_loader()` -> (model, tokenizer)), then decoded and scored; writes eval.json,
    ruler.png, ruler_predictions.jsonl (and ruler_inputs.jsonl) and the wandb tables."""
    import json

    from trainer.data.tokenizer import load_tokenizer
    from trainer.engine.budget import check_cache
    from trainer.evals.results import EvalResults

    e = cfg.eval
    if cfg.parallel.tp != 1:
        from trainer.errors import UserError

        raise UserError(f"eval.suite=ruler decodes on one process: set parallel.tp=1 (got "
                        f"{cfg.parallel.tp}); a checkpoint saved at any TP loads at TP=1")
    settings = settings_of(e, e.lengths)
    tokenizer = load_tokenizer(tokenizer_spec)
    with phases("prompts"):
        _, samples = prepare(settings, tokenizer, tokenizer_spec, stream)
    check_cache(model_cfg, e.batch_size, max(settings.lengths), e.batch_size, bf16,
                cfg.decode.max_cache_gb, device, "lower eval.batch_size or eval.lengths")
    if e.write_inputs and is_main:
        write_jsonl(samples, run_dir / "ruler_inputs.jsonl")
    model, tokenizer = model_loader()
    with phases("decoding"):
        texts = decode(model, tokenizer, samples, engine_options(cfg.decode, e.batch_size),
                       phases=phases)
    result = score_predictions(samples, texts, settings.threshold)
    typed = EvalResults(**summary, suite="ruler", ruler=result, ruler_settings={
        "tasks": sorted({s.task for s in samples}), "samples": settings.samples,
        "template": settings.template, "seed": settings.seed}, seconds=phases.to_dict())
    results = typed.to_dict()
    if not is_main:
        return results
    from trainer.evals.ruler import sample_scores

    typed.write(run_dir)
    with open(run_dir / "ruler_predictions.jsonl", "w") as f:
        for s, t, score in zip(samples, texts, sample_scores(samples, texts)):
            f.write(json.dumps({"task": s.task, "length": s.length, "index": s.index,
                                "prediction": t, "references": s.references,
                                "score": score}) + "\n")
    plot = plot_suite(result, run_dir / "ruler.png", summary["label"])
    for line in result.table().splitlines():
        log.info("%s", line)
    log.info("effective length %s (threshold %g); results in %s", result.effective_length,
             result.threshold, run_dir)
    log.info("%s", phases.summary())
    if cfg.logger.wandb:
        _log_wandb(cfg, run_dir, summary["label"], result, plot)
    return results


def _log_wandb(cfg, run_dir: Path, label: str, result: SuiteResult, plot: Path) -> None:
    import wandb

    from ckpt.saved_config import unresolved_env
    from trainer.metrics import start_wandb

    run = start_wandb(run_dir, cfg.logger, unresolved_env(cfg), None,
                      job_type="eval", name=cfg.logger.name or label)
    scores = wandb.Table(columns=["attention", "task", "length", "score", "samples"],
                         data=[[label, s.task, s.length, s.score, s.samples]
                               for s in result.scores])
    averages = wandb.Table(columns=["length", "average"],
                           data=[[n, v] for n, v in sorted(result.averages.items())])
    run.log({"ruler/table": scores, "ruler/plot": wandb.Image(str(plot)),
             "ruler/average_by_length": wandb.plot.line(averages, "length", "average",
                                                        title=f"RULER: {label}"),
             "ruler/effective_length": result.effective_length or 0})
    run.finish()


def training_scores(model: torch.nn.Module, tokenizer, cfg, stream, step: int
                    ) -> dict[str, float]:
    """The suite subset of `eval.train_tasks` at `eval.train_lengths` (default 2 and 4 x
    trainer.seq_length) on the model being trained (inside DDP: the GPT or its bf16 wrapper),
    its data-parallel ranks sharing the samples: one metrics entry per length
    (`ruler/<length>`, the average over tasks) and the effective length (0: none)."""
    e, seq = cfg.eval, cfg.trainer.seq_length
    settings = settings_of(e, e.train_lengths or [2 * seq, 4 * seq], e.train_tasks,
                           e.train_samples)
    result, _ = run_suite(model, tokenizer, cfg.data.tokenizer, stream, settings,
                          engine_options(cfg.decode, e.batch_size), progress=False)
    log.info("RULER at step %d: %s; effective length %s", step,
             ", ".join(f"{n}: {v:.1f}" for n, v in result.averages.items()),
             result.effective_length)
    return {f"ruler/{n}": v for n, v in result.averages.items()} | {
        "ruler/effective_length": result.effective_length or 0}
