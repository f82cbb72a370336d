"""`python -m trainer.eval checkpoint.load=DIR eval.lengths=[1024,2048] [+attention=dca ...]`

Loads a checkpoint's model (its shape and tokenizer come from the config saved in it), builds it
with the attention variant of *this* command line, so a model trained with standard attention
can be evaluated with DCA or chunked attention, and with this command line's RoPE scaling
(`+extrapolation=pi|ntk|yarn`, any `model.rope_*`: trainer/rope_override.py). It measures per
(length, depth) the simple passkey's accuracy (repeated filler) and multi-key retrieval among
distractors in held-out corpus text (trainer/evals/retrieval.py), and per length the perplexity,
also by position bucket (0..T, T..2T, 2T..4T, ... with T the trained length). Results go to
`eval.json`, `passkey.png` and `perplexity.png` in the run directory and, on rank 0, to wandb
(tables and plots). A Hydra multirun (`-m +attention=dca,chunked`) groups its runs in wandb.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import asdict
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ckpt.meta import CheckpointMeta
from ckpt.reader import MODEL_WEIGHT, Checkpoint
from ckpt.saved_config import literal, unresolved_env
from models.schema import AttentionConfig
from trainer.config import (
    CONF_DIR,
    DataConfig,
    check_known_keys,
    command_line_overrides,
    register_configs,
    run_options,
)
from trainer.entry import arrange_argv, check_early, check_overrides, exits_on_user_error
from trainer.evals.results import EvalResults
from trainer.resume import saved_run_config
from trainer.rope_override import describe_rope, typed_model_keys, with_rope_overrides
from trainer.validate import check_eval_source, check_model, placement, validate_eval

register_configs()
log = logging.getLogger(__name__)


def checkpoint_data(cfg: DictConfig, meta: CheckpointMeta) -> DictConfig:
    """The checkpoint's run's data settings (an imported model's: the defaults with its
    tokenizer), each overridden where this command sets it to other than the default (e.g.
    `data.tokenizer=HF_DIR`, `data.max_documents=N`)."""
    saved = saved_run_config(meta).get("data", {}) if meta.run_config else {}
    data = OmegaConf.merge(OmegaConf.structured(DataConfig), saved,
                           literal({"tokenizer": meta.tokenizer}))
    for key, value in OmegaConf.to_container(cfg.data).items():
        if value != getattr(DataConfig, key, value):
            data[key] = value
    return data


def run_attention(cfg: DictConfig, meta: CheckpointMeta, length: int) -> DictConfig:
    """The attention to run a checkpoint's model with: the checkpoint's own (its settings as
    trained), unless this command line selects or sets one; DCA sizes left unset follow the
    model (`trainer.defaults.adopt_dca_split`: its trained sizes, else ChunkLlama's split of its
    own `length`), said in one log line. Every value resolved."""
    from trainer.defaults import adopt_dca_split, set_sizes

    chosen = any(o.lstrip("+~").startswith("attention") for o in command_line_overrides()) \
        or OmegaConf.to_container(cfg.attention, resolve=True) != asdict(AttentionConfig())
    if chosen:
        typed = set_sizes(cfg.attention)
        attention = OmegaConf.create(OmegaConf.to_container(cfg.attention, resolve=True,
                                                            enum_to_str=True))
    else:
        typed = set()
        attention = OmegaConf.create(literal(asdict(meta.attention)))
    trained = (meta.attention.dca_chunk_size, meta.attention.dca_local_size)
    note = adopt_dca_split(attention, meta.attention.kind, trained, length, typed)
    log.info("attention %s (%s)%s", attention.kind,
             "this command line's" if chosen else "the checkpoint's", f"; {note}" if note else "")
    return OmegaConf.merge(OmegaConf.structured(AttentionConfig), attention)


def load_model(cfg: DictConfig, model: DictConfig, tokenizer_spec: str, ckpt: Checkpoint,
                device: torch.device, bf16: bool):
    """The checkpoint's model shape (`model`: with this command's RoPE scaling) with this
    command's attention, weights loaded (checked)."""
    from megatron.core.transformer.module import Float16Module

    from ckpt.load import load_model_weights
    from models.gpt import build_model
    from trainer.data.tokenizer import load_tokenizer
    from trainer.init_from import checkpoint_vocab

    tokenizer = load_tokenizer(tokenizer_spec)
    options = run_options(cfg.trainer, bf16=bf16, on_gpu=device.type == "cuda")
    built = build_model(model, cfg.attention, cfg.parallel,
                        vocab_size=checkpoint_vocab(ckpt, tokenizer.vocab_size, tokenizer_spec),
                        max_sequence_length=max(cfg.eval.lengths), options=options)
    load_model_weights(ckpt, built.gpt)
    model = Float16Module(built.config, built.gpt) if options.bf16 else built.gpt
    return model.eval(), tokenizer


