"""Results of `bench/extrapolation.py`: read every run's eval.json, write one JSON, a markdown
table and one PNG (passkey, multi-key accuracy and perplexity per method and length).

Run alone, it rebuilds the report from eval.json files, e.g. of one experiment evaluated by
several driver calls side by side:

    python bench/extrapolation_report.py --out DIR --meta RUN/results.json \
        dca=WORK/eval/dca/eval.json yarn=WORK/eval/yarn/0/eval.json,WORK/eval/yarn/1/eval.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.evals.measures import AttentionPoint  # noqa: E402
from trainer.evals.results import EvalResults  # noqa: E402


def summarize(method: str, result: EvalResults) -> list[dict[str, Any]]:
    """One row per length of one eval.json: passkey and multi-key accuracy over all depths,
    perplexity, and perplexity at positions >= the trained length (None when none are)."""
    trained = result.trained_length
    probed = {a.length: a for a in result.attention_by_distance}
    rows = []
    for point in result.perplexity:
        n = point.length
        passkey = [c for c in result.passkey if c.length == n]
        multikey = [c for c in result.multikey if c.length == n]
        beyond = [b for b in point.buckets if b.start >= trained and b.tokens > 0]
        tokens = sum(b.tokens for b in beyond)
        rows.append({
            "method": method, "label": result.label, "length": n,
            "multiple": n / trained,
            "passkey": _share(passkey, "correct"),
            "passkey_trials": sum(c.trials for c in passkey),
            "multikey": _share(multikey, "correct"),
            "multikey_distractor": _share(multikey, "distractor"),
            "multikey_trials": sum(c.trials for c in multikey),
            "ppl": point.perplexity,
            "ppl_beyond_T": math.exp(sum(b.nll * b.tokens for b in beyond) / tokens)
            if tokens else None,
            **_attention(probed.get(n), trained),
        })
    return rows


def _attention(point: AttentionPoint | None, trained: int) -> dict[str, float | None]:
    """Mean over layers of the probed queries' attention entropy and of their probability mass
    on keys at distance >= T (None: not probed)."""
    if point is None:
        return {"attention_entropy": None, "attention_beyond_T": None}
    far = [i for i, e in enumerate(point.edges) if e >= trained]
    layers = len(point.entropy)
    return {"attention_entropy": sum(point.entropy) / layers,
            "attention_beyond_T": sum(sum(m[i] for i in far) for m in point.mass) / layers}


def _share(cells: list, key: str) -> float | None:
    n = sum(c.trials for c in cells)
    return sum(getattr(c, key) for c in cells) / n if n else None


def collect(runs: dict[str, list[Path]]) -> list[dict[str, Any]]:
    """Rows of every method (name -> its runs' eval.json paths), sorted by method then length."""
    rows = []
    for method, paths in runs.items():
        for path in paths:
            rows += summarize(method, EvalResults.read(path))
    order = list(runs)
    return sorted(rows, key=lambda r: (order.index(r["method"]), r["length"]))


def _fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    """Method x length table: passkey / multi-key / ppl / ppl at positions >= T per cell."""
    lengths = sorted({r["length"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["length"]): r for r in rows}
    head = "| method | " + " | ".join(
        f"{n} ({cell_multiple(rows, n)})" for n in lengths) + " |"
    lines = ["Each cell: passkey / multi-key / perplexity / perplexity at positions >= T.", "",
             head, "|" + " --- |" * (len(lengths) + 1)]
    for m in methods:
        cells = []
        for n in lengths:
            r = cell.get((m, n))
            cells.append("" if r is None else " / ".join(
                [_fmt(r["passkey"]), _fmt(r["multikey"]), _fmt(r["ppl"]),
                 _fmt(r["ppl_beyond_T"])]))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if any(r.get("attention_entropy") is not None for r in rows):
        lines += ["", "Attention of queries in the second half of a window (mean over layers): "
                  "entropy (nats) / probability mass on keys at distance >= T.", "",
                  head, "|" + " --- |" * (len(lengths) + 1)]
        for m in methods:
            cells = [cell.get((m, n)) for n in lengths]
            lines.append(f"| {m} | " + " | ".join(
                "" if r is None or r.get("attention_entropy") is None else
                f"{r['attention_entropy']:.2f} / {r['attention_beyond_T']:.3f}"
                for r in cells) + " |")
    labels = list(dict.fromkeys(f"- {r['method']}: `{r['label']}`" for r in rows))
    trials = {(r["passkey_trials"], r["multikey_trials"]) for r in rows}
    return "\n".join(lines + ["", "Run labels:", *labels, "",
                              f"Trials per cell (passkey, multi-key): {sorted(trials)}", ""])


def cell_multiple(rows: list[dict[str, Any]], length: int) -> str:
    multiple = next(r["multiple"] for r in rows if r["length"] == length)
    return f"{multiple:g}T"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Three panels over length: passkey, multi-key accuracy, perplexity (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        x = [r["length"] for r in mine]
        for ax, key in zip(axes, ("passkey", "multikey", "ppl")):
            y = [math.nan if r[key] is None else r[key] for r in mine]
            ax.plot(x, y, marker="o", label=method)
    lengths = sorted({r["length"] for r in rows})
    for ax, name in zip(axes, ("passkey accuracy", "multi-key accuracy", "perplexity")):
        ax.set(xscale="log", xlabel="context length (tokens)", ylabel=name, title=name)
        ax.set_xticks(lengths, [f"{n}\n{cell_multiple(rows, n)}" for n in lengths])
        ax.minorticks_off()
        if name != "perplexity":
            ax.set_ylim(-0.02, 1.02)
        else:
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> list[Path]:
    """results.json (meta + rows), results.md and extrapolation.png into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md", out / "extrapolation.png"]
    paths[0].write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    title = f"{meta.get('model', '')} trained at T={meta.get('seq_length', '?')}"
    paths[1].write_text(f"# Extrapolation: {title}\n\n" + markdown(rows))
    plot(rows, paths[2], title)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="rebuild results.json/.md and the plot from eval.json "
                                "files (method order as given)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--meta", type=Path, help="a results.json whose meta to keep (the training)")
    p.add_argument("runs", nargs="+", metavar="METHOD=EVAL_JSON[,EVAL_JSON...]")
    args = p.parse_args(argv)
    runs: dict[str, list[Path]] = {}
    for spec in args.runs:
        method, sep, paths = spec.partition("=")
        if not (sep and method and paths):
            p.error(f"{spec!r}: expected METHOD=EVAL_JSON[,EVAL_JSON...]")
        runs[method] = [Path(x) for x in paths.split(",")]
        for path in runs[method]:
            if not path.is_file():
                p.error(f"{path}: no such eval.json")
    meta = json.loads(args.meta.read_text())["meta"] if args.meta else {}
    meta["report_command"] = " ".join(["bench/extrapolation_report.py",
                                       *(sys.argv[1:] if argv is None else argv)])
    for path in write(collect(runs), args.out, meta):
        print("wrote", path)


if __name__ == "__main__":
    main()
