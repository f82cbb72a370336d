"""End-to-end training throughput: tokens/s, TFLOP/s, MFU, peak memory per (model, attention, seq).

Each case is a real `trainer` run (same code path as `python -m trainer`) for a few steps in this
process; figures are medians over the steps after warm-up. Out-of-memory is reported, not fatal.
Beside each MFU figure: the GPU's median SM clock and power draw while the case ran, and how often
the driver held the clock down for the power limit (`bench/gpu_power.py`).

    python bench/train.py --models gpt_1p3b --attention standard dca --seqs 4096 32768 131072 \\
        --steps 10 --warmup 4 --steps-for 131072:4:2 --set trainer.fused_norm=true \\
        --set-for 4096 trainer.micro_batch_size=8 trainer.global_batch_size=8 \\
        --set-for 131072 trainer.recompute=full --profile 4096 32768 --out bench_train.json

Under torchrun every rank runs the same cases (one process group per case is formed and torn
down, so run one case per torchrun where NCCL is used); rank 0 reports, `memory_gb` is the
peak of the most loaded GPU, and an error ends the job rather than leaving peers waiting:

    torchrun --nproc-per-node 2 bench/train.py --models gpt_1p3b --attention dca \\
        --seqs 131072 --set parallel.cp=2 trainer.recompute=full --out cp2.json

Overrides: `--set` applies to every case; `--set-for KEY ...` to the cases KEY names, where KEY
is `:`-separated parts each matching a case's model, attention, seq or variant (`131072`,
`dca:32768`, `gpt_1p3b:dca`); later ones win per key. `--variant NAME ...` runs every case once
per variant with its overrides on top (A/B comparisons in one run); `--skip KEY ...` leaves
cases out. `--profile [KEY ...]`
profiles the last step of every case (or of the matching ones) with torch.profiler, leaves it
out of the medians, and prints where GPU time goes by kernel category, plus the top operators.
"""

from __future__ import annotations

import os

# Long-context activations come in few, huge sizes; without expandable segments the caching
# allocator fragments and a 128K step can fail with gigabytes reserved but unused.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any

if __package__ in (None, ""):  # `python bench/train.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402

from bench.attention import gpu_activity, gpu_timeline  # noqa: E402
from bench.gpu_power import describe, sampled  # noqa: E402
from bench.overrides import merge_overrides  # noqa: E402
from trainer.config import register_configs  # noqa: E402
from trainer.train import Trainer, train  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))  # torchrun's; a plain run is rank 0 of 1
WORLD = int(os.environ.get("WORLD_SIZE", "1"))

# A short run: lr warms up over all but the last step (a 1-step warm-up to 3e-4 diverges at 1.3B).
BASE = {
    "trainer.micro_batch_size": "1", "trainer.global_batch_size": "1",
    "trainer.eval_interval": "0", "checkpoint.save": "false",
    "logger": "none", "trainer.lr": "1e-4", "trainer.min_lr": "1e-5",
}


def matches(key: str, case: dict[str, Any]) -> bool:
    values = {str(case[k]) for k in ("model", "attention", "seq", "variant") if k in case}
    return all(part in values for part in key.split(":"))


def run_case(model: str, attention: str, seq: int, steps: int, extra: list[str],
             run_dir: Path) -> list[dict[str, Any]]:
    """Train `steps` steps of one case; returns its metrics rows (none off rank 0)."""
    base = {**BASE, "model": model, "trainer.seq_length": str(seq),
            "trainer.max_steps": str(steps), "trainer.warmup_steps": str(max(0, steps - 1))}
    overrides = merge_overrides([f"{k}={v}" for k, v in base.items()], extra)
    if attention != "standard":
        overrides.append(f"+attention={attention}")
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    train(cfg, run_dir)
    if RANK:  # rank 0 alone writes metrics.jsonl
        return []
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(rows: list[dict[str, Any]], warmup: int, profiled: bool) -> dict[str, Any]:
    timed = rows[warmup:len(rows) - int(profiled)] or rows[-1:]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "tflops": statistics.median(r["tflops_per_gpu"] for r in timed),
        "mfu": statistics.median(r.get("mfu", float("nan")) for r in timed),
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        # the warm-up steps' own times: the first holds every JIT compile the run pays for
        "warmup_steps_s": [r["step_time_s"] for r in rows[:warmup]],
        "memory_gb": max(r["memory_gb"] for r in rows),
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "losses": [r["loss"] for r in rows],  # every step's: layouts compare their first
        "timed_steps": len(timed),
        "kernel": rows[0].get("attention_kernel", "?"),  # trainer.attention_kernel, resolved
    }


