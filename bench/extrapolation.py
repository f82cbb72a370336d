"""Which method runs a model at N times its trained length?

One command trains a BPE tokenizer on the training corpus, trains a model at T for a wall-time
budget, evaluates the checkpoint with every training-free method at T..16T with
`python -m trainer.eval` (one run directory each, one wandb group), and writes results.json,
results.md and extrapolation.png into --out:

    python bench/extrapolation.py --out results/extrapolation               # GPU, ~10 minutes
    python bench/extrapolation.py --smoke --out /tmp/extrap                 # CPU, toy scale

The training corpus is the embedded one (the Python stdlib's sources, ~2.5M tokens), or with
--corpus DIR every --corpus-glob file under DIR (e.g. the machine's site-packages), written as a
megatron indexed dataset by `python -m trainer.build_data` with a validation share large enough
for the evaluation's perplexity windows at the longest length (bench/extrapolation_corpus.py).

Methods: standard RoPE, PI, NTK-aware, YaRN (each with factor s = length / T, one eval run per
length: `+extrapolation=...`), DCA (chunk T, local T/8) plain and with `attention.dca_scaling`
log / yarn at the sources' defaults; with --irope a second model trained with chunked attention
(chunk T/4) and global no-RoPE layers, evaluated as trained; with --dca-finetune-steps N the
first model fine-tuned N steps with DCA (chunk T/2 < T, so it sees chunk structure) and
evaluated with DCA again (a resume at a constant lr/3 with the scheduler overridden).
Training length: a short probe measures the step time, and max_steps is set so that training
takes --minutes (the schedule then decays over the whole run). --passkey-fraction of the
training samples are passkey examples at T and --multikey-fraction multi-key examples (0.25
each; 4 needles in the sample's own text), so that the model can retrieve at T and the
retrieval columns measure extrapolation, not the task.

Re-running with the same --work reuses finished trainings and evaluations and resumes a
training cut short (a signal, e.g. `timeout`'s SIGTERM: the training saves its step and the
driver exits 128 + signal; a kill: from the last of its checkpoints every fifth of the run);
results are rewritten after every method, so a run stopped by a time limit keeps what it
measured. Every run logs to wandb in the group --group (offline unless WANDB_MODE says
otherwise); their run directories are copied to OUT/wandb with the results, so a machine
without network brings them back for `wandb sync OUT/wandb/offline-run-*`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from extrapolation_corpus import (  # noqa: E402
    LISTING,
    Corpus,
    build_corpus,
    count_epochs,
    embedded_tokenizer,
    fail,
)
from extrapolation_report import collect, write  # noqa: E402

from trainer.stop import StopOnSignal  # noqa: E402

PERPLEXITY_WINDOWS = {False: 8, True: 2}  # eval.perplexity_windows, by --smoke
ATTENTION_QUERIES = {False: 32, True: 4}  # eval.attention_queries (the attention probe)
METHODS = ("standard", "pi", "ntk", "yarn", "dca", "dca+log", "dca+yarn")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results.json/.md and the plot")
    p.add_argument("--work", type=Path, help="run directories (default: OUT/../extrapolation-work)")
    p.add_argument("--model", default="gpt_125m")
    p.add_argument("--seq", type=int, default=2048, help="trained length T")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--minutes", type=float, default=4.0, help="training wall time")
    p.add_argument("--steps", type=int, help="training steps (skips the probe)")
    p.add_argument("--probe-steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=6e-4, help="peak lr, cosine to lr/10")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--max-documents", type=int,
                   help="embedded corpus documents, or --corpus files (default all)")
    p.add_argument("--corpus", type=Path, action="append", metavar="DIR",
                   help="train on the text files under DIR instead of the embedded corpus "
                   "(repeat to add directories)")
    p.add_argument("--corpus-glob", default="*.py,*.md,*.txt,*.rst",
                   help="comma-separated file-name patterns for --corpus")
    p.add_argument("--tokenizer-sample-mb", type=float, default=32.0,
                   help="train the BPE tokenizer on at most this much of --corpus")
    p.add_argument("--lengths", default="1,2,4,8,16", help="multiples of T")
    p.add_argument("--trials", type=int, default=10, help="per (length, depth); 5 depths")
    p.add_argument("--eval-batch", type=int, default=4)
    p.add_argument("--passkey-fraction", type=float, default=0.25,
                   help="share of training samples that are passkey examples at T")
    p.add_argument("--multikey-fraction", type=float, default=0.25,
                   help="share of training samples that are multi-key examples at T (4 keys)")
    p.add_argument("--methods", help="comma-separated subset of the training-free methods "
                   "(default all: " + ",".join(METHODS) + "), or none")
    p.add_argument("--irope", action="store_true", help="also train chunked + global layers")
    p.add_argument("--dca-finetune-steps", type=int, default=0)
    p.add_argument("--parallel-evals", type=int, default=1,
                   help="evaluations (and the DCA fine-tune) run side by side on the one GPU: "
                   "their start-up and decoding overlap (docs/experiments.md)")
    p.add_argument("--group", default=f"extrapolation-{time.strftime('%Y%m%d-%H%M%S')}",
                   help="wandb group")
    p.add_argument("--no-wandb", action="store_true")
    p.add_argument("--smoke", action="store_true",
                   help="CPU toy: tiny model, T=128 (multi-key needs it), lengths x1 x2, 2 trials")
    args = p.parse_args(argv)
    if args.parallel_evals < 1:
        p.error(f"--parallel-evals must be at least 1 (got {args.parallel_evals})")
    if args.smoke:
        args.model, args.seq, args.batch, args.micro_batch = "tiny", 128, 4, 4
        args.minutes, args.probe_steps, args.vocab, args.max_documents = 0.05, 3, 512, 40
        args.lengths, args.trials, args.eval_batch, args.no_wandb = "1,2", 1, 2, True
        args.irope, args.dca_finetune_steps = True, max(args.dca_finetune_steps, 3)
    # Absolute: the trainer runs from the repository root, not the caller's directory.
    args.work = (args.work or args.out.parent / f"{args.out.name}-work").resolve()
    return args


# SIGTERM / SIGUSR1 (`timeout`, a scheduler), recorded by main rather than fatal: they reach the
# running child too (one process group), and a training saves its step before it exits; the
# driver waits for it, then stops with 128 + signal, and the same command continues from there.
# A second signal ends the driver at once (trainer/stop.py).
_signals: StopOnSignal | None = None


def _exit_if_signalled() -> None:
    if _signals is not None and _signals.signum:
        print(f"stopped by {signal.Signals(_signals.signum).name}: rerun the same command to "
              "continue (finished trainings and evaluations are reused, a stopped training "
              "resumes from its last checkpoint)", file=sys.stderr, flush=True)
        sys.exit(128 + _signals.signum)


def run(module: str, overrides: list[str], log: Path) -> None:
    """`python -m module overrides`, output appended to `log`; a failure prints the log's
    tail."""
    _exit_if_signalled()
    cmd = [sys.executable, "-m", module, *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    print("+", " ".join(cmd[1:]), flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "a") as f:  # a resumed training keeps its first part's log
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    _exit_if_signalled()
    if proc.returncode:
        tail = log.read_text().splitlines()[-30:]
        sys.exit(f"{module} failed (exit {proc.returncode}); log {log}:\n" + "\n".join(tail))
    print(f"  done in {time.perf_counter() - t0:.0f}s", flush=True)


def train(overrides: list[str], run_dir: Path) -> Path:
    """`python -m trainer` into `run_dir`. A finished run there is reused (rerunning the bench
    with the same --work; delete --work to start over); a run cut short (a time limit) resumes
    from its last checkpoint: the step it was stopped at (a signal), else the last of those saved
    every fifth of the run (a kill)."""
    ckpt = run_dir / "checkpoints"
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    steps = int(next(o for o in overrides if o.startswith("trainer.max_steps=")).split("=")[1])
    saved = int(tracker.read_text()) if tracker.is_file() else 0
    if saved >= steps:
        print(f"reusing {ckpt}", flush=True)
        return ckpt
    if saved:
        print(f"resuming {ckpt} at step {saved}", flush=True)
        overrides = [o for o in overrides if not o.startswith("checkpoint.")]
        overrides += [f"checkpoint.load={ckpt}"]
    run("trainer", overrides + [f"trainer.save_interval={math.ceil(steps / 5)}",
                                f"hydra.run.dir={run_dir}"], run_dir.with_suffix(".log"))
    return ckpt


def copy_wandb_runs(work: Path, dest: Path) -> list[Path]:
    """Copy every wandb run directory under `work` (`*/wandb/offline-run-*` or `run-*`) to
    `dest`, newer files replacing older copies; returns the copies."""
    copies = []
    for run in sorted(work.glob("**/wandb/*run-*")):
        if run.is_dir():
            copies.append(Path(shutil.copytree(run, dest / run.name, dirs_exist_ok=True)))
    return copies


def common(args: argparse.Namespace, tokenizer: Path, corpus: Corpus | None) -> list[str]:
    data = [f"data.tokenizer={tokenizer}"]
    if corpus:
        data += corpus.overrides()
    elif args.max_documents:
        data.append(f"data.max_documents={args.max_documents}")
    return data + (["logger=none"] if args.no_wandb else [f"logger.group={args.group}"])


def train_overrides(args: argparse.Namespace, steps: int) -> list[str]:
    return [f"model={args.model}", f"trainer.seq_length={args.seq}",
            f"trainer.micro_batch_size={args.micro_batch}",
            f"trainer.global_batch_size={args.batch}", f"trainer.max_steps={steps}",
            f"trainer.lr={args.lr:g}", f"trainer.min_lr={args.lr / 10:g}",
            f"trainer.warmup_steps={max(1, steps // 20)}", "trainer.eval_interval=0",
            f"data.passkey_fraction={args.passkey_fraction:g}",
            f"data.multikey_fraction={args.multikey_fraction:g}",
            f"data.multikey_keys={1 if args.smoke else 4}",
            f"trainer.log_interval={max(1, steps // 50)}"]


def probe_steps(args: argparse.Namespace, base: list[str]) -> int:
    """Steps that fit --minutes, from the median step time of a short run (warm-up excluded)."""
    if args.steps:
        return args.steps
    d = args.work / "probe"
    if (d / "metrics.jsonl").is_file():
        print(f"reusing {d}", flush=True)
    else:
        _run_probe(args, base, d)
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    seconds = statistics.median(r["step_time_s"] for r in rows[len(rows) // 3:])
    steps = max(args.probe_steps, int(args.minutes * 60 / seconds))
    print(f"  probe: {seconds:.3f}s/step -> {steps} steps for {args.minutes} min", flush=True)
    return steps


def _run_probe(args: argparse.Namespace, base: list[str], d: Path) -> None:
    timing = [o for o in train_overrides(args, args.probe_steps)
              if not o.startswith(("data.passkey_fraction=", "data.multikey_fraction=",
                                   "data.multikey_keys=", "trainer.log_interval="))]
    run("trainer", base + timing + [
        "checkpoint.save=false", "trainer.log_interval=1",
        "logger=none", f"hydra.run.dir={d}"], args.work / "probe.log")


def evaluations(args: argparse.Namespace) -> dict[str, list[str]]:
    """Method name -> `trainer.eval` overrides (the RoPE-scaled ones are swept per length)."""
    t = args.seq
    dca = ["+attention=dca", f"attention.dca_chunk_size={t}", f"attention.dca_local_size={t // 8}"]
    every = {
        "standard": [], "pi": ["+extrapolation=pi"], "ntk": ["+extrapolation=ntk"],
        "yarn": ["+extrapolation=yarn"], "dca": dca,
        "dca+log": dca + ["attention.dca_scaling=log"],
        "dca+yarn": dca + ["attention.dca_scaling=yarn"],
    }
    if args.methods == "none":  # only --irope / --dca-finetune-steps
        return {}
    chosen = args.methods.split(",") if args.methods else list(METHODS)
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        fail(f"--methods: unknown {unknown}; choose from {','.join(METHODS)}")
    return {name: every[name] for name in chosen}


def evaluate(args: argparse.Namespace, name: str, ckpt: Path, extra: list[str],
             base: list[str], lengths: list[int]) -> list[Path]:
    """One `trainer.eval` run (all lengths), or a multirun of one job per length when the
    method's RoPE factor follows the length; returns the eval.json paths."""
    d = args.work / "eval" / name.replace("+", "_")
    depths = "[0.0,1.0]" if args.smoke else "[0.0,0.25,0.5,0.75,1.0]"
    overrides = base + [f"checkpoint.load={ckpt}", f"eval.depths={depths}",
                        f"eval.passkey_trials={args.trials}", f"eval.multikey_trials={args.trials}",
                        f"eval.batch_size={args.eval_batch}", f"eval.trained_length={args.seq}",
                        f"eval.perplexity_windows={PERPLEXITY_WINDOWS[args.smoke]}",
                        f"eval.multikey_keys={1 if args.smoke else 4}",
                        f"eval.attention_queries={ATTENTION_QUERIES[args.smoke]}", *extra]
    if any(o.startswith("+extrapolation=") for o in extra):
        longer = [n for n in lengths if n > args.seq]
        if not longer:
            return []
        done = sorted(d.glob("*/eval.json"))
        if len(done) == len(longer):
            print(f"reusing {d}", flush=True)
            return done
        sweep = ",".join(f"[{n}]" for n in longer)
        run("trainer.eval", ["-m", *overrides, f"eval.lengths={sweep}",
                             f"hydra.sweep.dir={d}", "hydra.sweep.subdir=${hydra.job.num}"],
            d.with_suffix(".log"))
        return sorted(d.glob("*/eval.json"))
    if (d / "eval.json").is_file():
        print(f"reusing {d}", flush=True)
        return [d / "eval.json"]
    lengths_arg = "[" + ",".join(map(str, lengths)) + "]"
    run("trainer.eval", [*overrides, f"eval.lengths={lengths_arg}", f"hydra.run.dir={d}"],
        d.with_suffix(".log"))
    return [d / "eval.json"]


