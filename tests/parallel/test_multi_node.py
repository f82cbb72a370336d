"""A two-node launch as docs/parallel.md gives it, on one host: two torchrun agents, one rank
each, meet at a c10d rendezvous endpoint and train a tiny model on the CPU (gloo) at DP=2 and
at TP=2, saving checkpoints; the step-2 checkpoint resumes on one node as one process and as two
ranks, continuing with the two-node run's steps and losses.

Each agent and its rank is a new interpreter (~7 s of imports each on 2 cores), so this is slow.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from ckpt.reader import Checkpoint
from tests.conftest import FAST, free_port, own_session, read_metrics, train_on_ranks

pytestmark = pytest.mark.slow

COMMON = FAST + ["trainer.max_steps=4", "trainer.save_interval=2", "trainer.global_batch_size=8",
                 "trainer.device=cpu"]
LAYOUTS = {"dp2": ([], {"dp": 2, "tp": 1}), "tp2": (["parallel.tp=2"], {"dp": 1, "tp": 2})}


def _two_nodes(tmp_path: Path, args: list[str]) -> None:
    """`torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d ...` twice, as on two hosts
    (each in its own session, killed if it outlives the test)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"localhost:{free_port()}", "--rdzv-id", f"longctx-test-{os.getpid()}",
               "-m", "trainer", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    with own_session(command, tmp_path, logs[0], env) as node0, \
            own_session(command, tmp_path, logs[1], env) as node1:
        deadline = time.monotonic() + 600
        try:
            # until both end, one fails (the other would wait for it at the next collective) or
            # time is up
            while time.monotonic() < deadline and any(n.poll() is None for n in (node0, node1)) \
                    and not any(n.poll() for n in (node0, node1)):
                time.sleep(0.5)
            codes = [node0.poll(), node1.poll()]
        finally:  # torchrun setsid()s its rank into its own session, which own_session misses
            for node in (node0, node1):
                with contextlib.suppress(psutil.NoSuchProcess):
                    for child in psutil.Process(node.pid).children(recursive=True):
                        child.kill()
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)


@pytest.mark.parametrize("layout", [
    "dp2", pytest.param("tp2", marks=pytest.mark.skipif(
        not os.environ.get("LONGCTX_MULTI_NODE_TP"),
        reason="the same path at TP=2, 36 s: set LONGCTX_MULTI_NODE_TP=1 to run"))])
def test_a_two_node_run_resumes_on_one_node(tmp_path: Path, layout: str) -> None:
    overrides, sizes = LAYOUTS[layout]
    _two_nodes(tmp_path, COMMON + overrides + ["hydra.run.dir=two_nodes"])
    two_nodes = read_metrics(tmp_path / "two_nodes")
    assert [r["step"] for r in two_nodes] == [1, 2, 3, 4]
    saved = Checkpoint(tmp_path / "two_nodes" / "checkpoints" / "iter_0000002")
    assert {k: getattr(saved.meta.layout, k) for k in sizes} == sizes  # one world of 2 ranks

    # on one node, what `python -m trainer` and `torchrun --nproc-per-node 2` train, without
    # their new interpreters (tests/conftest.py's `train_on_ranks`)
    resume = COMMON + [f"checkpoint.load={saved.path}", "checkpoint.save=false"]
    at_one = train_on_ranks(resume, tmp_path / "one")
    at_two = train_on_ranks(resume + overrides, tmp_path / "two", nproc=2)
    assert [r["step"] for r in at_one] == [r["step"] for r in at_two] == [3, 4]
    for a, b, c in zip(at_one, at_two, two_nodes[2:], strict=True):
        assert math.isfinite(a["loss"])
        assert b["loss"] == pytest.approx(c["loss"], rel=1e-5, abs=1e-5)  # the same layout
        assert a["loss"] == pytest.approx(c["loss"], rel=1e-4, abs=1e-4)