# ---- profiling --------------------------------------------------------------------------------

CATEGORIES = [  # (category, regex on the lower-cased kernel name); first match wins
    ("attention kernels (cuDNN/flash)", r"cudnn|fmha|flash|sdpa|attention"),
    ("DCA rotations/merges (Triton)", r"_rotate|_merge_kernel|_accumulate|rope"),
    ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|matmul|splitk"),
    ("optimizer (Adam, grad norm, clip)", r"adam|multi_tensor|l2norm|normtwo|normops"),
    ("norms", r"norm"),
    ("compiled elementwise (SwiGLU, bias-dropout-add)", r"^triton_"),
    ("NCCL", r"nccl"),
    ("memcpy/memset", r"^memcpy|^memset"),
    ("other elementwise (RoPE, casts, copies, adds)", r"."),
]


def _category(name: str) -> str:
    lowered = name.lower()
    for category, pattern in CATEGORIES:
        if re.search(pattern, lowered):
            return category
    return CATEGORIES[-1][0]


def profile_summary(prof: torch.profiler.profile, wall_ms: float) -> dict[str, Any]:
    """GPU time by kernel category and the top operators of one profiled step."""
    # GPU-side copies of CPU ranges (user annotations such as Optimizer.step) are no kernels.
    on_gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in on_gpu if not getattr(e, "is_user_annotation", False)
               and not e.name.startswith(("Optimizer.", "ProfilerStep"))]
    annotations = sorted({e.name for e in on_gpu} - {e.name for e in kernels})
    by_cat: dict[str, float] = {}
    by_kernel: dict[str, list[float]] = {}
    in_cat: dict[str, dict[str, list[float]]] = {}
    spans = []
    for e in kernels:
        ms = e.time_range.elapsed_us() / 1e3
        cat = _category(e.name)
        by_cat[cat] = by_cat.get(cat, 0.0) + ms
        for entry in (by_kernel.setdefault(e.name[:90], [0.0, 0]),
                      in_cat.setdefault(cat, {}).setdefault(e.name[:60], [0.0, 0])):
            entry[0] += ms
            entry[1] += 1
        spans.append((e.time_range.start, e.time_range.end, e.name))
    busy = gpu_activity(spans)[0] / 1e3 if spans else 0.0
    ops = sorted(prof.key_averages(), key=lambda a: a.self_device_time_total, reverse=True)
    return {
        "wall_ms": wall_ms, "gpu_busy_ms": busy, "kernels": len(kernels),
        "annotations_left_out": annotations[:10],
        "categories": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "top_kernels": [(n, round(t, 2), c) for n, (t, c) in
                        sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:12]],
        "top_ops": [(a.key, round(a.self_device_time_total / 1e3, 2), a.count)
                    for a in ops[:15] if a.self_device_time_total > 0],
        "top_in_category": {cat: [(n, round(t, 2), c) for n, (t, c) in
                                  sorted(names.items(), key=lambda kv: -kv[1][0])[:5]]
                            for cat, names in in_cat.items()},
        "timeline": gpu_timeline(spans, gaps=8) if spans else "",
    }


