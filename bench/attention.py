"""Attention kernel benchmark: DCA and chunked attention against torch SDPA causal attention.

    python -m bench.attention --seqs 8192,32768,131072 --out results.json
    python -m bench.attention --variants sdpa_cudnn,fa4,dca,dca_fa4 --seqs 32768   # FA4 rows
    python -m bench.attention --variants fa4,dca_fa4 --seqs 32768 --paired fa4    # ratios

Variants run under the attention kernel they name (models/attention/kernels.py): the plain
names under cudnn (today's default off SM90 or without FlashAttention-4), `*_fa4` under fa4
(`fa4` itself: FA4's causal `flash_attn_func`).

Every variant takes q, k, v as [batch, seq, heads, head_dim] bf16 (SDPA gets [b, h, s, d]
views of the same memory). DCA rotates q and k itself (its three query rotations are part of its
cost); the SDPA and chunked variants get q, k as they are, i.e. their RoPE is not timed.

FLOP convention: causal attention's forward is 4 * b * h * s^2 * d / 2 (two matmuls, half the
score matrix); the backward is 2.5x the forward, so forward+backward is 3.5x. DCA does exactly
causal attention's work and is counted the same way; chunked attention is counted by its own
work (causal within each chunk). `vs cudnn` is cuDNN causal SDPA's time divided by the
variant's time on the same shape. Times are medians over `--repeats` samples between CUDA
events after warm-up, each one call followed by a synchronisation (host time included), or with
`--back-to-back N` the mean of N calls queued one after another (as inside a model, where the
host runs ahead of the GPU); memory is the peak allocated during one forward+backward above the
inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.timing import alternating_ratios, base_first, host_time_ms, peak_mib, time_ms
from models.attention import kernels, lse_attention
from models.attention.dca.attention import dual_chunk_attention

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Variant:
    name: str
    fn: Attention
    flops_fwd: Callable[[int, int, int, int], float]  # (batch, q_heads, seq, head_dim)
    # False where memory the variant keeps between calls (CUDA graphs' pools) is outside the
    # measured peak: such a peak is no figure to judge a memory goal on
    peak_complete: bool = True
    kernel: str = "cudnn"  # trainer.attention_kernel while it runs (kernels.py)


def causal_flops(b: int, h: int, s: int, d: int) -> float:
    return 4 * b * h * s * s * d / 2


def chunked_flops(chunk: int) -> Callable[[int, int, int, int], float]:
    def flops(b: int, h: int, s: int, d: int) -> float:
        full, tail = divmod(s, chunk)
        return full * causal_flops(b, h, chunk, d) + causal_flops(b, h, tail, d)
    return flops


def sdpa(backend: str) -> Variant:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kernel = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(kernel):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=q.shape[2] != k.shape[2])  # [b, h, s, d]
        return out.transpose(1, 2)
    return Variant(f"sdpa_{backend}", fn, causal_flops)


def flex(mode: str = "default") -> Variant:
    """Causal attention from torch's flex_attention: a Triton kernel that Inductor generates
    (and with `mode="max-autotune-no-cudagraphs"` autotunes), skipping the blocks the mask
    empties. Its speed is what a fused DCA kernel written in Triton could hope for at best (DCA
    does causal attention's work, plus its rotations), which is why the row is here. Compiled for
    CUDA inputs; eager (the dense reference) for others, also on a CUDA host (Inductor's CPU
    flex_attention takes no float64)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    masks: dict[tuple[int, str], object] = {}
    compiled = torch.compile(flex_attention, mode=mode, dynamic=False)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seq = q.shape[1]
        key = (seq, q.device.type)
        if key not in masks:  # built once per shape, as a model would; compiled, the
            # builder never holds the dense [s, s] mask (128 GiB at 128K)
            masks[key] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seq, seq,
                                           device=q.device, _compile=q.is_cuda)
        kernel = compiled if q.is_cuda else flex_attention
        out = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                     block_mask=masks[key], enable_gqa=q.shape[2] != k.shape[2])  # [b, h, s, d]
        return out.transpose(1, 2)
    return Variant("flex" if mode == "default" else f"flex({mode})", fn, causal_flops)


