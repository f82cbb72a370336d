"""The host-side overheads of a training step, A/B in one process (same GPU, interleaved rounds).

    python bench/step_overheads.py --attention standard dca --seq 32768 --rounds 2 --out o.json

Three settings of the same gpt_1p3b run (fused norm and RoPE): megatron's apex-less multi-tensor
fallbacks with the micro-batches read at each step's start (megatron's own path without
apex), `parallel.multi_tensor`'s foreach ops (no host sync per parameter tensor), and those plus
`data.read_ahead` (the next batches read while the backward is queued). Each round runs every
setting once; the figure is the median step over all rounds' timed steps, and its ratio to the
first setting's. Machine-to-machine spread (~1%) is larger than these effects: compare rows of
one run only.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

if __package__ in (None, ""):  # `python bench/step_overheads.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.train import run_case  # noqa: E402
from parallel import multi_tensor  # noqa: E402
from trainer.config import register_configs  # noqa: E402

SETTINGS = [  # (name, parallel.multi_tensor installed, data.read_ahead)
    ("megatron fallbacks, batches read at step start", False, False),
    ("foreach multi-tensor ops", True, False),
    ("foreach + data.read_ahead (default)", True, True),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_1p3b")
    parser.add_argument("--attention", nargs="+", default=["standard"])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    register_configs()
    install = multi_tensor.install
    rows = []
    for attention in args.attention:
        steps: dict[str, list[float]] = {name: [] for name, _, _ in SETTINGS}
        for _ in range(args.rounds):
            for name, ours, read_ahead in SETTINGS:
                multi_tensor.restore()
                multi_tensor.install = install if ours else (lambda: 0)
                extra = ["trainer.fused_norm=true", "trainer.fused_rope=true",
                         f"data.read_ahead={read_ahead}"]
                try:
                    with tempfile.TemporaryDirectory() as tmp:
                        metrics = run_case(args.model, attention, args.seq, args.steps, extra,
                                           Path(tmp))
                finally:
                    multi_tensor.install = install
                gc.collect()
                torch.cuda.empty_cache()
                steps[name] += [1e3 * r["step_time_s"] for r in metrics[args.warmup:]]
        base = statistics.median(steps[SETTINGS[0][0]])
        for name, times in steps.items():
            median = statistics.median(times)
            rows.append({"attention": attention, "setting": name, "median_step_ms": median,
                         "vs_first": median / base, "steps_ms": times})
            print(f"| {attention} | {name} | {median:.1f} | {median / base:.4f} | {len(times)} |",
                  flush=True)
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "argv": sys.argv}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