@contextlib.contextmanager
def profile_step(step: int, sink: list[dict[str, Any]], trace: Path | None = None,
                 ) -> Iterator[None]:
    """Profile Trainer.train_step's call number `step` (1-based) of the runs inside; with
    `trace`, also save its Chrome trace there (gzipped, operator shapes recorded: Perfetto
    opens it) and its summary beside it (`summary_path`), every rank its own."""
    original = Trainer.train_step

    def wrapped(self: Trainer) -> tuple[float, float]:
        if self.step + 1 != step or not torch.cuda.is_available():
            return original(self)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.profiler.profile(activities=activities,
                                    record_shapes=trace is not None) as prof:
            result = original(self)
            torch.cuda.synchronize()
        sink.append(profile_summary(prof, (time.perf_counter() - start) * 1e3))
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
            summary_path(trace).write_text(json.dumps({"rank": RANK, **sink[-1]}, indent=1))
            prof.export_chrome_trace(str(trace.with_suffix("")))
            with open(trace.with_suffix(""), "rb") as raw, gzip.open(trace, "wb") as packed:
                shutil.copyfileobj(raw, packed)
            trace.with_suffix("").unlink()
        return result

    Trainer.train_step = wrapped
    try:
        yield
    finally:
        Trainer.train_step = original


def trace_path(folder: Path | None, case: dict[str, Any]) -> Path | None:
    """Where a case's profiled step's trace goes (--trace), or None; under torchrun each rank
    writes its own (`_rank<r>`)."""
    if folder is None:
        return None
    parts = [case["model"], case["attention"], str(case["seq"])]
    if case["variant"] != "-":
        parts.append(case["variant"])
    if WORLD > 1:
        parts.append(f"rank{RANK}")
    return folder / ("_".join(parts) + ".json.gz")


def summary_path(trace: Path) -> Path:
    """The profile summary (profile_summary's dict and the rank) written beside a trace."""
    return trace.with_name(trace.name.removesuffix(".json.gz") + ".summary.json")


def print_profile(case: dict[str, Any]) -> None:
    prof = case["profile"]
    busy = prof["gpu_busy_ms"]
    # The profiler slows the host; the unprofiled median step is the honest denominator.
    step = 1e3 * case.get("step_s", prof["wall_ms"] / 1e3)
    print(f"\nprofile {case['model']} {case['attention']} {case['seq']} {case['variant']}: "
          f"median step {step:.1f} ms (profiled step {prof['wall_ms']:.1f} ms), GPU busy "
          f"{busy:.1f} ms, {prof['kernels']} kernels")
    print("| category | GPU ms | share of step |\n| --- | --- | --- |")
    for cat, ms in prof["categories"].items():
        print(f"| {cat} | {ms:.1f} | {100 * ms / step:.1f}% |")
    idle = max(0.0, step - busy)
    print(f"| GPU idle (host, syncs, launch gaps) | {idle:.1f} | {100 * idle / step:.1f}% |")
    print("top operators (self GPU ms, calls): " + "; ".join(
        f"{name} {ms} ({count})" for name, ms, count in prof["top_ops"][:10]))
    for cat, top in prof.get("top_in_category", {}).items():
        if not cat.startswith(("attention", "GEMM")):
            print(f"  {cat}: " + "; ".join(f"{n} {ms} ({c})" for n, ms, c in top))
    print(prof.get("timeline", ""))


