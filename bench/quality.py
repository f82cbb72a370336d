"""Long-context quality of a real pretrained model: the RULER-style suite (trainer.eval
eval.suite=ruler) with every training-free method, then after a short DCA fine-tune.

    python bench/quality.py prepare --gguf MODEL.gguf --work W          # gguf-to-hf, import-hf
    python bench/quality.py prepare --hf MODEL_DIR --work W             # a transformers model
    python bench/quality.py training-free --work W --out OUT            # the methods at T..4T
    python bench/quality.py finetune --work W --out OUT                 # DCA fine-tune, suite
    python bench/quality.py report OUT/quality.json [MORE.json ...] --out DIR  # one table, plot

T is the model's own length (its max_position_embeddings). Methods: standard RoPE, PI, NTK-aware
and YaRN (factor 4 at T..4T; YaRN also factor 8 at 8T), DCA with the default split (ChunkLlama's
3T/4 chunk, T/16 local window; also at 8T), DCA with chunk T, local T/4, and DCA with a logit
scaling (`dca_yarn`: Qwen2.5-1M's YaRN temperature; `dca_log`: Llama 4's with floor_scale T,
so 1 within T), and Qwen2.5-1M's own split (chunk T, local T/32: `dca_1m`, with either
scaling `dca_yarn_1m`, `dca_log_1m`). Each method's
result is appended to OUT/quality.json as soon as it is measured (a run cut short by a time
limit keeps what it measured); OUT/quality.png plots every method's average by length and
OUT/quality.md holds the table. `--samples`, `--tasks`, `--plan` and `--multiples` choose how
much to run; a method measured one length at a time (`--multiples 1`, then `--multiples 4`, ...:
a large model's long lengths each fill a time-limited call) is one line of the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Qwen2.5-1M's own split (its dual_chunk_attention_config: chunk = the original length, local
# window T/32)
SPLIT_1M = ["+attention=dca", "attention.dca_chunk_size={T}", "attention.dca_local_size={T32}"]
# name -> (overrides, length multiples of T); {T}: the model's length
METHODS = {
    "standard": ([], (1, 2, 4)),
    "pi": (["+extrapolation=pi", "model.rope_scaling_factor=4"], (1, 2, 4)),
    "ntk": (["+extrapolation=ntk", "model.rope_scaling_factor=4"], (1, 2, 4)),
    "yarn": (["+extrapolation=yarn", "model.rope_scaling_factor=4"], (1, 2, 4)),
    "dca": (["+attention=dca"], (1, 2, 4)),
    "dca_c=T": (["+attention=dca", "attention.dca_chunk_size={T}",
                 "attention.dca_local_size={T4}"], (1, 2, 4)),
    "dca_yarn": (["+attention=dca", "attention.dca_scaling=yarn"], (1, 2, 4)),
    # log: the temperature starts at T (trainer.defaults.adopt_dca_split on a model trained
    # without DCA)
    "dca_log": (["+attention=dca", "attention.dca_scaling=log"], (1, 2, 4)),
    "dca_1m": (SPLIT_1M, (1, 2, 4)),
    "dca_yarn_1m": (SPLIT_1M + ["attention.dca_scaling=yarn"], (1, 2, 4)),
    "dca_log_1m": (SPLIT_1M + ["attention.dca_scaling=log"], (1, 2, 4)),
    "dca@8T": (["+attention=dca"], (8,)),
    "yarn@8T": (["+extrapolation=yarn", "model.rope_scaling_factor=8"], (8,)),
}


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from trainer.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def model_length(ckpt: Path) -> int:
    from ckpt.paths import resolve_checkpoint
    from ckpt.reader import Checkpoint

    return Checkpoint(resolve_checkpoint(ckpt)).meta.seq_length


def evaluate(name: str, ckpt: Path, overrides: list[str], lengths: list[int], samples: int,
             args: argparse.Namespace, out: Path) -> dict:
    """One method's suite run; its row appended to OUT/quality.json."""
    from trainer.eval import evaluate as run_eval

    run_dir = Path(args.work) / "evals" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = compose(overrides + [
        f"checkpoint.load={ckpt}", "eval.suite=ruler",
        f"eval.lengths=[{','.join(map(str, lengths))}]", f"eval.samples={samples}",
        f"eval.batch_size={args.batch_size}", "logger=none",
        f"eval.seed={args.seed}"] + ([f"eval.tasks=[{args.tasks}]"] if args.tasks else [])
        + (["trainer.device=cpu"] if args.cpu else []))
    start = time.perf_counter()
    results = run_eval(cfg, run_dir)
    seconds = time.perf_counter() - start
    prompts = len(results["ruler"]["scores"]) and sum(s["samples"]
                                                     for s in results["ruler"]["scores"])
    row = {"method": name, "checkpoint": str(ckpt), "label": results["label"],
           "attention": results["attention"], "rope": results["rope"], "lengths": lengths,
           "samples": samples, "seed": args.seed, "seconds": seconds,
           "prompts_per_s": prompts / seconds, "phases": results.get("seconds", {}),
           "ruler": results["ruler"]}
    _append(out, row)
    print(f"{name}: {seconds:.0f} s, {prompts / seconds:.2f} prompts/s, averages "
          f"{results['ruler']['averages']}", flush=True)
    return row