def fa4() -> Variant:
    """FlashAttention-4's causal attention (what standard attention runs under kernel fa4)."""
    from models.attention.causal import causal_attention
    return Variant("fa4", lambda q, k, v: causal_attention(q, k, v), causal_flops, kernel="fa4")


def dca(chunk_size: int, local_size: int, name: str = "dca",
        cuda_graphs: bool = False, kernel: str = "cudnn", path: str = "default") -> Variant:
    """`path`, under fa4 (trainer.dca_backward, dca/grouped.py): "default" (auto: DCA's
    kernels where they apply, the backward in pieces), "one_call" (one_piece: the backward
    kernel in one piece), "keep" (auto, the forward's rotations kept for the backward:
    trainer.dca_keep_rotated) or "parts" (the part calls both ways)."""
    backward = {"one_call": "one_piece", "parts": "parts"}.get(path, "auto")

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dual_chunk_attention(q, k, v, chunk_size=chunk_size, local_size=local_size,
                                    cuda_graphs=cuda_graphs, backward=backward,
                                    keep_rotated=path == "keep")
    return Variant(f"{name}(C={chunk_size},w={local_size})", fn, causal_flops,
                   peak_complete=not cuda_graphs, kernel=kernel)


def chunked(chunk_size: int, kernel: str = "cudnn") -> Variant | None:
    try:
        from models.attention.chunked import chunked_attention
    except ImportError:
        return None

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return chunked_attention(q, k, v, chunk_size=chunk_size)
    suffix = "" if kernel == "cudnn" else f"_{kernel}"
    return Variant(f"chunked{suffix}(C={chunk_size})", fn, chunked_flops(chunk_size),
                   kernel=kernel)


