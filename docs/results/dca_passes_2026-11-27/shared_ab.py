"""The successive part's rows shared with the inter part's copy (grouped.successive_rows), on
and off, against FA4 causal, in one process: each sample times FA4 causal, DCA with the rows
shared and DCA without (successive_rows patched to L, the previous behaviour) back to back,
so the three meet the same clocks; medians of the per-sample ratios, and each one's peak
memory above its inputs. bf16, B=1, 16 query heads of 128, C=8192, w=1024, dca_backward=auto.

    python3 docs/results/dca_passes_2026-11-27/shared_ab.py [repeats]
"""
import statistics
import sys

import torch

from bench import attention as ba
from models.attention import kernels
from models.attention.dca import grouped


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    fa4, dca = ba.fa4(), ba.dca(8192, 1024, kernel="fa4")
    shared_rows = grouped.successive_rows

    def unshared_rows(plan):  # noqa: ANN001, ANN202
        return plan.length

    for seq in (32768, 131072):
        for kv in (16, 4):
            problem = ba.inputs(seq, 16, kv, 128)
            base, run = ba.fwd_bwd_step(fa4, problem), ba.fwd_bwd_step(dca, problem)

            def with_rows(rows):  # noqa: ANN001, ANN202
                def step():  # noqa: ANN202
                    grouped.successive_rows = rows
                    return run()
                return step
            steps = {"fa4": base, "shared": with_rows(shared_rows),
                     "unshared": with_rows(unshared_rows)}
            samples: dict[str, list[float]] = {name: [] for name in steps}
            peaks = {}
            with kernels.using("fa4"):
                for fn in steps.values():
                    ba.time_ms(fn, 3, 0)
                for _ in range(repeats):
                    for name, fn in steps.items():
                        samples[name].append(ba.time_ms(fn, 0, 1)[0])
                for name, fn in steps.items():
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    fn()
                    torch.cuda.synchronize()
                    peaks[name] = (torch.cuda.max_memory_allocated() - before) / 2**20
            grouped.successive_rows = shared_rows

            def ratio(a: str, b: str) -> float:
                return statistics.median(x / y for x, y in zip(samples[a], samples[b]))
            medians = {name: statistics.median(t) for name, t in samples.items()}
            print(f"{seq} 16/{kv}: median ms fa4 {medians['fa4']:.2f} shared "
                  f"{medians['shared']:.2f} unshared {medians['unshared']:.2f} | fa4/shared "
                  f"{ratio('fa4', 'shared'):.3f}x fa4/unshared {ratio('fa4', 'unshared'):.3f}x "
                  f"unshared/shared {ratio('unshared', 'shared'):.3f}x | peak vs fa4: shared "
                  f"{peaks['shared'] / peaks['fa4']:.2f}x unshared "
                  f"{peaks['unshared'] / peaks['fa4']:.2f}x", flush=True)
            del problem, base, run, steps


if __name__ == "__main__":
    main()