def _append(out: Path, row: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "quality.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    rows.append(row)
    meta = _environment()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"environment": meta, "rows": rows}, indent=1))
    os.replace(tmp, path)
    report([path], out)


def _environment() -> dict:
    import torch

    env = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "python": sys.version.split()[0], "device": "cpu"}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    return env


def report(paths: list[Path], out: Path) -> str:
    """quality.md (a method x length table of averages) and quality.png in `out`, from the rows
    of one or more quality.json files (in order; `_merged`)."""
    rows = _merged([r for path in paths for r in json.loads(path.read_text())["rows"]])
    lengths = sorted({int(n) for r in rows for n in r["ruler"]["averages"]})
    lines = ["| method | " + " | ".join(f"{n:,}" for n in lengths) + " | effective | s |",
             "| --- |" + " --- |" * (len(lengths) + 2)]
    for r in rows:
        avg = {int(k): v for k, v in r["ruler"]["averages"].items()}
        lines.append(f"| {r['method']} | " + " | ".join(
            f"{avg[n]:.1f}" if n in avg else "" for n in lengths)
            + f" | {r['ruler']['effective_length'] or '-'} | {r['seconds']:.0f} |")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.md").write_text(text)
    _plot(rows, out / "quality.png")
    return text


def _merged(rows: list[dict]) -> list[dict]:
    """The rows of one method (same name, checkpoint and settings) as one row: lengths measured
    in separate rows are joined, and a length measured again with another seed (other prompts)
    is pooled, each task's score weighted by its samples; the averages and the effective
    length are recomputed. A length measured again with the same seed stays a row of its own.
    Each merged row's `seeds` says which seeds each length pools, and its `samples` becomes,
    per length, the fewest samples any task has there."""
    from trainer.evals.ruler.scoring import effective_length

    merged: list[dict] = []
    for row in rows:
        seed = row.get("seed", 0)
        first = next((m for m in merged if (m["method"], m["checkpoint"], m.get("label"))
                      == (row["method"], row["checkpoint"], row.get("label"))
                      and not any(seed in m["seeds"].get(str(n), ()) for n in row["lengths"])),
                     None)
        if first is None:
            merged.append(dict(row, ruler=dict(row["ruler"], scores=[
                dict(s) for s in row["ruler"]["scores"]]),
                seeds={str(n): [seed] for n in row["lengths"]}))
            continue
        cells = {(s["task"], s["length"]): s for s in first["ruler"]["scores"]}
        for score in row["ruler"]["scores"]:
            cell = cells.get((score["task"], score["length"]))
            if cell is None:
                first["ruler"]["scores"].append(dict(score))
                continue
            samples = cell["samples"] + score["samples"]
            cell["score"] = (cell["score"] * cell["samples"]
                             + score["score"] * score["samples"]) / samples
            cell["samples"] = samples
        for n in row["lengths"]:
            first["seeds"].setdefault(str(n), []).append(seed)
        by_length: dict[int, list[float]] = {}
        for cell in first["ruler"]["scores"]:
            by_length.setdefault(int(cell["length"]), []).append(cell["score"])
        averages = {n: sum(v) / len(v) for n, v in sorted(by_length.items())}
        samples: dict[str, int] = {}  # per length: the fewest samples any task has there
        for cell in first["ruler"]["scores"]:
            key = str(cell["length"])
            samples[key] = min(samples.get(key, cell["samples"]), cell["samples"])
        first.update(lengths=sorted(set(first["lengths"]) | set(row["lengths"])),
                     samples=dict(sorted(samples.items(), key=lambda kv: int(kv[0]))),
                     seconds=first["seconds"] + row["seconds"],
                     ruler={**first["ruler"], "averages": {str(n): v for n, v in averages.items()},
                            "effective_length": effective_length(averages,
                                                                 first["ruler"]["threshold"])})
    return merged


def _plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_method: dict[str, dict[int, float]] = {}
    for r in rows:  # "dca" and "dca@8T" share a line
        name = r["method"].split("@")[0]
        by_method.setdefault(name, {}).update(
            {int(k): v for k, v in r["ruler"]["averages"].items()})
    lengths = sorted({n for avg in by_method.values() for n in avg})
    for name, avg in by_method.items():  # a length not measured breaks the line (NaN)
        ax.plot(lengths, [avg.get(n, math.nan) for n in lengths], marker="o", label=name)
    ax.set(xscale="log", xlabel="context length (tokens)", ylabel="RULER average over tasks",
           ylim=(-2, 102), title="RULER-style suite by method")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def prepare(args: argparse.Namespace) -> None:
    from ckpt.gguf import gguf_to_hf
    from ckpt.hf_import import import_hf

    work = Path(args.work)
    if args.hf and not (work / "hf").exists():  # the tokenizer is read from W/hf later on
        work.mkdir(parents=True, exist_ok=True)
        (work / "hf").symlink_to(Path(args.hf).resolve(), target_is_directory=True)
    if not (work / "hf" / "config.json").exists():
        gguf_to_hf(args.gguf, work / "hf", dtype="fp32")
    if not (work / "ckpt").exists():
        import_hf(work / "hf", work / "ckpt", dtype="bf16" if not args.cpu else "fp32")


