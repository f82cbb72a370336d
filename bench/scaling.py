"""Two-GPU scaling: every layout two GPUs allow against one GPU, by sequence length.

    python3 bench/scaling.py --out out --set trainer.fused_norm=true   # bench/scaling.sh's
    python3 bench/scaling.py --out out --seqs 131072 --dry-run   # the plan and its estimates
    python3 bench/scaling.py --out out --profile            # one CP=2 step at 16K, profiled
    python3 bench/scaling.py --out out --model tiny --seqs 128 --budget 0 --deadline 0 \\
        --set trainer.device=cpu                            # the CPU check, gloo

Rows, for each sequence length and attention (DCA: every layout; standard attention: CP's):

  1gpu        one GPU: the reference of the speed-ups and of the losses
  dp2         DP=2 with the distributed optimizer
  tp2sp       TP=2 with sequence parallelism and the fused RMSNorm
  cp2         CP=2 (models/attention/context_parallel.py)
  cp2_serial  CP=2 with `parallel.cp_overlap=false`: each exchange waited for before computing
  pp2         PP=2 (megatron's 1F1B over the step's two micro-batches)

Every row trains the same global batch for a few steps through bench/train.py (the trainer's own
code path): 2 sequences a step, micro-batches of 1; from 128K on 1 sequence with full recompute
(a 1-GPU step of two 128K sequences takes ~25 s), where dp2 and pp2 cannot run. Each 2-GPU case
is one torchrun; the 1-GPU cases share one process (bench/train.py runs them in turn on one
GPU, as bench/perf_goals.sh does; ~25 s of start-up saved per case). Figures are medians after
warm-up; `speedup` is tokens/s over the 1-GPU row of the same length and attention.

Losses: DP and CP train the 1-GPU run, so from the same initial weights on the same batch their
first-step loss equals the 1-GPU row's within rounding (`loss_check`). TP and PP rows are not
compared: on the GPU megatron seeds each TP rank's and pipeline stage's initial weights apart,
so they start from other weights (tests/trainer/test_pipeline.py checks those layouts).

Time: cases run in priority order (DCA before standard attention, then by length; in each the
1-GPU row, CP, CP serialised, DP, TP, PP) as long as their estimated times, printed per case,
fit in `--budget` seconds; a case that would end past `--deadline`, its estimate rescaled by how
long the finished cases took against theirs, is skipped when its turn comes. Estimates are
gpt_1p3b's on one H100/H200 (docs/benchmarks.md; `estimate_s`). Skipped and failed cases are
rows too, with the reason.

Written under --out: cases/<case>.json and .log (bench/train.py's result and output),
scaling.json (SCHEMA: environment and rows), scaling.md (the table, the loss check) and
scaling.png (speed-up by layout and length). `--profile` profiles one step of one case instead
(CP=2, DCA, the first length: why CP=2 at 16K runs slower than one GPU): profile/*.json.gz (each
rank's Chrome trace), profile/summary.txt (per rank: GPU busy and idle time, kernel categories,
top kernels, the longest gaps).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/scaling.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scaling_plan import (  # noqa: E402
    ATTENTION_LAYOUTS,
    BATCH,
    COMPARED,
    DEFAULT_BUDGET_S,
    DEFAULT_DEADLINE_S,
    LAYOUTS,
    LONG,
    LONG_BATCH,
    LONG_STEPS,
    LONG_WARMUP,
    LOSS_RTOL,
    NOT_COMPARED,
    STEPS,
    WARMUP,
    Case,
    estimate_s,
    plan,
)
from bench.scaling_report import markdown, plot_speedups, profile_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "bench" / "train.py"
SCHEMA = "longctx-scaling/1"


# ---- running ----------------------------------------------------------------------------------

ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception): .+)$|^(error: .+)$")


def error_of(log: str) -> str:
    """The last error line of a case's output (a worker's exception without its module path,
    an `error:` line), torchrun's own report left out."""
    for line in reversed(log.splitlines()):
        line = re.sub(r"^\[(?:rank|default)\d+\]:\s*", "", line.strip())
        match = ERROR_LINE.match(line)
        if match and "ChildFailedError" not in line:
            found = match.group(1) or match.group(2)
            return ("OOM: " if found.startswith("OutOfMemoryError") else "") + found[:300]
    return "no result; see the case's log"


