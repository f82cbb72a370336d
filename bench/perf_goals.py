"""Single-GPU targets for DCA on cuDNN checked against measured rows: one table with each
target, its figure and whether it holds.

    python bench/perf_goals.py --attention attention.json [attention_b2b.json] --train train.json

`--attention`: `python -m bench.attention --out` (DCA vs cuDNN causal SDPA on the same shapes:
forward+backward time ratio, peak memory ratio; rows timed `--back-to-back` are checked against
cuDNN timed the same way, under their own label); `--train`: `bench/train.py --out` (MFU of
gpt_1p3b per attention and length). Goals: DCA >= 0.97x cuDNN at 32K and 128K and >= 0.9x at
8K (every DCA variant, MHA and GQA), DCA peak memory <= 1.3x cuDNN's at 32K and 128K, gpt_1p3b
standard and DCA >= 50% MFU at 32K and >= 48% at 128K. bench/perf_goals.sh runs the
measurements and this check in one GPU call.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/perf_goals.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_power import describe  # noqa: E402

SPEED = {8192: 0.9, 32768: 0.97, 131072: 0.97}  # DCA fwd+bwd time vs cuDNN's, at least
MEMORY = {32768: 1.3, 131072: 1.3}  # DCA peak memory vs cuDNN's, at most
MFU = {32768: 0.50, 131072: 0.48}  # gpt_1p3b, standard and DCA, at least


def attention_goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One check per DCA row with a goal at its length: speed, and memory where one is set."""
    base = {_shape(r): r for r in rows if r["variant"] == "sdpa_cudnn" and "error" not in r}
    checks = []
    for r in rows:
        ref = base.get(_shape(r))
        if not r["variant"].startswith("dca") or r["seq"] not in SPEED or ref is None:
            continue
        calls = r.get("back_to_back", 1)
        what = (f"{r['variant']} {r['seq']} {r['heads']}/{r['kv_heads']}"
                + (f" back to back (x{calls})" if calls > 1 else ""))
        if "error" in r:
            checks.append(check(f"{what} speed vs cuDNN", None, ">=", SPEED[r["seq"]]))
            continue
        checks.append(check(f"{what} speed vs cuDNN", ref["fwd_bwd_ms"] / r["fwd_bwd_ms"],
                            ">=", SPEED[r["seq"]]))
        if r["seq"] in MEMORY and r.get("peak_complete", True):
            checks.append(check(f"{what} peak memory vs cuDNN",
                                r["peak_mib"] / ref["peak_mib"], "<=", MEMORY[r["seq"]]))
    return checks


def _shape(row: dict[str, Any]) -> tuple[int, int, int]:
    """What a DCA row is compared on: its length, KV heads and timing mode."""
    return row["seq"], row["kv_heads"], row.get("back_to_back", 1)


def train_goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpt_1p3b MFU per (attention, length, variant) with a goal, noted with the SM clock and
    power it ran at."""
    return [check(f"gpt_1p3b {r['attention']} {r['seq']} {r.get('variant', '-')} MFU",
                  r.get("mfu"), ">=", MFU[r["seq"]], describe(r.get("gpu_power")))
            for r in rows if r.get("model") == "gpt_1p3b" and r.get("seq") in MFU
            and r.get("attention") in ("standard", "dca")]


def check(what: str, value: float | None, op: str, goal: float,
          note: str = "-") -> dict[str, Any]:
    holds = value is not None and (value >= goal if op == ">=" else value <= goal)
    return {"goal": what, "value": value, "target": f"{op} {goal:g}", "holds": holds,
            "note": note}


def markdown(checks: list[dict[str, Any]]) -> str:
    lines = ["| goal | measured | target | holds |", "| --- | --- | --- | --- |"]
    for c in checks:
        value = "failed to run" if c["value"] is None else f"{c['value']:.3f}"
        if c.get("note", "-") != "-":
            value += f" ({c['note']})"
        lines.append(f"| {c['goal']} | {value} | {c['target']} | {'yes' if c['holds'] else 'NO'} |")
    held = sum(c["holds"] for c in checks)
    return "\n".join(lines + ["", f"{held} of {len(checks)} goals hold."])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", type=Path, nargs="*", default=[],
                        help="bench.attention --out JSON (one per timing mode)")
    parser.add_argument("--train", type=Path, nargs="*", default=[], help="bench/train.py --out")
    parser.add_argument("--out", type=Path, help="write the checks as JSON here")
    args = parser.parse_args()
    checks = []
    for path in args.attention:
        checks += attention_goals(json.loads(path.read_text())["rows"])
    for path in args.train:
        checks += train_goals(json.loads(path.read_text())["results"])
    print(markdown(checks))
    if args.out:
        args.out.write_text(json.dumps(checks, indent=1))


if __name__ == "__main__":
    main()