# ---- main ---------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt_350m"])
    parser.add_argument("--attention", nargs="+", default=["standard", "dca"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 32768])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the medians")
    parser.add_argument("--steps-for", nargs="*", default=[], metavar="SEQ:STEPS:WARMUP",
                        help="steps and warm-up for one sequence length")
    parser.add_argument("--set", nargs="*", default=[], dest="extra",
                        help="extra Hydra overrides for every case")
    parser.add_argument("--set-for", nargs="+", action="append", default=[], metavar="KEY",
                        help="KEY then Hydra overrides for the cases KEY matches")
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME",
                        help="NAME then Hydra overrides: run every case once per variant")
    parser.add_argument("--skip", nargs="+", default=[], metavar="KEY",
                        help="leave out the cases a KEY matches (parts may name a variant)")
    parser.add_argument("--profile", nargs="*", default=None, metavar="KEY",
                        help="profile the last step (excluded from the medians) of every case, "
                             "or of the cases the KEYs match")
    parser.add_argument("--trace", type=Path, default=None, metavar="DIR",
                        help="save each profiled step's Chrome trace (with operator shapes) "
                             "into DIR as MODEL_ATTENTION_SEQ[_VARIANT][_rankR].json.gz, and "
                             "its summary as ...summary.json (every rank under torchrun)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    register_configs()
    if torch.cuda.is_available():  # before any CUDA call: one context per GPU, not all on GPU 0
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    steps_for = {}
    for item in args.steps_for:
        seq, steps, warmup = (int(x) for x in item.split(":"))
        steps_for[seq] = (steps, warmup)
    variants = [(v[0], v[1:]) for v in args.variant] or [("-", [])]

    results = []
    for model in args.models:
        for seq in args.seqs:
            for attention in args.attention:
                for variant, variant_overrides in variants:
                    case: dict[str, Any] = {"model": model, "attention": attention, "seq": seq,
                                            "variant": variant, "gpus": WORLD}
                    if any(matches(key, case) for key in args.skip):
                        continue
                    extra = merge_overrides(args.extra, *[o[1:] for o in args.set_for
                                                          if matches(o[0], case)],
                                            variant_overrides)
                    case["overrides"] = extra
                    steps, warmup = steps_for.get(seq, (args.steps, args.warmup))
                    profile = args.profile is not None and (
                        not args.profile or any(matches(key, case) for key in args.profile))
                    profiles: list[dict[str, Any]] = []
                    power: list[dict[str, Any]] = []
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    try:
                        with tempfile.TemporaryDirectory() as tmp, \
                                profile_step(steps if profile else 0, profiles,
                                             trace_path(args.trace, case)), \
                                sampled(power):
                            rows = run_case(model, attention, seq, steps, extra, Path(tmp))
                    except Exception as exc:
                        if WORLD > 1:  # peers would wait for this rank forever: end the job
                            raise
                        if not isinstance(exc, torch.OutOfMemoryError):
                            traceback.print_exc()  # report and go on with the other cases
                        case["error"] = ("OOM" if isinstance(exc, torch.OutOfMemoryError)
                                         else f"{type(exc).__name__}: {str(exc)[:200]}")
                        rows = []
                    if RANK:  # every rank profiles; the others print one line (imbalance)
                        for prof in profiles:
                            print(f"rank {RANK} profile: GPU busy {prof['gpu_busy_ms']:.1f} ms, "
                                  + ", ".join(f"{cat} {ms:.1f}"
                                              for cat, ms in prof["categories"].items()),
                                  flush=True)
                        continue
                    if rows:
                        case.update(summarize(rows, warmup, bool(profiles)))
                        if profiles:
                            case["profile"] = profiles[0]
                    if power:
                        case["gpu_power"] = power[0]
                    gc.collect()  # an OOM's traceback cycles hold the failed case's tensors
                    if torch.cuda.is_available():
                        case["reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
                    results.append(case)
                    print(json.dumps({k: v for k, v in case.items() if k != "profile"}),
                          flush=True)
                    if "profile" in case:
                        print_profile(case)

    if RANK:
        return
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    import megatron.core
    cudnn = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    print(f"\n{device}, torch {torch.__version__}, cuDNN {cudnn}, megatron-core "
          f"{megatron.core.__version__}, overrides: {' '.join(args.extra) or '-'}\n")
    print("| model | attention (kernel) | seq | variant | GPUs | tokens/s | TFLOP/s per GPU | "
          "MFU | SM clock, power (busy medians) | peak GB (alloc, max over GPUs / reserved, GPU 0) "
          "| loss first→last |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        attention = f"{r['attention']} ({r['kernel']})" if "kernel" in r else r["attention"]
        head = f"| {r['model']} | {attention} | {r['seq']} | {r['variant']} | {r['gpus']} |"
        if "error" in r:
            print(f"{head} {r['error'][:60]} | | | | {r.get('reserved_gb', 0):.1f} reserved | |")
            continue
        print(f"{head} {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {100 * r['mfu']:.1f}% | "
              f"{describe(r.get('gpu_power'))} | {r['memory_gb']:.1f} / "
              f"{r.get('reserved_gb', float('nan')):.1f} | "
              f"{r['loss_first']:.2f}→{r['loss_last']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({
            "device": device, "torch": torch.__version__, "cudnn": cudnn,
            "megatron_core": megatron.core.__version__, "argv": sys.argv,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "results": results,
        }, indent=1))


if __name__ == "__main__":
    main()