def run_process(command: list[str], env: dict[str, str], log: Path,
                timeout: float | None) -> int | None:
    """Run `command` in its own session, output to `log`; its exit status, or None when it was
    stopped at `timeout` seconds (its whole process group: torchrun and its workers)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        return proc.wait(timeout=None if timeout is None else max(1.0, timeout))
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait()
        return None


def train_command(cases: list[Case], model: str, out: Path,
                  trace: Path | None = None) -> list[str]:
    """bench/train.py over `cases` (one 2-GPU case, or 1-GPU cases of one process); with
    `trace`, the last step profiled and its traces and summaries written there."""
    first = cases[0]
    seqs = sorted({c.seq for c in cases})
    attentions = sorted({c.attention for c in cases})
    command = [str(TRAIN), "--models", model, "--attention", *attentions,
               "--seqs", *map(str, seqs), "--steps", str(first.steps),
               "--warmup", str(first.warmup), "--out", str(out)]
    command += ["--steps-for", *sorted({f"{c.seq}:{c.steps}:{c.warmup}" for c in cases})]
    for c in cases:
        command += ["--set-for", f"{c.attention}:{c.seq}", *c.overrides]
    wanted = {(c.attention, c.seq) for c in cases}
    command += [item for a in attentions for s in seqs if (a, s) not in wanted
                for item in ("--skip", f"{a}:{s}")]
    if trace is not None:
        command += ["--profile", "--trace", str(trace)]
    if first.gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(first.gpus), *command]
    return [sys.executable, *command]


def run_cases(cases: list[Case], model: str, folder: Path, timeout: float | None,
              trace: Path | None = None) -> float:
    """Run one process for `cases` (their gpus alike); fill in their results. Wall seconds."""
    name = cases[0].name if len(cases) == 1 else "1gpu"
    out, log = folder / f"{name}.json", folder / f"{name}.log"
    out.unlink(missing_ok=True)
    env = dict(os.environ)
    if cases[0].gpus == 1:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    started = time.perf_counter()
    code = run_process(train_command(cases, model, out, trace), env, log, timeout)
    wall = time.perf_counter() - started
    results = json.loads(out.read_text()) if out.exists() else None
    found = {(r["attention"], r["seq"]): r for r in (results or {}).get("results", [])}
    for case in cases:
        case.process_s = wall
        result = found.get((case.attention, case.seq))
        if result is None:
            case.status = "error"
            case.reason = (f"stopped at the deadline after {wall:.0f} s" if code is None
                           else error_of(log.read_text(errors="replace")))
        elif "error" in result:
            case.status, case.reason, case.result = "error", result["error"], result
        else:
            case.status, case.result = "ok", result
        if results is not None:
            case.file = folder / f"{case.name}.json"
            if len(cases) > 1:  # one file per case, as for the 2-GPU ones
                case.file.write_text(json.dumps(
                    {**{k: v for k, v in results.items() if k != "results"},
                     "results": [result] if result else []}, indent=1))
    return wall


# ---- the results ------------------------------------------------------------------------------

def _number(value: Any) -> float | None:
    """A finite float, or None (JSON has no NaN)."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def rows(cases: list[Case], rtol: float) -> list[dict[str, Any]]:
    """scaling.json's rows: metrics, the speed-up over the 1-GPU row, the loss check."""
    base = {(c.attention, c.seq): c for c in cases if c.layout == "1gpu" and c.status == "ok"}
    table = []
    for c in cases:
        r = c.result
        row: dict[str, Any] = {
            "layout": c.layout, "label": LAYOUTS[c.layout].label, "gpus": c.gpus,
            "attention": c.attention, "seq": c.seq, "status": c.status, "reason": c.reason,
            "sequences_per_step": c.batch, "steps": c.steps, "warmup": c.warmup,
            "tokens_per_s": _number(r.get("tokens_per_s")), "speedup": None,
            "mfu": _number(r.get("mfu")), "tflops_per_gpu": _number(r.get("tflops")),
            "step_s": _number(r.get("step_s")), "peak_mem_gb": _number(r.get("memory_gb")),
            "losses": r.get("losses", [r["loss_first"]] if "loss_first" in r else []),
            "loss_check": None, "kernel": r.get("kernel"),
            "sm_clock_mhz": (r.get("gpu_power") or {}).get("sm_clock_mhz"),
            "power_w": (r.get("gpu_power") or {}).get("power_w"),
            "estimated_s": round(c.estimated_s, 1), "process_s": _round(c.process_s),
            "overrides": c.overrides,
            "case_file": f"cases/{c.file.name}" if c.file is not None else None,
        }
        ref = base.get((c.attention, c.seq))
        if c.status == "ok" and ref is not None and c.layout != "1gpu":
            row["speedup"] = row["tokens_per_s"] / ref.result["tokens_per_s"]
        if c.status == "ok" and c.layout != "1gpu":
            row["loss_check"] = loss_check(c, ref, rtol)
        table.append(row)
    return table


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def loss_check(case: Case, ref: Case | None, rtol: float) -> dict[str, Any]:
    if case.layout not in COMPARED:
        return {"compared": False, "reason": NOT_COMPARED}
    if ref is None:
        return {"compared": False, "reason": "no 1-GPU row of this length and attention"}
    loss, expected = case.result["loss_first"], ref.result["loss_first"]
    diff = abs(loss - expected) / abs(expected)
    return {"compared": True, "reference": expected, "loss": loss, "rel_diff": diff,
            "rtol": rtol, "equal": diff <= rtol}


