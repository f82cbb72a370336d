"""Targets for DCA on FlashAttention-4 checked against measured rows: one table with each
target, its figure and whether it holds.

    python bench/fa4_goals.py --long long.json --small b8k.json --train train.json [...]

`--long`: `python -m bench.attention --out` at 32K and 128K with `--paired fa4` (DCA on FA4,
C = 8192: vs cuDNN causal SDPA, the ratio of the two rows' medians; vs FA4 causal, the median
of the alternating pairs' ratios, which clock and power drift between rows do not move; peak
memory vs FA4 causal's); `--small`: the same at 8K (C = 2048, timed `--back-to-back`), vs
cuDNN; `--train`: `bench/train.py --out` (gpt_1p3b MFU per attention and length). The goals
are the default path's (`trainer.dca_backward=auto`). bench/fa4_goals.sh's stages `inplace`
and `goals` (one GPU call each) run the measurements and this check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/fa4_goals.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_power import describe  # noqa: E402
from bench.perf_goals import check, markdown  # noqa: E402

LONG = "dca_fa4(C=8192,w=1024)"  # the goals' DCA rows at 32K and 128K
SMALL = "dca_fa4(C=2048,w=256)"  # at 8K
VS_CUDNN = {32768: 1.00, 131072: 1.00, 8192: 0.90}  # fwd+bwd speed vs cuDNN causal, at least
VS_FA4 = 0.95  # fwd+bwd speed vs FA4 causal (paired), at least, 32K and 128K
MEMORY = 1.2  # peak memory vs FA4 causal's, at most, 32K and 128K
MFU = {("standard", 32768): 0.55, ("dca", 32768): 0.54,  # gpt_1p3b, at least
       ("standard", 131072): 0.54, ("dca", 131072): 0.53}
MFU_GAP = 0.01  # DCA's MFU below standard's, at most


def attention_goals(result: dict[str, Any], variant: str) -> list[dict[str, Any]]:
    """The speed (and, at 32K and 128K, memory and paired) checks of `variant`'s rows in one
    bench.attention JSON."""
    by_kernel = {(r["variant"], r["seq"], r["kv_heads"]): r for r in result["rows"]
                 if "error" not in r}
    paired = {(p["variant"], p["seq"], p["kv_heads"]): p["ratios"]
              for p in result.get("paired", []) if p["base"] == "fa4"}
    checks = []
    for row in result["rows"]:
        if row["variant"] != variant or row["seq"] not in VS_CUDNN:
            continue
        seq, kv, ran = row["seq"], row["kv_heads"], "error" not in row
        what = f"DCA {seq} {row['heads']}/{kv}" + (f" (x{row['back_to_back']} back to back)"
                                                   if row.get("back_to_back", 1) > 1 else "")
        cudnn = by_kernel.get(("sdpa_cudnn", seq, kv))
        if cudnn:
            checks.append(check(f"{what} speed vs cuDNN causal",
                                cudnn["fwd_bwd_ms"] / row["fwd_bwd_ms"] if ran else None, ">=",
                                VS_CUDNN[seq]))
        if seq == 8192:  # 8K's goal is against cuDNN causal alone
            continue
        ratios = paired.get((variant, seq, kv))
        pairs = f"median of {len(ratios)} pairs" if ratios else "no pairs measured"
        checks.append(check(f"{what} speed vs FA4 causal ({pairs})",
                            statistics.median(ratios) if ratios else None, ">=", VS_FA4))
        fa4 = by_kernel.get(("fa4", seq, kv))
        if fa4 and row.get("peak_complete", True):
            checks.append(check(f"{what} peak memory vs FA4 causal",
                                row["peak_mib"] / fa4["peak_mib"] if ran else None, "<=",
                                MEMORY))
    return checks


def train_goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpt_1p3b MFU per (attention, length) with a goal, noted with the SM clock and power it
    ran at, and DCA's within MFU_GAP of standard's at each length; the default path's rows
    (variant `auto` where the run has variants; bench/train.py names a run without them
    "-")."""
    mfu = {(r["attention"], r["seq"]): r for r in rows if r.get("model") == "gpt_1p3b"
           and (r.get("attention"), r.get("seq")) in MFU
           and r.get("variant", "auto") in ("auto", "-")}
    checks = [check(f"gpt_1p3b {attention} {seq} MFU", r.get("mfu"), ">=",
                    MFU[attention, seq], describe(r.get("gpu_power")))
              for (attention, seq), r in mfu.items()]
    for seq in sorted({seq for _, seq in mfu}):
        dca, standard = mfu.get(("dca", seq), {}), mfu.get(("standard", seq), {})
        gap = (standard["mfu"] - dca["mfu"] if dca.get("mfu") is not None
               and standard.get("mfu") is not None else None)
        checks.append(check(f"gpt_1p3b {seq} MFU, standard's minus DCA's", gap, "<=",
                            MFU_GAP))
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", type=Path, help="bench.attention --out, 32K/128K, --paired fa4")
    parser.add_argument("--small", type=Path, help="bench.attention --out, 8K")
    parser.add_argument("--train", type=Path, nargs="*", default=[],
                        help="bench/train.py --out (one or more)")
    parser.add_argument("--out", type=Path, help="write the checks as JSON here")
    args = parser.parse_args()
    checks = []
    if args.long:
        checks += attention_goals(json.loads(args.long.read_text()), LONG)
    if args.small:
        checks += attention_goals(json.loads(args.small.read_text()), SMALL)
    if args.train:
        checks += train_goals([row for path in args.train
                               for row in json.loads(path.read_text())["results"]])
    print(markdown(checks))
    if args.out:
        args.out.write_text(json.dumps(checks, indent=1))


if __name__ == "__main__":
    main()