def training_free(args: argparse.Namespace) -> None:
    ckpt = Path(args.work) / "ckpt"
    t = model_length(ckpt)
    for name in args.plan.split(","):
        overrides, multiples = METHODS[name]
        multiples = args.multiples or multiples
        overrides = [o.format(T=t, T4=t // 4, T32=t // 32) for o in overrides]
        samples = args.samples_8t if name.endswith("@8T") else (
            args.samples_main if name == "dca" else args.samples)
        evaluate(name, ckpt, overrides, [m * t for m in multiples], samples, args,
                 Path(args.out))


def finetune(args: argparse.Namespace) -> None:
    """DCA at 2T on the run's corpus with passkey and multi-key examples mixed in, then the
    suite with the fine-tuned model's own DCA at T..4T."""
    from trainer.train import train

    work = Path(args.work)
    ckpt, t = work / "ckpt", model_length(work / "ckpt")
    run = work / "finetune"
    tokenizer = work / "hf"
    cfg = compose([
        f"checkpoint.load={ckpt}", "+attention=dca", f"data.tokenizer={tokenizer}",
        f"trainer.seq_length={args.ft_length * t}", f"trainer.max_steps={args.ft_steps}",
        f"trainer.micro_batch_size={args.ft_batch}", f"trainer.global_batch_size={args.ft_batch}",
        f"trainer.lr={args.ft_lr}", f"trainer.min_lr={args.ft_lr / 10}",
        f"trainer.warmup_steps={min(5, args.ft_steps // 2)}", "trainer.eval_interval=0",
        "trainer.save_interval=0",
        "trainer.weight_decay=0.0", "data.passkey_fraction=0.15", "data.multikey_fraction=0.15",
        f"checkpoint.dir={run / 'checkpoints'}", "logger=none",
    ] + (["trainer.device=cpu"] if args.cpu else []))
    run.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    last = train(cfg, run)
    print(f"fine-tune: {args.ft_steps} steps in {time.perf_counter() - start:.0f} s; last row "
          f"{last}", flush=True)
    evaluate(f"dca_finetuned_{args.ft_length}T", run / "checkpoints", [], [t, 2 * t, 4 * t],
             args.samples, args, Path(args.out))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=("prepare", "training-free", "finetune", "report"))
    p.add_argument("paths", nargs="*", type=Path,
                   help="report: quality.json files, their rows in one table and plot in --out")
    p.add_argument("--gguf", help="prepare: the model's GGUF file")
    p.add_argument("--hf", help="prepare: or the model's transformers directory")
    p.add_argument("--work", default="outputs/quality/work",
                   help="models, checkpoints, eval runs")
    p.add_argument("--out", default="outputs/quality", help="quality.json, .md, .png")
    p.add_argument("--plan", default="dca,standard,yarn,ntk,pi,dca_c=T",
                   help=f"training-free: methods in order, from {','.join(METHODS)}")
    p.add_argument("--multiples", type=lambda text: tuple(int(m) for m in text.split(",")),
                   default=None, help="training-free: lengths as multiples of T, in place of "
                   "each method's own (e.g. 1 or 2,4)")
    p.add_argument("--tasks", default=None, help="comma-separated task names (default all)")
    p.add_argument("--samples", type=int, default=20, help="samples per task and length")
    p.add_argument("--samples-main", type=int, default=50, help="... for the dca method")
    p.add_argument("--samples-8t", type=int, default=10, help="... at 8T")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ft-length", type=int, default=2, help="fine-tune length, multiple of T")
    p.add_argument("--ft-steps", type=int, default=150)
    p.add_argument("--ft-batch", type=int, default=8)
    p.add_argument("--ft-lr", type=float, default=2e-5)
    p.add_argument("--cpu", action="store_true", help="run on the CPU (tests)")
    args = p.parse_args(argv)
    if args.phase == "prepare" and (args.gguf and args.hf or not (
            args.gguf or args.hf or (Path(args.work) / "hf" / "config.json").exists())):
        p.error("prepare needs the model: --gguf FILE or --hf DIR (one of them)")
    if args.phase == "report":
        if not args.paths:
            p.error("report needs at least one quality.json")
        print(report(args.paths, Path(args.out)))
        return
    {"prepare": prepare, "training-free": training_free, "finetune": finetune}[args.phase](args)


if __name__ == "__main__":
    main()