# name -> builder(args); a builder returns None when its variant is unavailable.
REGISTRY: dict[str, Callable[[argparse.Namespace], Variant | None]] = {
    "sdpa_cudnn": lambda a: sdpa("cudnn"),
    "sdpa_flash": lambda a: sdpa("flash"),
    "flex": lambda a: flex(),
    "flex_autotune": lambda a: flex("max-autotune-no-cudagraphs"),
    "dca": lambda a: dca(a.dca_chunk, a.dca_local),
    "dca_small": lambda a: dca(a.dca_small_chunk, a.dca_small_chunk // 8, "dca"),
    "chunked": lambda a: chunked(a.chunked_size),
    # FlashAttention-4 (opt-in: needs `pip install -e ".[fa4]"` and an SM90+ GPU)
    "fa4": lambda a: fa4(),
    "dca_fa4": lambda a: dca(a.dca_chunk, a.dca_local, "dca_fa4", kernel="fa4"),
    "dca_small_fa4": lambda a: dca(a.dca_small_chunk, a.dca_small_chunk // 8, "dca_fa4",
                                   kernel="fa4"),
    # DCA on FA4 forced onto one path (dca(path=...)): its part calls both ways, or its kernels
    # with the backward in one piece, or with the forward's rotations kept (grouped.py)
    **{f"dca{size}_fa4_{path}": (lambda a, size=size, path=path: dca(
        a.dca_chunk if size == "" else a.dca_small_chunk,
        a.dca_local if size == "" else a.dca_small_chunk // 8, f"dca_fa4_{path}",
        kernel="fa4", path=path))
       for size in ("", "_small") for path in ("parts", "one_call", "keep")},
    "dca_small_graphs_fa4_parts": lambda a: dca(a.dca_small_chunk, a.dca_small_chunk // 8,
                                                "dca_graphs_fa4_parts", True, "fa4", "parts"),
    "chunked_fa4": lambda a: chunked(a.chunked_size, "fa4"),
    "dca_graphs_fa4": lambda a: dca(a.dca_chunk, a.dca_local, "dca_graphs_fa4", True, "fa4"),
    "dca_small_graphs_fa4": lambda a: dca(a.dca_small_chunk, a.dca_small_chunk // 8,
                                          "dca_graphs_fa4", True, "fa4"),
    # replayed as CUDA graphs (opt-in; their peak_mib leaves out the graphs' pools, measured by
    # bench/dca_graph_memory.py)
    "dca_graphs": lambda a: dca(a.dca_chunk, a.dca_local, "dca_graphs", True),
    "dca_small_graphs": lambda a: dca(a.dca_small_chunk, a.dca_small_chunk // 8, "dca_graphs",
                                      True),
}
# flex is opt-in: it compiles (and autotunes) per shape; FA4 needs its optional install
DEFAULT_VARIANTS = [name for name in REGISTRY if "graphs" not in name
                    and not name.startswith("flex") and "fa4" not in name]


def measure(variant: Variant, seq: int, heads: int, kv_heads: int, dim: int,
            args: argparse.Namespace) -> dict[str, object]:
    with kernels.using(variant.kernel):
        return _measure(variant, seq, heads, kv_heads, dim, args)


def inputs(seq: int, heads: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """q, k, v [1, s, h, d] (bf16 on the GPU, requiring grad) and dout like q."""
    q, k, v = (torch.randn(1, seq, h, dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    return q, k, v, torch.randn_like(q)


def fwd_bwd_step(variant: Variant, problem: tuple[torch.Tensor, ...]) -> Callable[[], object]:
    """One forward+backward of `variant` on `problem` (`inputs`), under the active kernel."""
    q, k, v, dout = problem
    return lambda: torch.autograd.grad(variant.fn(q, k, v), (q, k, v), dout)


def _measure(variant: Variant, seq: int, heads: int, kv_heads: int, dim: int,
             args: argparse.Namespace) -> dict[str, object]:
    problem = inputs(seq, heads, kv_heads, dim)
    q, k, v, _ = problem

    def forward() -> object:
        return variant.fn(q, k, v)

    forward_backward = fwd_bwd_step(variant, problem)

    fwd_times = time_ms(forward, args.warmup, args.repeats, args.back_to_back)
    fwd_bwd_times = time_ms(forward_backward, args.warmup, args.repeats, args.back_to_back)
    fwd, fwd_bwd = statistics.median(fwd_times), statistics.median(fwd_bwd_times)
    host_ms = host_time_ms(forward_backward)
    peak = peak_mib(forward_backward)
    flops = variant.flops_fwd(1, heads, seq, dim)
    return {"variant": variant.name, "seq": seq, "heads": heads, "kv_heads": kv_heads,
            "head_dim": dim, "back_to_back": args.back_to_back, "fwd_ms": fwd,
            "fwd_bwd_ms": fwd_bwd, "fwd_bwd_host_ms": host_ms,
            "fwd_min_ms": min(fwd_times), "fwd_bwd_min_ms": min(fwd_bwd_times),
            "fwd_tflops": flops / fwd / 1e9, "fwd_bwd_tflops": 3.5 * flops / fwd_bwd / 1e9,
            "peak_mib": peak,
            "peak_complete": variant.peak_complete, "kernel": variant.kernel}


def paired_rows(variants: list[Variant], base: Variant, seq: int, heads: int, kv_heads: int,
                dim: int, args: argparse.Namespace) -> list[dict[str, object]]:
    """--paired: every other variant's fwd+bwd timed alternately with `base`'s, on one set of
    inputs (alternating_ratios)."""
    problem = inputs(seq, heads, kv_heads, dim)

    def step(variant: Variant) -> Callable[[], object]:
        run = fwd_bwd_step(variant, problem)

        def under_its_kernel() -> object:
            with kernels.using(variant.kernel):
                return run()
        return under_its_kernel

    return [{"seq": seq, "kv_heads": kv_heads, "variant": variant.name, "base": base.name,
             "ratios": alternating_ratios(step(base), step(variant), args.warmup, args.repeats,
                                          args.back_to_back)}
            for variant in variants if variant is not base]


def markdown(rows: list[dict[str, object]]) -> str:
    header = ("| seq | heads q/kv | variant | kernel | fwd ms | fwd TFLOP/s | fwd+bwd ms | "
              "fwd+bwd TFLOP/s | vs cudnn (fwd / fwd+bwd) | vs fa4 (fwd+bwd) | peak MiB |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    def by_shape(name: str) -> dict[tuple, dict[str, object]]:
        return {(r["seq"], r["kv_heads"]): r for r in rows if r["variant"] == name
                and "error" not in r}
    base, fa4_base = by_shape("sdpa_cudnn"), by_shape("fa4")
    for r in rows:
        head = (f"| {r['seq']} | {r['heads']}/{r['kv_heads']} | {r['variant']} | "
                f"{r.get('kernel', '')} |")
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | | | | |")
            continue
        ref, ref4 = base.get((r["seq"], r["kv_heads"])), fa4_base.get((r["seq"], r["kv_heads"]))
        ratio = (f"{ref['fwd_ms'] / r['fwd_ms']:.2f}x / {ref['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x"
                 if ref else "n/a")
        ratio4 = f"{ref4['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if ref4 else "n/a"
        lines.append(f"{head} {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | {r['fwd_bwd_ms']:.2f} "
                     f"| {r['fwd_bwd_tflops']:.0f} | {ratio} | {ratio4} | {r['peak_mib']:.0f} |")
    return "\n".join(lines)


def gpu_activity(events: list[tuple[float, float, str]],
                 ) -> tuple[float, float, list[tuple[float, str]]]:
    """(busy, span, idle gaps) of (start, end, name) kernel intervals in microseconds: busy is
    their union (streams may overlap), span first start to last end, each gap with the kernel
    it ended in."""
    events = sorted(events)
    busy, end, idle = 0.0, events[0][0], []
    for start, stop, name in events:
        if start > end:
            idle.append((start - end, name))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy, end - events[0][0], idle


def gpu_timeline(events: list[tuple[float, float, str]], gaps: int = 6) -> str:
    """One line on a profile's GPU activity, (start, end, name) in microseconds: kernels, busy
    time against the span, and the largest idle gaps with the kernel each one ended in (where
    the GPU waited for the host)."""
    busy, span, idle = gpu_activity(events)
    worst = ", ".join(f"{gap:.0f} us before {name[:40]}" for gap, name in sorted(idle)[::-1][:gaps])
    return (f"GPU: {len(events)} kernels, busy {busy / 1e3:.2f} ms of {span / 1e3:.2f} ms "
            f"({busy / span:.0%}); {len(idle)} idle gaps, {sum(g for g, _ in idle) / 1e3:.2f} ms "
            f"in all; largest: {worst or 'none'}")


def profile(variant: Variant, seq: int, heads: int, kv_heads: int, dim: int,
            trace: str = "") -> str:
    """Top CUDA kernels and CPU ops of one forward+backward (where the time goes), after a
    line on the GPU's busy and idle time."""
    step = fwd_bwd_step(variant, inputs(seq, heads, kv_heads, dim))
    with kernels.using(variant.kernel):
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            step()
            torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    launched = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA]
    table = prof.key_averages()
    tables = (table.table(sort_by=key, row_limit=12, max_name_column_width=60)
              for key in ("self_cuda_time_total", "self_cpu_time_total"))
    return "\n".join([gpu_timeline(launched), *tables])


def add_variant_args(parser: argparse.ArgumentParser) -> None:
    """The shape and the variants' settings REGISTRY's builders read."""
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dca-chunk", type=int, default=8192)
    parser.add_argument("--dca-local", type=int, default=1024)
    parser.add_argument("--dca-small-chunk", type=int, default=2048)
    parser.add_argument("--chunked-size", type=int, default=8192)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="8192,32768,131072")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    add_variant_args(parser)
    parser.add_argument("--kv-heads", default="16,4", help="one row set per KV head count")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--back-to-back", type=int, default=1,
                        help="calls per timed sample (1: synchronised after each call, host "
                        "time included; more: queued back to back, as inside a model)")
    parser.add_argument("--profile", default="", help="variant name: print its top kernels")
    parser.add_argument("--profile-seq", type=int, default=32768)
    parser.add_argument("--profile-kv-heads", type=int, default=16)
    parser.add_argument("--trace", default="", help="write the profile's Chrome trace here")
    parser.add_argument("--paired", default="", help="variant name: also time every other "
                        "variant alternating with it, and print the per-sample ratios")
    parser.add_argument("--out", default="", help="write all rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.attention needs a CUDA device")
    variants = []
    for name in args.variants.split(","):
        variant = REGISTRY[name](args)
        if variant is None:
            print(f"skipping {name}: not importable")
        else:
            variants.append(variant)
    rows: list[dict[str, object]] = []
    paired: list[dict[str, object]] = []  # --paired's per-sample ratios
    for seq in (int(s) for s in args.seqs.split(",")):
        for kv in (int(h) for h in args.kv_heads.split(",")):
            for variant in variants:
                try:
                    row = measure(variant, seq, args.heads, kv, args.head_dim, args)
                except (RuntimeError, torch.OutOfMemoryError) as err:
                    row = {"variant": variant.name, "seq": seq, "heads": args.heads,
                           "kv_heads": kv, "error": str(err).splitlines()[0][:80]}
                torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps(row), flush=True)
            if args.paired:
                base = next(v for v in variants if v.name.split("(")[0] == args.paired)
                for row in paired_rows(variants, base, seq, args.heads, kv, args.head_dim,
                                       args):
                    paired.append(row)
                    print(json.dumps(row), flush=True)
    table = markdown(rows)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}, {args.back_to_back} call(s) per timed "
          f"sample\n\n{table}")
    if paired:
        print(f"\nfwd+bwd time of {paired[0]['base']} over each variant's, {args.repeats} "
              "alternating pairs (--paired), and the medians of the pairs timed in each "
              "order:\n\n| seq | heads q/kv | variant | median (min - max) | base first | "
              "variant first |\n|---|---|---|---|---|---|")
        for p in paired:
            r = p["ratios"]
            by_order = ([x for i, x in enumerate(r) if base_first(i) == first]
                        for first in (True, False))
            print(f"| {p['seq']} | {args.heads}/{p['kv_heads']} | {p['variant']} | "
                  f"{statistics.median(r):.3f}x ({min(r):.3f} - {max(r):.3f}) | "
                  + " | ".join(f"{statistics.median(x):.3f}x" if x else "-" for x in by_order)
                  + " |")
    if lse_attention.FALLBACKS:
        print("\nkernel fallbacks (asked for, ran, why):", sorted(lse_attention.FALLBACKS))
    if args.profile:
        chosen = next(v for v in variants if v.name.split("(")[0] == args.profile)
        print(f"\n{chosen.name} at {args.profile_seq}, {args.heads}/{args.profile_kv_heads} "
              "heads, fwd+bwd:\n" + profile(chosen, args.profile_seq, args.heads,
                                            args.profile_kv_heads, args.head_dim, args.trace))
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "cudnn": torch.backends.cudnn.version(),
                # the script as run from the checkout (no machine's absolute path)
                "argv": [os.path.relpath(sys.argv[0]), *sys.argv[1:]]}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "paired": paired},
                                             indent=1))


if __name__ == "__main__":
    main()