def main(argv: list[str] | None = None) -> None:
    global _signals
    args = parse_args(argv)
    _signals = StopOnSignal()
    t_start = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    lengths = [int(float(m) * args.seq) for m in args.lengths.split(",")]
    tokenizer = args.work / "tokenizer.json"
    windows = PERPLEXITY_WINDOWS[args.smoke]
    corpus = None
    if args.corpus:
        longest = max(lengths)  # trainer.eval needs its windows and the multi-key filler
        corpus = build_corpus(args.corpus, args.corpus_glob, args.work, args.vocab,
                              args.tokenizer_sample_mb, args.max_documents,
                              max(windows * longest + 1, 2 * longest + 64), run)
    elif (args.work / LISTING).is_file():
        fail(f"--work {args.work} holds a --corpus run ({args.work / LISTING}); give another "
             "--work for the embedded corpus, or --corpus again")
    else:
        embedded_tokenizer(tokenizer, args.vocab, args.max_documents)
    base = common(args, tokenizer, corpus)
    steps = probe_steps(args, base)
    if corpus:
        count_epochs(corpus, tokenizer, args.seq, steps * args.batch,
                     args.passkey_fraction + args.multikey_fraction)
    methods = evaluations(args)
    # The first model, unless the run only asks for the iRoPE one (a training of its own)
    ckpt = train(base + train_overrides(args, steps), args.work / "train") \
        if methods or args.dca_finetune_steps else None
    meta = {"model": args.model, "seq_length": args.seq, "steps": steps, "batch": args.batch,
            "lr": args.lr, "vocab": args.vocab, "passkey_fraction": args.passkey_fraction,
            "multikey_fraction": args.multikey_fraction,
            "lengths": lengths, "trials": args.trials,
            "wandb_group": None if args.no_wandb else args.group, "smoke": args.smoke,
            "command": " ".join(sys.argv),
            "corpus": corpus.meta() if corpus else "embedded (Python stdlib sources)"}
    # Every name in table order; a method's runs fill in as its evaluation finishes.
    runs: dict[str, list[Path]] = {name: [] for name in [*methods, "irope", *FINETUNED]}

    def publish() -> None:
        """Results so far (a time limit may stop the next method)."""
        rows = collect({k: v for k, v in runs.items() if v})
        meta["seconds"] = round(time.perf_counter() - t_start)
        for path in write(rows, args.out, meta):
            print("wrote", path, flush=True)
        copy_wandb_runs(args.work, args.out / "wandb")

    tasks = [functools.partial(_evaluated, args, name, ckpt, extra, base, lengths)
             for name, extra in methods.items()]
    if args.dca_finetune_steps:
        tasks.append(functools.partial(dca_finetune, args, base, ckpt, steps, lengths))
    for result in side_by_side(tasks, args.parallel_evals):
        runs.update(result)
        publish()
    if args.irope:
        chunked = ["+attention=chunked", f"attention.chunk_size={args.seq // 4}",
                   "attention.global_layer_interval=" + ("2" if args.smoke else "4")]
        irope = train(base + train_overrides(args, steps) + chunked, args.work / "train_irope")
        runs["irope"] = evaluate(args, "irope", irope, chunked, base, lengths)
        publish()


