"""`parallel.cp_overlap`: context parallelism with its exchange waited for before the compute
(serialised) gives the results of the overlapped exchange bit for bit, and really does wait.

Both orders run the same operations in the same order (models/attention/context_parallel.py),
so the checks are exact: the CP attention functions' outputs and dq, dk, dv (standard causal,
chunked with local and direct exchange, DCA; CP=2 and CP=4), the GPT model's loss and every
parameter's gradient, and the losses of a short training run through the trainer's settings.
The order of events (exchange posted, waited for, kernel computed) is recorded to show that the
setting changes the schedule: serialised, every post is waited for before anything else runs;
overlapped, kernels run while an exchange is in flight. One 4-process gloo spawn runs it all.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from omegaconf import OmegaConf

from models.attention import context_parallel
from models.attention.core import CoreAttention
from models.schema import ParallelConfig
from parallel.distributed import shutdown
from parallel.placement import Layout
from tests.conftest import compose_config, read_metrics, spawn
from tests.models.test_context_parallel import (
    FUNCTIONS,
    KINDS,
    WORLD,
    backward_one_batch,
    cp_inputs,
    cp_slice,
    fresh_groups,
    train_overrides,
)
from trainer.resume import check_settings
from trainer.train import train

pytestmark = pytest.mark.timeout(600)  # a p2p mismatch would hang, not fail
SIZES = (2, 4)
TRAINED = "dca"  # the kind trained through the trainer's settings, both ways


@contextlib.contextmanager
def recorded_events() -> Iterator[list[str]]:
    """The CP exchange's events in order: "post" (a batch of sends and receives), "wait" (for
    a non-empty batch) and "compute" (one kernel call, forward or backward)."""
    events: list[str] = []
    real = {name: getattr(context_parallel, name)
            for name in ("_p2p", "_wait", "attention_forward", "attention_backward")}

    def p2p(*args: Any, **kwargs: Any) -> list:
        works = real["_p2p"](*args, **kwargs)
        if works:
            events.append("post")
        return works

    def wait(works: list) -> None:
        if works:
            events.append("wait")
        real["_wait"](works)

    def kernel(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            events.append("compute")
            return real[name](*args, **kwargs)
        return call

    patched = {"_p2p": p2p, "_wait": wait, "attention_forward": kernel("attention_forward"),
               "attention_backward": kernel("attention_backward")}
    for name, fn in patched.items():
        setattr(context_parallel, name, fn)
    try:
        yield events
    finally:
        for name, fn in real.items():
            setattr(context_parallel, name, fn)


def schedule(events: list[str]) -> dict[str, bool]:
    """Whether every post is waited for at once, and whether a kernel ran while one was open."""
    at_once = all(b == "wait" for a, b in zip(events, events[1:]) if a == "post")
    open_posts, computed_while_open = 0, False
    for event in events:
        if event == "post":
            open_posts += 1
        elif event == "wait":
            open_posts = max(0, open_posts - 1)
        elif open_posts:
            computed_while_open = True
    return {"posts": events.count("post"), "waited_at_once": at_once,
            "computed_while_open": computed_while_open}


def check_functions(n: int) -> dict[str, dict[str, Any]]:
    """Per function at CP=n: the largest |serialised - overlapped| of out, dq, dk, dv, whether
    they are all equal, and the schedule of each order."""
    q, k, v, do = cp_inputs()
    group = parallel_state.get_context_parallel_group()
    r = dist.get_rank(group)
    found: dict[str, dict[str, Any]] = {}
    for name, (_, cp_fn) in FUNCTIONS.items():
        results, schedules = {}, {}
        for overlap in (True, False):
            local = [cp_slice(x, n, r).clone().requires_grad_() for x in (q, k, v)]
            with recorded_events() as events:
                out = cp_fn(*local, group=group, overlap=overlap)
                out.backward(cp_slice(do, n, r))
            results[overlap] = [out.detach(), *(x.grad for x in local)]
            schedules[overlap] = schedule(events)
        pairs = list(zip(results[True], results[False]))
        found[f"{name} cp={n}"] = {
            "equal": all(torch.equal(a, b) for a, b in pairs),
            "error": max((a - b).abs().max().item() for a, b in pairs),
            "overlapped": schedules[True], "serialised": schedules[False]}
    return found


def model_loss_and_grads(kind: str, overlap: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    """Loss and parameter gradients of one fixed batch at CP=2 (this rank's share), and the
    cp_overlap of every core attention the model built."""
    loss, model = backward_one_batch(kind, ParallelConfig(cp=2, cp_overlap=overlap))
    cores = {m.cp_overlap for m in model.modules() if isinstance(m, CoreAttention)}
    return loss, {"grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                  "cores": cores}


def _all_checks(root: str) -> None:
    """One rank of the spawn: findings to rank<r>.pt, the training runs' metrics (rank 0) to
    runs/<overlap|serialised>."""
    shutdown()  # the spawn's own group: each check below brings its own
    found: dict[str, Any] = {"functions": {}, "model": {}}
    for n in SIZES:
        with fresh_groups(root, f"functions{n}", cp=n):
            found["functions"].update(check_functions(n))
    with fresh_groups(root, "model", cp=2):
        for kind in KINDS:
            (loss_a, a), (loss_b, b) = (model_loss_and_grads(kind, o) for o in (True, False))
            found["model"][kind] = {
                "loss_equal": torch.equal(loss_a, loss_b),
                "grads_equal": all(torch.equal(g, b["grads"][n]) for n, g in a["grads"].items()),
                "cores": (a["cores"], b["cores"])}
    for name, overlap in (("overlap", "true"), ("serialised", "false")):
        run_dir = Path(root) / "runs" / name
        run_dir.mkdir(parents=True, exist_ok=True)
        with fresh_groups(root, f"train-{name}", tp=None), recorded_events() as events:
            train(compose_config(train_overrides(TRAINED, 1, 2)
                                 + [f"parallel.cp_overlap={overlap}"]), run_dir)
        found[f"train {name}"] = schedule(events)
    torch.save(found, Path(root) / f"rank{os.environ['RANK']}.pt")


@pytest.fixture(scope="module")
def overlap_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("cp_overlap")
    spawn(_all_checks, str(root), world=WORLD, tp=1)
    return [torch.load(root / f"rank{r}.pt") for r in range(WORLD)], root


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"{f} cp={n}" for n in SIZES for f in FUNCTIONS])
def test_serialised_cp_attention_equals_overlapped(overlap_results, name: str) -> None:
    for rank in overlap_results[0]:
        found = rank["functions"][name]
        assert found["equal"], (name, found["error"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"{f} cp={n}" for n in SIZES for f in FUNCTIONS])
def test_serialised_cp_waits_for_each_exchange_before_computing(overlap_results,
                                                                name: str) -> None:
    """Serialised: no kernel runs while an exchange is open. Overlapped: the ring (standard,
    DCA) and the direct forward (chunks straddling pieces) compute while one is."""
    for rank in overlap_results[0]:
        found = rank["functions"][name]
        assert found["serialised"]["posts"] == found["overlapped"]["posts"]
        assert found["serialised"]["waited_at_once"]
        assert not found["serialised"]["computed_while_open"]
        if found["overlapped"]["posts"]:  # chunks inside pieces (C=6): nothing to exchange
            assert found["overlapped"]["computed_while_open"], name


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_cp_overlap_setting_reaches_every_core_and_changes_no_result(overlap_results,
                                                                     kind: str) -> None:
    for rank in overlap_results[0]:
        found = rank["model"][kind]
        assert found["cores"] == ({True}, {False})
        assert found["loss_equal"] and found["grads_equal"], (kind, found)


@pytest.mark.slow
def test_training_with_serialised_cp_has_the_same_losses(overlap_results) -> None:
    """`parallel.cp_overlap=false` on the command line reaches the trainer's model: its
    exchanges are waited for at once, the default's are not; the losses are the same."""
    for rank in overlap_results[0]:
        serialised, overlapped = rank["train serialised"], rank["train overlap"]
        assert serialised["posts"] == overlapped["posts"] > 0
        assert serialised["waited_at_once"] and not serialised["computed_while_open"]
        assert overlapped["computed_while_open"]
    runs = overlap_results[1] / "runs"
    overlapped, serialised = read_metrics(runs / "overlap"), read_metrics(runs / "serialised")
    assert len(overlapped) == len(serialised) > 1
    for a, b in zip(overlapped, serialised):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])


def test_cp_overlap_is_a_run_setting_not_the_models() -> None:
    """A checkpoint's record of the model and its layout leaves it out, and a resume that
    changes it is neither refused nor warned about."""
    assert "cp_overlap" not in Layout.__dataclass_fields__
    saved = compose_config(["parallel.cp=2"])
    changed = compose_config(["parallel.cp=2", "parallel.cp_overlap=false"])
    assert OmegaConf.select(changed, "parallel.cp_overlap") is False
    assert check_settings(saved, changed, 0, "ckpt") == []
