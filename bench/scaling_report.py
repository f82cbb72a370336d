"""bench/scaling.py's report: the Markdown table with its loss check, the speed-up plot, and the
text summary of a profiled step (from bench/train.py's profile summaries)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.scaling_plan import (
    BATCH,
    LAYOUTS,
    LONG,
    LONG_BATCH,
    LONG_STEPS,
    LONG_WARMUP,
    STEPS,
    WARMUP,
)


def _k(seq: int) -> str:
    return f"{seq // 1024}K" if seq % 1024 == 0 else str(seq)


def markdown(results: dict[str, Any]) -> str:
    env, s = results["environment"], results["settings"]
    lines = [
        f"# Two-GPU scaling: {s['model']}, {env['gpu']}, {results['date']}", "",
        f"torch {env['torch']}, megatron-core {env['megatron_core']}, cuDNN {env['cudnn']}, "
        f"commit {env['git_commit']}{' (modified)' if env['git_dirty'] else ''}. "
        f"{BATCH} sequences per step ({LONG_BATCH} from {_k(LONG)} on, full recompute), "
        f"medians after {WARMUP} warm-up steps of {STEPS} ({LONG_WARMUP} of {LONG_STEPS} from "
        f"{_k(LONG)}); overrides: {' '.join(s['extra']) or '-'}.", "",
        "| seq | attention | layout | tokens/s | speed-up vs 1 GPU | MFU | peak GB per GPU "
        "| step s | first-step loss | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(results["rows"], key=lambda r: (r["seq"], r["attention"] != "dca",
                                                     list(LAYOUTS).index(r["layout"]))):
        head = f"| {_k(r['seq'])} | {r['attention']} | {r['label']} |"
        if r["status"] != "ok":
            lines.append(f"{head} | | | | | | {r['status']}: {r['reason']} |")
            continue
        check = r["loss_check"] or {}
        loss = f"{r['losses'][0]:.5f}" if r["losses"] else "-"
        if check.get("compared"):
            loss += (" (= 1 GPU)" if check["equal"] else
                     f" (1 GPU {check['reference']:.5f}: DIFFERS)")
        speedup = "1.00x" if r["layout"] == "1gpu" else (
            f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-")
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        note = "" if check.get("compared", True) else "loss not compared"
        if r["power_w"] is not None:
            note = f"{r['sm_clock_mhz']:,.0f} MHz, {r['power_w']:.0f} W" + (
                f"; {note}" if note else "")
        lines.append(f"{head} {r['tokens_per_s']:,.0f} | {speedup} | {mfu} | "
                     f"{r['peak_mem_gb']:.1f} | {r['step_s']:.3f} | {loss} | {note} |")
    lc = results["loss_check"]
    lines += ["", f"Loss check (first step, DP and CP rows against the 1-GPU row of their length "
                  f"and attention, rtol {s['loss_rtol']:g}): {lc['compared']} compared, "
                  + ("all equal." if lc["equal"] else "SOME DIFFER.")
              + f" TP and PP rows: {lc['not_compared']}.", ""]
    return "\n".join(lines)


def plot_speedups(results: dict[str, Any], path: Path) -> None:
    """Speed-up over one GPU by layout, a bar per length, one panel per attention."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results["rows"] if r["speedup"] is not None]
    attentions = [a for a in ("dca", "standard") if any(r["attention"] == a for r in ok)]
    if not attentions:
        return
    fig, axes = plt.subplots(1, len(attentions), figsize=(6 * len(attentions), 4.2),
                             squeeze=False)
    for ax, attention in zip(axes[0], attentions):
        mine = [r for r in ok if r["attention"] == attention]
        layouts = [k for k in LAYOUTS if any(r["layout"] == k for r in mine)]
        seqs = sorted({r["seq"] for r in mine})
        width = 0.8 / len(seqs)
        for i, seq in enumerate(seqs):
            by = {r["layout"]: r["speedup"] for r in mine if r["seq"] == seq}
            xs = [j + (i - (len(seqs) - 1) / 2) * width for j in range(len(layouts))]
            bars = ax.bar(xs, [by.get(k, 0.0) for k in layouts], width, label=_k(seq))
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.axhline(2.0, color="grey", lw=0.8, ls=":")
        ax.set_xticks(range(len(layouts)), [LAYOUTS[k].label for k in layouts], rotation=20,
                      ha="right", fontsize=8)
        ax.set_ylabel("tokens/s over 1 GPU")
        ax.set_title(f"{results['settings']['model']} {attention}, {results['environment']['gpu']}")
        ax.legend(title="sequence", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- profiling --------------------------------------------------------------------------------

def profile_text(folder: Path, step_ms: float | None) -> str:
    """Per rank, from bench/train.py's profile summaries: the profiled step's wall time, GPU
    busy and idle time (against the unprofiled median step too), categories, top kernels."""
    summaries = sorted((json.loads(p.read_text()) for p in folder.glob("*.summary.json")),
                       key=lambda s: s["rank"])
    if not summaries:
        return "nothing profiled (torch.profiler's CUDA activity needs a GPU)\n"
    lines = []
    for s in summaries:
        busy, wall = s["gpu_busy_ms"], s["wall_ms"]
        lines.append(f"rank {s['rank']}: profiled step {wall:.1f} ms, GPU busy {busy:.1f} ms, "
                     f"idle {wall - busy:.1f} ms ({100 * (wall - busy) / wall:.0f}%)"
                     + (f"; against the unprofiled median step {step_ms:.1f} ms: idle "
                        f"{max(0.0, step_ms - busy):.1f} ms" if step_ms else ""))
        lines.append("  categories (GPU ms): " + ", ".join(
            f"{cat} {ms:.1f}" for cat, ms in s["categories"].items()))
        lines.append("  top kernels (GPU ms, calls):")
        lines += [f"    {ms:9.2f} {count:6d}  {name}" for name, ms, count in s["top_kernels"][:10]]
        lines += ["  " + line for line in s.get("timeline", "").splitlines()]
    return "\n".join(lines) + "\n"