def side_by_side(tasks: list[Callable[[], T]], workers: int) -> Iterator[T]:
    """Each task's result as it finishes, at most `workers` running at a time (threads: each
    waits on its subprocess). After a failure, or a signal's SystemExit, nothing more starts:
    the running tasks end (their results still come) and the failure is raised."""
    queue = iter(tasks)
    with ThreadPoolExecutor(workers) as pool:
        running = {pool.submit(task) for task in itertools.islice(queue, workers)}
        while running:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                done |= wait(running).done
                running = set()
            else:
                running |= {pool.submit(task) for task in itertools.islice(queue, len(done))}
            yield from (f.result() for f in done if f.exception() is None)
            if failed:
                raise failed[0].exception()


def _evaluated(args: argparse.Namespace, name: str, ckpt: Path, extra: list[str],
               base: list[str], lengths: list[int]) -> dict[str, list[Path]]:
    return {name: evaluate(args, name, ckpt, extra, base, lengths)}


FINETUNED = ("dca-ft", "dca-ft+yarn")


def dca_finetune(args: argparse.Namespace, base: list[str], ckpt: Path, steps: int,
                 lengths: list[int]) -> dict[str, list[Path]]:
    """Continue training the model with DCA at T (chunk T/2 < T) for --dca-finetune-steps at a
    constant lr/3 (its optimizer state kept, the scheduler overridden), then evaluate it with
    the same DCA, plain and with yarn scaling."""
    c = args.seq // 2
    dca = ["+attention=dca", f"attention.dca_chunk_size={c}", f"attention.dca_local_size={c // 8}"]
    schedule = [o for o in train_overrides(args, steps + args.dca_finetune_steps)
                if not o.startswith(("trainer.lr=", "trainer.min_lr=", "trainer.warmup_steps="))]
    tuned = train(base + schedule + dca + [
        f"checkpoint.load={ckpt}", "checkpoint.override_scheduler=true",
        "trainer.lr_decay_style=constant", f"trainer.lr={args.lr / 3:g}",
        f"trainer.min_lr={args.lr / 3:g}", "trainer.warmup_steps=0"], args.work / "train_dca_ft")
    plain, scaled = FINETUNED
    return {plain: evaluate(args, plain, tuned, dca, base, lengths),
            scaled: evaluate(args, scaled, tuned, dca + ["attention.dca_scaling=yarn"], base,
                             lengths)}


if __name__ == "__main__":
    main()