def _plots(run_dir: Path, label: str, cells: list, points: list) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({c.length for c in cells})
    depths = sorted({c.depth for c in cells})
    acc = {(c.length, c.depth): c.accuracy for c in cells}
    fig, ax = plt.subplots(figsize=(6, 4))
    for depth in depths:
        ax.plot(lengths, [acc[(n, depth)] for n in lengths], marker="o", alpha=0.5,
                label=f"depth {depth:.2f}")
    ax.plot(lengths, [sum(acc[(n, d)] for d in depths) / len(depths) for n in lengths],
            marker="s", color="black", linewidth=2, label="mean")
    ax.set(xscale="log", xlabel="context length (tokens)", ylabel="passkey accuracy",
           ylim=(-0.02, 1.02), title=f"passkey retrieval: {label}")
    ax.legend(fontsize=7)
    paths = {"passkey": run_dir / "passkey.png", "perplexity": run_dir / "perplexity.png"}
    fig.savefig(paths["passkey"], dpi=120, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    finite = [p for p in points if math.isfinite(p.perplexity)]  # a NaN model has none
    ax.plot([p.length for p in finite], [p.perplexity for p in finite], marker="o")
    ax.set(xscale="log", yscale="log" if finite else "linear",
           xlabel="context length (tokens)", ylabel="perplexity",
           title=f"perplexity by length: {label}")
    fig.savefig(paths["perplexity"], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths


def _log_wandb(cfg: DictConfig, run_dir: Path, label: str, cells: list, points: list,
               plots: dict[str, Path], multikey: list, attention: list) -> None:
    import wandb

    from trainer.metrics import start_wandb

    group = cfg.logger.group
    hydra_cfg = HydraConfig.get()
    if group is None and hydra_cfg.mode == RunMode.MULTIRUN:
        group = f"eval-{Path(hydra_cfg.sweep.dir).name}"
    run = start_wandb(run_dir, cfg.logger, unresolved_env(cfg), None,
                      group=group, job_type="eval", name=cfg.logger.name or label)
    passkey = wandb.Table(columns=["attention", "length", "depth", "accuracy", "trials"],
                          data=[[label, c.length, c.depth, c.accuracy, c.trials] for c in cells])
    ppl = wandb.Table(columns=["attention", "length", "nll", "perplexity"],
                      data=[[label, p.length, p.nll, p.perplexity] for p in points])
    multi = wandb.Table(
        columns=["attention", "length", "depth", "keys", "correct", "distractor", "trials",
                 "accuracy"],
        data=[[label, c.length, c.depth, c.keys, c.correct, c.distractor, c.trials, c.accuracy]
              for c in multikey])
    buckets = wandb.Table(
        columns=["attention", "length", "start", "end", "tokens", "nll", "perplexity"],
        data=[[label, p.length, b.start, b.end, b.tokens, b.nll, b.perplexity]
              for p in points for b in p.buckets])
    by_distance = wandb.Table(
        columns=["attention", "length", "layer", "entropy", "distance_from", "mass"],
        data=[[label, a.length, layer + 1, a.entropy[layer], edge, a.mass[layer][i]]
              for a in attention for layer in range(len(a.entropy))
              for i, edge in enumerate(a.edges)])
    mean = wandb.Table(columns=["length", "accuracy"], data=[
        [n, sum(c.accuracy for c in cells if c.length == n) / sum(c.length == n for c in cells)]
        for n in sorted({c.length for c in cells})])
    run.log({
        "passkey/table": passkey, "perplexity/table": ppl, "multikey/table": multi,
        "perplexity/by_position": buckets, "attention/by_distance": by_distance,
        "passkey/accuracy_by_length": wandb.plot.line(mean, "length", "accuracy",
                                                      title=f"passkey: {label}"),
        "perplexity/by_length": wandb.plot.line(ppl, "length", "perplexity",
                                                title=f"perplexity: {label}"),
        "passkey/plot": wandb.Image(str(plots["passkey"])),
        "perplexity/plot": wandb.Image(str(plots["perplexity"])),
    })
    run.finish()


def evaluate(cfg: DictConfig, run_dir: Path) -> dict:
    """Run the evaluation; returns the results written to `eval.json`."""
    from trainer.init_from import open_load

    # the settings and the checkpoint first: a mistake in either is refused before megatron's
    # imports (seconds on a few cores)
    check_known_keys(cfg)
    validate_eval(cfg)
    ckpt = open_load(cfg.checkpoint.load)

    from models.attention.dca.scaling import describe
    from models.attention.registry import dca_scaling
    from parallel.distributed import initialize_parallel, shutdown
    from trainer.data.datasets import build_datasets
    from trainer.engine.budget import check_cache
    from trainer.eval_fit import fitting_lengths, perplexity_rows
    from trainer.evals.decoding import ANSWER_TOKENS, Greedy
    from trainer.evals.measures import attention_by_distance, passkey_accuracy, perplexity_by_length
    from trainer.evals.retrieval import multikey_accuracy
    from trainer.timing import Phases

    meta = ckpt.meta
    trained_length = cfg.eval.trained_length or meta.seq_length
    if cfg.eval.lengths is None:
        cfg.eval.lengths = [trained_length, 2 * trained_length, 4 * trained_length]
    # the chunked sizes this command leaves unset follow the trained length, as in training;
    # DCA's follow the model (run_attention)
    cfg.trainer.seq_length = trained_length
    cfg.attention = run_attention(cfg, meta, trained_length)
    typed = typed_model_keys(command_line_overrides())
    model_cfg = with_rope_overrides(cfg.model, literal(asdict(meta.model)), typed,
                                    trained_length, max(cfg.eval.lengths))
    check_model(model_cfg, cfg.attention, cfg.parallel)
    data = checkpoint_data(cfg, meta)
    device, bf16 = placement(cfg.trainer.device, cfg.trainer.precision)
    if cfg.eval.suite == "passkey":  # the RULER suite checks its own cache
        ppl_rows = perplexity_rows(model_cfg, ckpt.tensors[MODEL_WEIGHT].shape[0], cfg.eval,
                                   cfg.parallel.tp, bf16, device)
        check_cache(model_cfg, cfg.eval.batch_size, max(cfg.eval.lengths) + ANSWER_TOKENS,
                    cfg.eval.batch_size, bf16, cfg.decode.max_cache_gb, device,
                    "lower eval.batch_size or eval.lengths")
    label = cfg.attention.kind
    if label == "dca" and cfg.attention.dca_scaling != "none":
        # the label carries every scaling constant (defaults or not)
        label += "+" + describe(dca_scaling(cfg.attention), cfg.attention.dca_chunk_size)
    if describe_rope(model_cfg):
        label += "+" + describe_rope(model_cfg)
    log.info("evaluating %s (step %d, trained with %s attention) with %s attention at "
             "lengths %s", ckpt.path, meta.step, meta.attention.kind, label,
             list(cfg.eval.lengths))
    phases = Phases(device)
    topo = initialize_parallel(device, cfg.parallel.tp, cfg.eval.seed)
    try:
        e = cfg.eval
        with phases("data"):
            _, valid, _ = build_datasets(data.name, data.path, data.tokenizer, max(e.lengths),
                                         data.valid_fraction, 0, data.max_documents)
        summary = {"checkpoint": str(ckpt.path), "step": meta.step,
                   "trained_attention": meta.attention.kind,
                   "attention": OmegaConf.to_container(cfg.attention, resolve=True,
                                                       enum_to_str=True),
                   "label": label, "rope": {k: v for k, v in OmegaConf.to_container(
                       model_cfg).items() if k.startswith("rope_")},
                   "trained_length": trained_length}
        if e.suite == "ruler":
            from trainer.evals.ruler_run import evaluate_ruler

            def model_loader():
                with phases("load"):
                    return load_model(cfg, model_cfg, data.tokenizer, ckpt, device, bf16)

            return evaluate_ruler(cfg, model_cfg, data.tokenizer, valid.stream, model_loader,
                                  summary, run_dir, device, bf16, topo.is_main, phases)
        with phases("load"):
            model, tokenizer = load_model(cfg, model_cfg, data.tokenizer, ckpt, device, bf16)
        fit = fitting_lengths(tokenizer, valid.stream, e)
        greedy = Greedy(model, tokenizer.vocab_size, device, e.batch_size)
        with phases("cache"):
            greedy.reserve(max(fit["passkey"] + fit["multikey"], default=0) + ANSWER_TOKENS)
        with phases("passkey"):
            cells = passkey_accuracy(model, tokenizer, fit["passkey"], list(e.depths),
                                     e.passkey_trials, e.passkey_digits, e.batch_size, e.seed,
                                     device, greedy)
        with phases("multikey"):
            multikey = multikey_accuracy(model, tokenizer, valid.stream, fit["multikey"],
                                         list(e.depths), e.multikey_trials, e.multikey_keys,
                                         e.passkey_digits, e.batch_size, e.seed, device,
                                         greedy) if e.multikey_trials > 0 else []
        greedy.release()  # the cache's memory goes to the perplexity's logits
        greedy.report(phases)
        # over the model's whole vocabulary (its config's, padding rows excluded), as
        # transformers computes a loss: the tokenizer may name fewer ids than the model has
        vocab = meta.vocab_size
        with phases("perplexity"):
            points = perplexity_by_length(model, valid.stream, fit["perplexity"],
                                          e.perplexity_windows, ppl_rows, vocab, device,
                                          trained_length) if fit["perplexity"] else []
        with phases("attention"):
            attention = attention_by_distance(model, valid.stream, fit["perplexity"],
                                              e.attention_queries, vocab, device,
                                              trained_length) if e.attention_queries > 0 else []
    finally:
        shutdown()
    typed = EvalResults(**summary, passkey=cells, multikey=multikey, perplexity=points,
                        attention_by_distance=attention, seconds=phases.to_dict())
    results = typed.to_dict()
    if topo.is_main:
        _warn_non_finite(points)
        typed.write(run_dir)
        plots = _plots(run_dir, label, cells, points)
        for n in sorted(e.lengths):
            row = [c for c in cells if c.length == n]
            if row:
                log.info("length %6d: passkey %.2f (%s by depth)", n,
                         sum(c.accuracy for c in row) / len(row),
                         " ".join(f"{c.accuracy:.1f}" for c in row))
            mk = [c for c in multikey if c.length == n]
            if mk:
                log.info("length %6d: multi-key (%d keys) %d/%d correct, %d distractor", n,
                         mk[0].keys, sum(c.correct for c in mk), sum(c.trials for c in mk),
                         sum(c.distractor for c in mk))
            for point in (p for p in points if p.length == n):
                log.info("length %6d: perplexity %.3f; by position %s", n, point.perplexity,
                         ", ".join(f"[{b.start},{b.end}) {b.perplexity:.3f}"
                                   for b in point.buckets))
            for a in (a for a in attention if a.length == n):
                mean = [sum(m[i] for m in a.mass) / len(a.mass) for i in range(len(a.edges))]
                log.info("length %6d: attention entropy by layer %s; mass by distance %s", n,
                         " ".join(f"{h:.2f}" for h in a.entropy),
                         ", ".join(f">={e} {m:.3f}" for e, m in zip(a.edges, mean)))
        if cfg.logger.wandb:
            _log_wandb(cfg, run_dir, label, cells, points, plots, multikey, attention)
        log.info("%s", phases.summary())
        log.info("results in %s", run_dir)
    return results


def _warn_non_finite(points: list) -> None:
    """Say so when a perplexity is NaN or infinite (the loss is NaN, or too large for e^loss):
    the perplexity plot leaves those lengths out."""
    bad = [p.length for p in points if not math.isfinite(p.perplexity)]
    if bad:
        log.warning("perplexity is not finite at lengths %s (the model's loss is NaN or above "
                    "709 nats: a diverged or damaged checkpoint?); the perplexity plot leaves "
                    "them out", bad)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@exits_on_user_error
def main(cfg: DictConfig) -> None:
    from trainer.run_dir import raise_refusal

    raise_refusal()  # the run directory is in use, or a training run's (trainer.run_dir)
    evaluate(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    composed = check_overrides(sys.argv[1:])
    if composed is not None:
        check_early(lambda: check_eval_source(composed))
    named = any(arg.startswith("hydra.job.name=") for arg in sys.argv[1:])
    # eval.log, not train.log; Hydra's flags anywhere on the line
    sys.argv[1:] = arrange_argv(sys.argv[1:], (() if named else ("hydra.job.name=eval",)) + (
        "+hydra.callbacks.claim_run_dir._target_=trainer.run_dir.ClaimEvalDir",))
    main()
