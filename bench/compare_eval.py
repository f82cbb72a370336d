"""Compare `trainer.eval` results: one markdown table and one plot from several eval.json files.

    python bench/compare_eval.py multirun/.../*/eval.json --out docs/passkey_by_length.png
    python bench/compare_eval.py runs/*/eval.json --out ruler.png    # eval.suite=ruler runs

Passkey-suite files give passkey accuracy and perplexity by length; RULER-suite files
(eval.suite=ruler) the average score over tasks by length and the effective length, each run
labelled by its attention and RoPE label.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def by_length(result: dict) -> dict[int, tuple[float, float]]:
    """length -> (mean passkey accuracy over depths, perplexity)."""
    lengths = sorted({c["length"] for c in result["passkey"]})
    ppl = {p["length"]: p["perplexity"] for p in result["perplexity"]}
    out = {}
    for n in lengths:
        cells = [c for c in result["passkey"] if c["length"] == n]
        out[n] = (sum(c["accuracy"] for c in cells) / len(cells), ppl[n])
    return out


def ruler_table(runs: dict[str, dict]) -> str:
    """A markdown table of RULER averages by length (and effective lengths) for `runs`."""
    lengths = sorted({int(n) for r in runs.values() for n in r["ruler"]["averages"]})
    lines = ["| run | " + " | ".join(f"{n:,}" for n in lengths) + " | effective length |",
             "| --- |" + " --- |" * (len(lengths) + 1)]
    for name, r in runs.items():
        avg = {int(k): v for k, v in r["ruler"]["averages"].items()}
        lines.append(f"| {name} | " + " | ".join(f"{avg[n]:.1f}" if n in avg else ""
                                                 for n in lengths)
                     + f" | {r['ruler']['effective_length'] or '-'} |")
    return "\n".join(lines)


def ruler_plot(runs: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in runs.items():
        avg = sorted((int(k), v) for k, v in r["ruler"]["averages"].items())
        ax.plot([n for n, _ in avg], [v for _, v in avg], marker="o", label=name)
    threshold = next(iter(runs.values()))["ruler"]["threshold"]
    ax.axhline(threshold, color="gray", linestyle="--", linewidth=1)
    ax.set(xscale="log", ylim=(-2, 102), xlabel="context length (tokens)",
           ylabel="RULER average over tasks")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="eval.json files")
    parser.add_argument("--out", type=Path, help="write a PNG with both panels")
    args = parser.parse_args()
    loaded = [json.loads(path.read_text()) for path in args.results]
    if all(r.get("suite") == "ruler" for r in loaded):
        runs = {r["label"]: r for r in loaded}
        print(ruler_table(runs))
        if args.out:
            ruler_plot(runs, args.out)
        return
    runs = {}
    for path in args.results:
        result = json.loads(path.read_text())
        runs[result["attention"]["kind"]] = by_length(result)
    lengths = sorted({n for table in runs.values() for n in table})
    print("| attention | " + " | ".join(f"{n:,}" for n in lengths) + " |")
    print("| --- |" + " --- |" * len(lengths))
    for name, table in runs.items():
        cells = [f"{table[n][0]:.2f} / {table[n][1]:.2f}" if n in table else "" for n in lengths]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\ncells: passkey accuracy (mean over depths) / perplexity")
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (acc_ax, ppl_ax) = plt.subplots(1, 2, figsize=(10, 4))
        for name, table in runs.items():
            ns = sorted(table)
            acc_ax.plot(ns, [table[n][0] for n in ns], marker="o", label=name)
            ppl_ax.plot(ns, [table[n][1] for n in ns], marker="o", label=name)
        acc_ax.set(xscale="log", ylim=(-0.02, 1.02), xlabel="context length (tokens)",
                   ylabel="passkey accuracy (mean over depths)")
        ppl_ax.set(xscale="log", yscale="log", xlabel="context length (tokens)",
                   ylabel="perplexity")
        for ax in (acc_ax, ppl_ax):
            ax.legend()
            ax.grid(alpha=0.3)
        fig.savefig(args.out, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