def environment(cases: list[Case]) -> dict[str, Any]:
    """The machine and software, from a case's bench/train.py result (this process never
    starts CUDA: a context on GPU 0 would sit beside every case's) or the installed packages."""
    ran = next((json.loads(c.file.read_text()) for c in cases if c.file is not None), {})
    gpus = []
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                                "--format=csv,noheader"], capture_output=True, text=True)
        gpus = [line.strip() for line in query.stdout.splitlines() if line.strip()]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=ROOT, capture_output=True, text=True).stdout.strip())
    return {
        "gpu": ran.get("device") or (gpus[0].split(",")[0] if gpus else "cpu"),
        "gpus_visible": gpus, "torch": ran.get("torch") or _version("torch"),
        "megatron_core": ran.get("megatron_core") or _version("megatron-core"),
        "cudnn": ran.get("cudnn"), "python": platform.python_version(),
        "host_cpus": os.cpu_count(), "git_commit": commit or None, "git_dirty": dirty,
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_results(cases: list[Case], settings: dict[str, Any], out: Path, rtol: float | None,
                  plot: bool) -> dict[str, Any]:
    """scaling.json and scaling.md (after every case: a run stopped early keeps what it had),
    and with `plot` scaling.png. `rtol` None: LOSS_RTOL's, by the device the cases ran on."""
    env = environment(cases)
    rtol = rtol or LOSS_RTOL["cpu" if env["gpu"] == "cpu" else "gpu"]
    settings = {**settings, "loss_rtol": rtol}
    table = rows(cases, rtol)
    checked = [r["loss_check"] for r in table if r["loss_check"] and r["loss_check"]["compared"]]
    results = {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "environment": env, "settings": settings, "rows": table,
        "loss_check": {"compared": len(checked), "equal": all(c["equal"] for c in checked),
                       "layouts": sorted(COMPARED), "not_compared": NOT_COMPARED},
    }
    (out / "scaling.json").write_text(json.dumps(results, indent=1))
    (out / "scaling.md").write_text(markdown(results))
    if plot:
        plot_speedups(results, out / "scaling.png")
    return results


# ---- main -------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="gpt_1p3b")
    parser.add_argument("--seqs", nargs="+", type=int, default=[16384, 32768])
    parser.add_argument("--attention", nargs="+", default=["dca", "standard"],
                        choices=list(ATTENTION_LAYOUTS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--set", nargs="*", default=[], dest="extra",
                        help="Hydra overrides for every case")
    parser.add_argument("--set-for", nargs="+", action="append", default=[], metavar="KEY",
                        help="KEY (layout, attention, seq, ':'-joined) then overrides for the "
                             "cases it matches")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds of estimated time to plan (0: every case)")
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                        help="seconds after which no case runs on (0: none)")
    parser.add_argument("--loss-rtol", type=float, default=None,
                        help="first-step loss tolerance (default: 1e-5 on the CPU, 1e-3 on GPUs)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan and its estimates, run nothing")
    parser.add_argument("--profile", action="store_true",
                        help="profile one step of one case instead: the first 2-GPU layout of "
                             "--layouts (cp2), first --attention and --seqs length")
    args = parser.parse_args()
    try:
        main_checked(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main_checked(args: argparse.Namespace) -> None:
    if any(s <= 0 or s % 4 for s in args.seqs):
        raise ValueError(f"--seqs {args.seqs}: lengths must be positive multiples of 4 "
                         "(CP=2 cuts a sequence into 4 pieces)")
    if args.budget < 0 or args.deadline < 0:
        raise ValueError("--budget and --deadline must be >= 0")
    folder = args.out / "cases"
    folder.mkdir(parents=True, exist_ok=True)
    if args.profile:
        profile(args, folder)
        return
    cases = plan(args.seqs, args.attention, args.layouts, args.extra, args.set_for, args.budget)
    planned = [c for c in cases if c.status == "planned"]
    print(f"{len(planned)} of {len(cases)} cases, estimated "
          f"{sum(c.estimated_s for c in planned):.0f} s for gpt_1p3b on an H100/H200 (budget "
          f"{args.budget:.0f} s, deadline {args.deadline:.0f} s; 0: none):", flush=True)
    for c in cases:
        when = f"~{c.estimated_s:.0f} s" if c.status == "planned" else f"skipped: {c.reason}"
        print(f"  {c.name:28s} {when}", flush=True)
    if args.dry_run:
        return
    settings = {"model": args.model, "seqs": args.seqs, "attention": args.attention,
                "layouts": args.layouts, "extra": args.extra, "set_for": args.set_for,
                "sequences_per_step": {"below_long": BATCH, "long": LONG_BATCH},
                "long_from": LONG, "steps": [STEPS, WARMUP], "long_steps": [LONG_STEPS,
                                                                         LONG_WARMUP],
                "budget_s": args.budget, "deadline_s": args.deadline, "argv": sys.argv}
    started = time.perf_counter()
    spent = estimated = 0.0
    baselines = [c for c in planned if c.gpus == 1]
    for group in ([baselines] if baselines else []) + [[c] for c in planned if c.gpus > 1]:
        elapsed = time.perf_counter() - started
        # the estimates rescaled by how the finished cases compared with theirs
        need = sum(c.estimated_s for c in group) * (
            min(3.0, max(0.5, spent / estimated)) if estimated else 1.0)
        if args.deadline and elapsed + need > args.deadline:
            for c in group:
                c.status = "skipped"
                c.reason = (f"would end past the {args.deadline:.0f} s deadline: {elapsed:.0f} s "
                            f"spent, ~{need:.0f} s more")
                print(f"== {c.name}: {c.reason}", flush=True)
        else:
            print(f"== {', '.join(c.name for c in group)}: ~{need:.0f} s", flush=True)
            timeout = args.deadline - elapsed if args.deadline else None
            wall = run_cases(group, args.model, folder, timeout)
            spent, estimated = spent + wall, estimated + sum(c.estimated_s for c in group)
            for c in group:
                print(f"   {c.name}: " + (f"{c.result['tokens_per_s']:,.0f} tokens/s"
                                          if c.status == "ok" else f"{c.status}: {c.reason}"))
            print(f"   {wall:.0f} s", flush=True)
        write_results(cases, settings, args.out, args.loss_rtol, plot=False)
    results = write_results(cases, settings, args.out, args.loss_rtol, plot=True)
    print(markdown(results))
    print(f"{time.perf_counter() - started:.0f} s; {args.out}/scaling.json, scaling.md, "
          "scaling.png")


def profile(args: argparse.Namespace, folder: Path) -> None:
    """One case, the first 2-GPU layout of --layouts (cp2 by default) with the first attention
    and length: step 4 profiled on every rank, after 2 warm-up steps and a timed one (the
    unprofiled step the idle time is also measured against)."""
    layout = next((k for k in args.layouts if LAYOUTS[k].gpus > 1), None)
    if layout is None:
        raise ValueError(f"--profile needs a 2-GPU layout in --layouts, got {args.layouts}")
    case = next(c for c in plan(args.seqs[:1], args.attention[:1], [layout], args.extra,
                                args.set_for, 0) if c.layout == layout)
    if case.status == "skipped":
        raise ValueError(f"{case.name}: {case.reason}")
    case.steps, case.warmup = 4, 2
    trace = args.out / "profile"
    shutil.rmtree(trace, ignore_errors=True)
    trace.mkdir()
    print(f"== profiling {case.name}: ~{estimate_s(case, True, True):.0f} s", flush=True)
    run_cases([case], args.model, folder, args.deadline or None, trace)
    step = case.result.get("step_s")
    text = (f"{case.name}: {case.status}{': ' + case.reason if case.reason else ''}\n"
            + profile_text(trace, 1e3 * step if step else None))
    (trace / "summary.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
