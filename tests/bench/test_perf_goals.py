"""bench/perf_goals.py: the single-GPU targets read off bench.attention and bench/train.py rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import attention, perf_goals

ROOT = Path(__file__).resolve().parents[2]


def _attention_row(variant: str, seq: int, kv: int, ms: float, mib: float) -> dict:
    return {"variant": variant, "seq": seq, "heads": 16, "kv_heads": kv, "fwd_ms": ms / 3,
            "fwd_bwd_ms": ms, "peak_mib": mib}


ROWS = [
    _attention_row("sdpa_cudnn", 32768, 4, 27.0, 1000.0),
    _attention_row("dca(C=8192,w=1024)", 32768, 4, 27.5, 1250.0),  # 0.982x, 1.25x: both hold
    _attention_row("chunked(C=8192)", 32768, 4, 7.0, 800.0),  # not DCA: no goal
    _attention_row("sdpa_cudnn", 8192, 16, 2.0, 190.0),
    _attention_row("dca(C=2048,w=256)", 8192, 16, 4.0, 550.0),  # 0.5x: fails; no memory goal
    _attention_row("sdpa_cudnn", 131072, 16, 400.0, 3000.0),
    {"variant": "dca(C=8192,w=1024)", "seq": 131072, "heads": 16, "kv_heads": 16,
     "error": "CUDA out of memory"},
]


def test_attention_goals() -> None:
    checks = {c["goal"]: c for c in perf_goals.attention_goals(ROWS)}
    assert sorted(checks) == sorted([
        "dca(C=8192,w=1024) 32768 16/4 speed vs cuDNN",
        "dca(C=8192,w=1024) 32768 16/4 peak memory vs cuDNN",
        "dca(C=2048,w=256) 8192 16/16 speed vs cuDNN",
        "dca(C=8192,w=1024) 131072 16/16 speed vs cuDNN"])
    speed = checks["dca(C=8192,w=1024) 32768 16/4 speed vs cuDNN"]
    assert abs(speed["value"] - 27.0 / 27.5) < 1e-12 and speed["holds"]
    assert checks["dca(C=8192,w=1024) 32768 16/4 peak memory vs cuDNN"]["holds"]
    assert not checks["dca(C=2048,w=256) 8192 16/16 speed vs cuDNN"]["holds"]
    failed = checks["dca(C=8192,w=1024) 131072 16/16 speed vs cuDNN"]
    assert failed["value"] is None and not failed["holds"]


def test_train_goals_and_the_command_line(tmp_path: Path) -> None:
    train = {"results": [
        {"model": "gpt_1p3b", "attention": "standard", "seq": 32768, "variant": "-",
         "mfu": 0.497, "gpu_power": {"sm_clock_mhz": 1620.0, "power_w": 694.2,
                                     "power_capped": 0.96}},
        {"model": "gpt_1p3b", "attention": "dca", "seq": 131072, "variant": "-", "mfu": 0.481},
        {"model": "gpt_350m", "attention": "dca", "seq": 32768, "variant": "-", "mfu": 0.3}]}
    checks = perf_goals.train_goals(train["results"])
    assert [(c["goal"], c["holds"]) for c in checks] == [
        ("gpt_1p3b standard 32768 - MFU", False), ("gpt_1p3b dca 131072 - MFU", True)]
    (tmp_path / "a.json").write_text(json.dumps({"meta": {}, "rows": ROWS}))
    (tmp_path / "t.json").write_text(json.dumps(train))
    out = subprocess.run([sys.executable, "bench/perf_goals.py", "--attention",
                          str(tmp_path / "a.json"), "--train", str(tmp_path / "t.json"),
                          "--out", str(tmp_path / "goals.json")],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "| dca(C=2048,w=256) 8192 16/16 speed vs cuDNN | 0.500 | >= 0.9 | NO |" in out
    assert "| dca(C=8192,w=1024) 131072 16/16 speed vs cuDNN | failed to run |" in out
    assert ("| gpt_1p3b standard 32768 - MFU | 0.497 (1,620 MHz, 694 W (capped 96%)) | >= 0.5 "
            "| NO |") in out
    assert "3 of 6 goals hold." in out
    assert len(json.loads((tmp_path / "goals.json").read_text())) == 6


def test_back_to_back_rows_are_checked_against_cudnn_timed_alike(tmp_path: Path) -> None:
    """A --back-to-back file's DCA rows are compared with its own cuDNN rows, under their own
    label; both files go on one command line."""
    queued = [dict(_attention_row("sdpa_cudnn", 8192, 16, 1.8, 190.0), back_to_back=20),
              dict(_attention_row("dca(C=2048,w=256)", 8192, 16, 1.9, 550.0), back_to_back=20)]
    checks = {c["goal"]: c for c in perf_goals.attention_goals(ROWS + queued)}
    b2b = checks["dca(C=2048,w=256) 8192 16/16 back to back (x20) speed vs cuDNN"]
    assert abs(b2b["value"] - 1.8 / 1.9) < 1e-12 and b2b["holds"]
    synced = checks["dca(C=2048,w=256) 8192 16/16 speed vs cuDNN"]
    assert synced["value"] == 0.5  # against the synced cuDNN row (2.0 ms), not the queued one
    (tmp_path / "a.json").write_text(json.dumps({"meta": {}, "rows": ROWS}))
    (tmp_path / "b.json").write_text(json.dumps({"meta": {}, "rows": queued}))
    out = subprocess.run([sys.executable, "bench/perf_goals.py", "--attention",
                          str(tmp_path / "a.json"), str(tmp_path / "b.json")],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "| dca(C=2048,w=256) 8192 16/16 back to back (x20) speed vs cuDNN | 0.947 |" in out
    assert "3 of 5 goals hold." in out


def test_rows_with_an_incomplete_peak_get_a_speed_goal_only() -> None:
    """A graphed DCA row's peak leaves out the graphs' pools: no memory goal is judged on it."""
    rows = [_attention_row("sdpa_cudnn", 32768, 4, 27.0, 1000.0),
            {**_attention_row("dca_graphs(C=2048,w=256)", 32768, 4, 30.0, 400.0),
             "peak_complete": False}]
    checks = perf_goals.attention_goals(rows)
    assert [c["goal"] for c in checks] == ["dca_graphs(C=2048,w=256) 32768 16/4 speed vs cuDNN"]
    # bench.attention marks the graphed variants so, and no other
    assert not attention.dca(2048, 256, "dca_graphs", cuda_graphs=True).peak_complete
    assert attention.dca(2048, 256).peak_complete
    assert abs(checks[0]["value"] - 0.9) < 1e-12 and not checks[0]["holds"]
