"""Why do the alternating pairs rate DCA lower than the ratio of sequential medians?

Two suspects, measured in one process at 32K (FA4 causal against DCA `auto`, 16/16 and 16/4):
- the caching allocator: if the two steps' buffers do not fit each other's cached blocks, the
  pairs would pay cudaMalloc calls the sequential runs do not (counted: num_device_alloc);
- the power state: a step timed alone runs at its own clock under the 700 W cap, in pairs at
  the mixed one (the SM clock and power, nvidia-smi every 100 ms, per phase of ~1.5 s).

Phases, in order: each step `SEQ` calls in a row, then `PAIRS` alternating pairs (the order
swapped every pair, as bench/timing.py does), then both again in a row.

    PYTHONPATH=$PWD python3 docs/results/final_check_2026-11-27/pair_state.py
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from bench import attention as bench
from bench.gpu_power import sampled
from bench.timing import alternating_samples, time_ms
from models.attention import kernels

SEQ, PAIRS = 60, 30


def allocs() -> int:
    return torch.cuda.memory_stats().get("num_device_alloc", 0)


def run(seq: int, kv_heads: int) -> dict[str, object]:
    problem = bench.inputs(seq, 16, kv_heads, 128)
    steps = {}
    for variant in (bench.fa4(), bench.dca(8192, 1024, kernel="fa4")):
        step = bench.fwd_bwd_step(variant, problem)

        def under(step=step, kernel=variant.kernel) -> object:
            with kernels.using(kernel):
                return step()
        steps["fa4" if variant.name == "fa4" else "dca"] = under
    for step in steps.values():
        time_ms(step, 3, 0)
    result: dict[str, object] = {"seq": seq, "kv_heads": kv_heads}
    for phase in ("alone_1", "pairs", "alone_2"):
        if phase == "pairs":
            sink: list = []
            before = allocs()
            with sampled(sink, 100):
                pairs = alternating_samples(steps["fa4"], {"dca": steps["dca"]}, 0, PAIRS)["dca"]
            result[phase] = {
                "fa4_ms": statistics.median(t for t, _ in pairs),
                "dca_ms": statistics.median(t for _, t in pairs),
                "ratio": statistics.median(a / b for a, b in pairs),
                "device_allocs": allocs() - before, "gpu": sink[0] if sink else None}
            continue
        row = {}
        for name, step in steps.items():
            sink = []
            before = allocs()
            with sampled(sink, 100):
                times = time_ms(step, 0, SEQ)
            row[name] = {"ms": statistics.median(times), "device_allocs": allocs() - before,
                         "gpu": sink[0] if sink else None}
        row["ratio"] = row["fa4"]["ms"] / row["dca"]["ms"]
        result[phase] = row
    return result


def main() -> None:
    rows = [run(32768, kv) for kv in (16, 4)]
    for r in rows:
        print(json.dumps(r))
    for r in rows:
        print(f"\n32K 16/{r['kv_heads']}")
        for phase in ("alone_1", "pairs", "alone_2"):
            p = r[phase]
            if phase == "pairs":
                gpu = p["gpu"] or {}
                print(f"  pairs: fa4 {p['fa4_ms']:.2f} ms, dca {p['dca_ms']:.2f} ms, ratio "
                      f"{p['ratio']:.3f}, cudaMallocs {p['device_allocs']}, "
                      f"{gpu.get('sm_clock_mhz', 0):.0f} MHz {gpu.get('power_w', 0):.0f} W")
            else:
                cells = ", ".join(
                    f"{n} {p[n]['ms']:.2f} ms ({(p[n]['gpu'] or {}).get('sm_clock_mhz', 0):.0f} "
                    f"MHz {(p[n]['gpu'] or {}).get('power_w', 0):.0f} W, cudaMallocs "
                    f"{p[n]['device_allocs']})" for n in ("fa4", "dca"))
                print(f"  {phase}: {cells}, ratio {p['ratio']:.3f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
