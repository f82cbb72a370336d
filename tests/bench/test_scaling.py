"""bench/scaling.sh and bench/scaling.py: the two-GPU scaling table's plan and time budget, and the
whole table end to end at toy size on the CPU (gloo), every case a row or a recorded refusal, DP
and CP starting from the 1-process run's loss."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import scaling

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"layout", "label", "gpus", "attention", "seq", "status", "reason", "tokens_per_s",
            "speedup", "mfu", "tflops_per_gpu", "step_s", "peak_mem_gb", "losses", "loss_check",
            "estimated_s", "overrides", "case_file"}


def _planned(cases: list[scaling.Case]) -> list[scaling.Case]:
    return [c for c in cases if c.status == "planned"]


def test_the_default_plan_fits_the_budget_with_every_dca_layout_at_16k_and_32k() -> None:
    cases = scaling.plan([16384, 32768], ["dca", "standard"], list(scaling.LAYOUTS), [], [],
                         scaling.DEFAULT_BUDGET_S)
    planned = _planned(cases)
    assert sum(c.estimated_s for c in planned) <= scaling.DEFAULT_BUDGET_S
    assert {(c.layout, c.seq) for c in planned} == {
        (layout, seq) for layout in scaling.LAYOUTS for seq in (16384, 32768)}
    assert all(c.attention == "dca" for c in planned)
    for c in cases:  # standard attention comes after: past the budget, and says so
        assert c.status == "planned" or c.reason and "budget" in c.reason
    cp2 = next(c for c in planned if (c.layout, c.seq) == ("cp2_serial", 16384))
    assert cp2.overrides == ["trainer.global_batch_size=2", "parallel.cp=2",
                             "parallel.cp_overlap=false"]
    assert [c.steps for c in planned] == [scaling.STEPS] * len(planned)


def test_long_sequences_train_one_sequence_with_full_recompute_without_dp_and_pp() -> None:
    cases = scaling.plan([131072], ["dca"], list(scaling.LAYOUTS), ["trainer.fused_norm=true"],
                         [["tp2sp", "trainer.fused_norm=false"]], 0)
    by = {c.layout: c for c in cases}
    for layout in ("dp2", "pp2"):
        assert by[layout].status == "skipped" and "2 sequences per step" in by[layout].reason
    for layout in ("1gpu", "cp2", "cp2_serial", "tp2sp"):
        assert by[layout].status == "planned"
        assert {"trainer.global_batch_size=1", "trainer.recompute=full"} <= set(
            by[layout].overrides)
        assert (by[layout].steps, by[layout].warmup) == (scaling.LONG_STEPS, scaling.LONG_WARMUP)
    assert by["1gpu"].overrides[-1] == "trainer.fused_norm=true"
    assert "trainer.fused_norm=false" in by["tp2sp"].overrides  # --set-for wins


def test_a_worker_exception_is_the_recorded_refusal() -> None:
    log = "\n".join([
        "[rank0]: Traceback (most recent call last):",
        "[rank0]: trainer.errors.UserError: the number of processes (2) must be a multiple of 3",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "  error_file: <N/A>"])
    assert scaling.error_of(log) == (
        "UserError: the number of processes (2) must be a multiple of 3")
    assert scaling.error_of("torch.OutOfMemoryError: CUDA out of memory.").startswith("OOM: ")
    assert scaling.error_of("error: parallel.tp=3 does not divide the heads") == (
        "error: parallel.tp=3 does not divide the heads")
    assert scaling.error_of("") == "no result; see the case's log"


def test_the_profile_summary_gives_each_rank_s_idle_time(tmp_path: Path) -> None:
    for rank, busy in ((0, 600.0), (1, 450.0)):
        (tmp_path / f"gpt_1p3b_dca_16384_rank{rank}.summary.json").write_text(json.dumps({
            "rank": rank, "wall_ms": 1000.0, "gpu_busy_ms": busy,
            "categories": {"NCCL": 300.0}, "top_kernels": [["ncclDevKernel_SendRecv", 300.0, 48]],
            "timeline": "GPU: 900 kernels"}))
    text = scaling.profile_text(tmp_path, 800.0)
    assert "rank 0: profiled step 1000.0 ms, GPU busy 600.0 ms, idle 400.0 ms (40%); against " \
           "the unprofiled median step 800.0 ms: idle 200.0 ms" in text
    assert "rank 1: profiled step 1000.0 ms, GPU busy 450.0 ms, idle 550.0 ms" in text
    assert "ncclDevKernel_SendRecv" in text
    assert "nothing profiled" in scaling.profile_text(tmp_path / "none", None)


def test_bad_lengths_are_one_error_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "bench/scaling.py", "--out", str(tmp_path),
                           "--seqs", "16384", "130"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: --seqs [16384, 130]: lengths must be positive multiples of 4 (CP=2 cuts a "
        "sequence into 4 pieces)"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.environ.get("LONGCTX_SCALING_TOY"),
                    reason="torchrun per case, 0.6-3.5 minutes: set LONGCTX_SCALING_TOY=1 to run")
@pytest.mark.parametrize("attentions", [("standard",), ("dca", "standard")],
                         ids=["standard", "every layout"])
def test_the_toy_table_on_the_cpu_end_to_end(tmp_path: Path, attentions: tuple[str, ...]) -> None:
    """The layouts of `attentions` at a toy size, one torchrun per 2-process case; one case
    refused on purpose (CP=3 on two processes) to show a refusal becomes its row: standard
    attention's three cases, or every layout (DCA's six too). On request: the rows' logic is
    what the tests above check in CI."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "MODEL": "tiny", "SEQS": "128", "BUDGET": "0",
           "DEADLINE": "0", "EXTRA": "trainer.device=cpu", "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1", "ATTENTION": " ".join(attentions)}
    done = subprocess.run(["bash", "bench/scaling.sh", "--set-for", "cp2_serial:standard",
                           "parallel.cp=3"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=850)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "scaling.json").read_text())
    assert results["schema"] == scaling.SCHEMA
    datetime.datetime.fromisoformat(results["date"])
    assert {"gpu", "torch", "megatron_core", "git_commit"} <= set(results["environment"])
    assert results["environment"]["gpu"] == "cpu"
    rows = {(r["layout"], r["attention"]): r for r in results["rows"]}
    expected = {(layout, attention) for attention in attentions
                for layout in scaling.ATTENTION_LAYOUTS[attention]}
    assert set(rows) == expected and len(results["rows"]) == len(expected)
    for key, row in rows.items():
        assert ROW_KEYS <= set(row), key
        if key == ("cp2_serial", "standard"):
            assert row["status"] == "error" and "parallel.cp" in row["reason"], row
            continue
        assert row["status"] == "ok", row
        assert row["tokens_per_s"] > 0 and row["peak_mem_gb"] > 0 and len(row["losses"]) == 4
        assert (out / row["case_file"]).exists()
        if row["layout"] != "1gpu":
            assert row["speedup"] == pytest.approx(
                row["tokens_per_s"] / rows["1gpu", row["attention"]]["tokens_per_s"])
    compared = [key for key in (("dp2", "dca"), ("cp2", "dca"), ("cp2_serial", "dca"),
                                ("cp2", "standard")) if key in rows]
    for layout, attention in compared:
        check = rows[layout, attention]["loss_check"]
        assert check["compared"] and check["equal"], (layout, attention, check)
        assert rows[layout, attention]["losses"][0] == pytest.approx(
            rows["1gpu", attention]["losses"][0], rel=1e-5)
    for layout in ("tp2sp", "pp2") if "dca" in attentions else ():
        check = rows[layout, "dca"]["loss_check"]
        assert not check["compared"] and "seeds" in check["reason"]
    n = len(compared)
    assert results["loss_check"]["compared"] == n and results["loss_check"]["equal"]
    table = (out / "scaling.md").read_text()
    assert table.count("\n| 128 |") == len(expected) and f"{n} compared, all equal" in table
    assert (out / "scaling.png").stat().st_size > 10_000
