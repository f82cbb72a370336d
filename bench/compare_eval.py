"""Compare `trainer.eval` results: markdown tables and one plot from several eval.json files.

    python bench/compare_eval.py multirun/.../*/eval.json --out docs/passkey_by_length.png
    python bench/compare_eval.py runs/*/eval.json --out ruler.png    # eval.suite=ruler runs

Passkey-suite files give passkey accuracy and perplexity by length; RULER-suite files
(eval.suite=ruler) the average score over tasks by length and the effective length. Each run
is labelled by its attention and RoPE label (and its directory where two share a label); the
files may mix both suites: one table per suite, one panel per measure in the plot.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from trainer.evals.results import EvalResults  # noqa: E402


def by_length(result: EvalResults) -> dict[int, tuple[float, float | None]]:
    """length -> (mean passkey accuracy over depths, perplexity or None)."""
    ppl = {p.length: p.perplexity for p in result.perplexity}
    out = {}
    for n in sorted({c.length for c in result.passkey}):
        cells = [c for c in result.passkey if c.length == n]
        out[n] = (sum(c.accuracy for c in cells) / len(cells), ppl.get(n))
    return out


def labelled(results: list[tuple[Path, EvalResults]]) -> dict[str, EvalResults]:
    """Each file's results under its label, or `label (directory)` where labels repeat."""
    counts: dict[str, int] = {}
    for _, r in results:
        counts[r.label] = counts.get(r.label, 0) + 1
    return {r.label if counts[r.label] == 1 else f"{r.label} ({path.parent})": r
            for path, r in results}


def passkey_table(runs: dict[str, EvalResults]) -> str:
    tables = {name: by_length(r) for name, r in runs.items()}
    lengths = sorted({n for table in tables.values() for n in table})
    lines = ["| run | " + " | ".join(f"{n:,}" for n in lengths) + " |",
             "| --- |" + " --- |" * len(lengths)]
    for name, table in tables.items():
        cells = [f"{table[n][0]:.2f} / {table[n][1]:.2f}" if n in table and table[n][1]
                 else f"{table[n][0]:.2f} / -" if n in table else "" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", "cells: passkey accuracy (mean over depths) / perplexity"])


def ruler_table(runs: dict[str, EvalResults]) -> str:
    """A markdown table of RULER averages by length (and effective lengths) for `runs`."""
    lengths = sorted({n for r in runs.values() for n in r.ruler.averages})
    lines = ["| run | " + " | ".join(f"{n:,}" for n in lengths) + " | effective length |",
             "| --- |" + " --- |" * (len(lengths) + 1)]
    for name, r in runs.items():
        avg = r.ruler.averages
        lines.append(f"| {name} | " + " | ".join(f"{avg[n]:.1f}" if n in avg else ""
                                                 for n in lengths)
                     + f" | {r.ruler.effective_length or '-'} |")
    return "\n".join(lines)


def plot(passkey: dict[str, EvalResults], ruler: dict[str, EvalResults], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 * bool(passkey) + bool(ruler)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.5), squeeze=False)
    axes = list(axes[0])
    if passkey:
        acc_ax, ppl_ax = axes.pop(0), axes.pop(0)
        for name, r in passkey.items():
            table = by_length(r)
            ns = sorted(table)
            acc_ax.plot(ns, [table[n][0] for n in ns], marker="o", label=name)
            with_ppl = [n for n in ns if table[n][1]]
            ppl_ax.plot(with_ppl, [table[n][1] for n in with_ppl], marker="o", label=name)
        acc_ax.set(xscale="log", ylim=(-0.02, 1.02), xlabel="context length (tokens)",
                   ylabel="passkey accuracy (mean over depths)")
        ppl_ax.set(xscale="log", yscale="log", xlabel="context length (tokens)",
                   ylabel="perplexity")
    if ruler:
        ax = axes.pop(0)
        for name, r in ruler.items():
            avg = sorted(r.ruler.averages.items())
            ax.plot([n for n, _ in avg], [v for _, v in avg], marker="o", label=name)
        ax.axhline(next(iter(ruler.values())).ruler.threshold, color="gray", linestyle="--",
                   linewidth=1)
        ax.set(xscale="log", ylim=(-2, 102), xlabel="context length (tokens)",
               ylabel="RULER average over tasks")
    for ax in fig.axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="eval.json files")
    parser.add_argument("--out", type=Path, help="write a PNG with one panel per measure")
    args = parser.parse_args()
    missing = [str(p) for p in args.results if not p.is_file()]
    if missing:
        parser.exit(2, f"error: no eval.json at {', '.join(missing)}: give the files "
                       "trainer.eval wrote (RUN_DIR/eval.json)\n")
    results = [(path, EvalResults.read(path)) for path in args.results]
    ruler = labelled([(p, r) for p, r in results if r.suite == "ruler" and r.ruler])
    passkey = labelled([(p, r) for p, r in results if r.suite != "ruler" and r.passkey])
    if passkey:
        print(passkey_table(passkey))
    if ruler:
        print(("\n" if passkey else "") + ruler_table(ruler))
    if args.out and (passkey or ruler):
        plot(passkey, ruler, args.out)


if __name__ == "__main__":
    main()
