"""bench/trace_ops.py on a hand-made trace: kernels charged to the innermost operator with their
correlation id, summed per (kernel, operator, shapes); gzipped traces read alike."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from bench.trace_ops import by_operator, load


def _trace() -> dict:
    def op(name: str, ext: int, dur: float, dims: list) -> dict:
        return {"cat": "cpu_op", "name": name, "dur": dur, "args": {"External id": ext,
                                                                    "Input Dims": dims}}

    def kernel(name: str, ext: int, dur: float) -> dict:
        return {"cat": "kernel", "name": name, "dur": dur, "args": {"External id": ext}}

    return {"traceEvents": [
        op("aten::reshape", 1, 50.0, [[8, 4]]), op("aten::copy_", 1, 20.0, [[8, 4], [8, 4]]),
        kernel("copy_kernel", 1, 300.0), kernel("copy_kernel", 1, 100.0),
        op("aten::mm", 2, 10.0, [[8, 4], [4, 8]]), kernel("gemm", 2, 1000.0),
        kernel("orphan", 3, 5.0), {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 1.0,
                                   "args": {}},
    ]}


def test_kernels_are_charged_to_their_innermost_operator(tmp_path: Path) -> None:
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    rows = by_operator(load(path))
    assert rows == [("gemm", "aten::mm", "[[8, 4], [4, 8]]", 1.0, 1),
                    ("copy_kernel", "aten::copy_", "[[8, 4], [8, 4]]", 0.4, 2),
                    ("orphan", "?", "", 0.005, 1)]
