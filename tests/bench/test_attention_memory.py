"""bench/attention_memory.py's replay of allocator events (the GPU part runs on the device)."""

from __future__ import annotations

from bench.attention_memory import REPO, peak_breakdown


def _frame(name: str, line: int) -> dict:
    return {"filename": f"{REPO}/models/attention/dca/attention.py", "line": line, "name": name}


def test_peak_breakdown_replays_to_the_peak_and_groups_by_site() -> None:
    outside = {"filename": "/usr/lib/torch/x.py", "line": 1, "name": "f"}
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [outside, _frame("rotate", 10)]},
        {"action": "alloc", "addr": 2, "size": 50, "frames": [_frame("call", 20)]},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 70, "frames": [_frame("call", 20)]},
        {"action": "free_requested", "addr": 99, "size": 500},  # allocated before recording
        {"action": "alloc", "addr": 4, "size": 20, "frames": []},
    ]
    peak, sites = peak_breakdown(trace)
    assert peak == 150  # 100 + 50 before the free; later 50 + 70 + 20 = 140
    assert sites == {"models/attention/dca/attention.py:10 rotate": 100,
                     "models/attention/dca/attention.py:20 call": 50}
