"""Shared fixtures: Hydra compose, small in-process training runs, a torchrun launcher, and
`python -m` entry points and their ranks forked from a preloaded server
(tests/module_runs.py)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Bytecode: with PYTHONDONTWRITEBYTECODE set (some sandboxes and CI images set it) nothing of a
# fresh checkout is ever cached, and every interpreter of the run (each xdist worker's collection,
# each worker's forkserver, every entry point run as a new interpreter) compiles the project's
# and the tests' sources again: ~1 s each. Written once, the rest read them. Unset before the
# workers start (this file is the controlling process's too), inherited by all of them; this
# process writes from here on too (`sys.dont_write_bytecode` below).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# torch.cuda.is_available() (megatron calls it on import) initialises the CUDA driver unless it
# asks NVML; a process forked after that (the forkserver's workers below) cannot use CUDA at
# all, not even to check for stream capture in a CPU optimizer step. Inherited by the server.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# pytest-xdist workers share the cores: each takes its share of torch's threads (its own, and
# through OMP_NUM_THREADS its forkserver's, subprocesses' and torchrun's). Two workers of two
# threads each on two cores wait on each other's threads: small ops run many times slower.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(
        1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# torch, megatron (parallel.*) and the rest of the trainer are imported where they are used, not
# here: under pytest-xdist the controlling process loads this file too, and it runs no test, so
# ~7 s of imports there would only delay the workers' start (they import them as they collect).
import multiprocessing as mp  # what torch.multiprocessing re-exports: one forkserver either way

import psutil
import pytest

from tests.composition import compose_config  # the tests import it from here too
from trainer.config import register_configs

sys.dont_write_bytecode = False  # the test modules, imported after this file (see above)
register_configs()

REPO = Path(__file__).resolve().parents[1]

# A few seconds per run on 2 cores: tiny model, short sequences, the first 60 documents.
FAST = [
    "logger=none",
    "trainer.seq_length=64",
    "trainer.micro_batch_size=4",
    "trainer.global_batch_size=4",
    "trainer.warmup_steps=1",
    "trainer.eval_interval=0",
    "data.max_documents=60",
]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which turns `-n` into `--dist load`
def pytest_cmdline_main(config: pytest.Config) -> None:
    """`-n N` without `--dist`: pytest-xdist's `loadscope`, a test module at a time, in the order
    pytest_collection_modifyitems gives (`--dist` given on the command line stays as given).
    Under `load` a module's tests go to both workers, and a module-scoped fixture (a
    multi-process spawn, a trained checkpoint) is built by each; the README's commands wait for
    the earlier commands they need, running on the other worker. (`loadgroup` would group
    only those, but its grouping does not take with pytest 9.2.)"""
    if config.getoption("numprocesses", None) and config.option.dist == "no":
        config.option.dist = "loadscope"
        config.option.loadscopereorder = False  # the order below, not the largest module first


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with slow tests first (stable: each module's tests stay together, in their
    order): the last modules handed out are short ones, so both workers finish together
    instead of one running a 30 s test alone at the end."""
    slow = {item.nodeid.split("::")[0] for item in items
            if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The imports' and the collection's objects (~0.5 million) out of the garbage collector's
    scans from here on (`gc.freeze`): megatron's distributed optimizer calls `gc.collect()` in
    every save and load (~0.65 s each over them), and every full automatic collection walked them
    too. Objects the tests create are collected as before (tests/warm_server.py does the same
    for the forkserver's children)."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def run_training(tmp_path: Path) -> Callable[..., list[dict[str, Any]]]:
    """Train in this process; returns the metrics.jsonl rows."""
    from trainer.train import train

    def run(overrides: list[str], name: str = "run") -> list[dict[str, Any]]:
        run_dir = tmp_path / name
        run_dir.mkdir(exist_ok=True)
        cfg = compose_config(FAST + [f"checkpoint.dir={run_dir / 'checkpoints'}"] + overrides)
        train(cfg, run_dir)
        return read_metrics(run_dir)

    return run


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_cli(args: list[str], *, nproc: int = 1, cwd: Path, timeout: int = 600,
            env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """`python -m trainer ...`, or the same under `torch.distributed.run` with `nproc` ranks.
    `env` entries set to None are removed from the environment."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                     "--standalone"]
    cmd = launcher + ["-m", "trainer"] + args
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    output = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{output}"
    return proc


def assert_tp2_checkpoint_resumes_at_tp1_and_tp2(tmp_path: Path, common: list[str]) -> None:
    """`tp2/` holds a 6-step TP=2 run of `common` that saved at step 3: resuming that checkpoint
    at TP=2 reproduces steps 4-6 exactly, and at TP=1 (model and optimizer state resharded)
    within float tolerance."""
    tp2 = read_metrics(tmp_path / "tp2")
    ckpt = tmp_path / "tp2" / "checkpoints" / "iter_0000003"
    resume = common + [f"checkpoint.load={ckpt}", "checkpoint.save=false"]
    at_tp1 = train_on_ranks(resume, tmp_path / "at_tp1")
    at_tp2 = train_on_ranks(resume + ["parallel.tp=2"], tmp_path / "at_tp2", nproc=2)
    assert [r["step"] for r in at_tp1] == [4, 5, 6]
    assert [r["loss"] for r in at_tp2] == [r["loss"] for r in tp2[3:]]  # same TP: exact
    for a, b in zip(at_tp1, at_tp2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-4)


def refused_by_trainer_main(args: list[str], capsys: pytest.CaptureFixture,
                            monkeypatch: pytest.MonkeyPatch, cwd: Path,
                            env: dict[str, str] | None = None) -> tuple[int, str]:
    """What `python -m trainer ARGS` does with a setting it refuses before the process group
    (`trainer.__main__.main`: compose, then `check_early`), run in this process: its exit
    status and output. Whether the command line ends so as a new interpreter, under torchrun
    too, is tests/trainer/test_entry_errors.py's; this checks the setting's own refusal takes
    that path, without ~7 s of a new interpreter or the forkserver's start."""
    import trainer.__main__ as entry

    def not_refused(*_: Any) -> None:
        raise AssertionError(f"python -m trainer {' '.join(args)} passed its early checks")

    for name in ("HYDRA_FULL_ERROR", "LONGCTX_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["trainer", *args])
    monkeypatch.setattr(entry, "_agree_on_run_dir", not_refused)  # would wait for rank 1
    monkeypatch.setattr(entry, "run", not_refused)
    with pytest.raises(SystemExit) as exit_:
        entry.main()
    out = capsys.readouterr()
    return exit_.value.code, out.out + out.err


@pytest.fixture
def single_process():
    """megatron's parallel state for one CPU process (tp=1), torn down afterwards."""
    import torch

    from parallel.distributed import initialize_parallel, shutdown

    initialize_parallel(torch.device("cpu"), tp=1, seed=0)
    yield
    shutdown()


@contextlib.contextmanager
def own_session(cmd: list[str], cwd: Path, log: Path,
                env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """`cmd` in its own session, output to `log` (a file: nobody reads a pipe while it runs);
    whatever of its process group still runs when the block ends is SIGKILLed."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` still running (zombies, dead but not yet reaped, do not count)."""
    out = []
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable[..., None], world: int, port: int, tp: int | None,
            args: tuple) -> None:
    import torch

    from parallel.distributed import init_process_group, initialize_parallel, shutdown

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # few cores: one thread per process
    if tp is None:  # the caller forms megatron's groups (a Trainer forms its layout's)
        init_process_group(torch.device("cpu"))
    else:
        initialize_parallel(torch.device("cpu"), tp=tp, seed=0)
    try:
        fn(*args)
    finally:
        shutdown()


# Worker processes fork from a server process that imported torch, megatron, the trainer and the
# checkpoint tool once: a new interpreter per worker spends ~7 s of CPU on those imports, and a
# fork of the test process itself would inherit its gloo groups (megatron leaves them alive) and
# crash using them. tests/test_readme.py runs the README's `python -m` commands there too.
# tests/warm_server.py composes, once, the configs each child would compose again.
mp.set_forkserver_preload(["tests.conftest", "tests.module_runs", "trainer.train",
                           "trainer.eval", "trainer.generate", "ckpt.__main__",
                           *(f"ckpt.{command}" for command in (
                               "inspect", "verify", "reshape", "zarr_export", "hf_import",
                               "hf_export", "gguf")),  # the commands' modules, which
                           "tests.warm_server"])  # ckpt.__main__ imports when one runs


def start_forkserver() -> None:
    """Start this process's forkserver, if it is not running, in the repository's directory.
    Python 3.11's server ignores the sys.path it is handed and imports its preload modules with
    its working directory first on its path: started while a test has changed this process's
    directory (monkeypatch.chdir), it would leave out the `tests.*` modules, silently, and each
    child would import them (and compose its config) itself."""
    from multiprocessing import forkserver

    with contextlib.chdir(REPO):
        forkserver.ensure_running()


def spawn(fn: Callable[..., None], *args: Any, world: int, tp: int | None) -> None:
    """Run `fn(*args)` on `world` gloo processes at TP size `tp` (None: a process group only);
    a failure in any raises here."""
    import torch.multiprocessing

    start_forkserver()
    for attempt in range(3):
        try:
            torch.multiprocessing.start_processes(_worker, args=(fn, world, free_port(), tp, args),
                                                  nprocs=world, start_method="forkserver")
            return
        except torch.multiprocessing.ProcessRaisedException as err:
            # the free port was taken (another test's processes) before rank 0's store bound
            # it: no rank got past the rendezvous, so another port is a clean start
            if "EADDRINUSE" not in str(err) or attempt == 2:
                raise


def forked_workers(fn: Callable[..., None], args: tuple, nprocs: int,
                   start_method: str = "forkserver") -> None:
    """`parallel.lifetime.run_workers` with its ranks forked from the preloaded server (or,
    `start_method` fork, from this process) instead of spawned as new interpreters (~7 s of
    imports each): what `python -m ckpt reshape` and `import-hf` called in a test start
    (`_checkpoint_workers_forked`), or in a command `start_module` (tests/module_runs.py) runs with
    `fork_ckpt_workers`. Not `run_workers` itself: its workers check that their parent is the
    process that started them, and a forkserver's children have the server as their parent."""
    import torch.multiprocessing

    from parallel.lifetime import stop_processes

    if start_method == "forkserver":
        start_forkserver()
    context = torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=False,
                                                    start_method=start_method)
    try:
        while not context.join():
            pass
    except BaseException:
        stop_processes(context.processes)
        raise


@pytest.fixture(autouse=True, scope="session")
def _checkpoint_workers_forked() -> Iterator[None]:
    """In the test processes (not the forkserver's children, which run the real commands), the
    checkpoint tool's worker ranks are forks (`forked_workers`). Their start as spawned
    interpreters that die with their parent, and their stop on a signal, are tested through
    the command line: tests/ckpt/test_ckpt_signals.py."""
    import ckpt.hf_import
    import ckpt.reshape

    with pytest.MonkeyPatch.context() as patch:
        for module in (ckpt.reshape, ckpt.hf_import):
            patch.setattr(module, "run_workers", forked_workers)
        yield


@pytest.fixture(scope="session")
def two_step_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints root of a two-step FAST run, shared (read only) by the tests that need
    any trained checkpoint to get as far as they can."""
    from trainer.train import train

    run_dir = tmp_path_factory.mktemp("two_step_run")
    train(compose_config(FAST + ["trainer.max_steps=2", "trainer.save_interval=2",
                                 f"checkpoint.dir={run_dir / 'checkpoints'}"]), run_dir)
    return run_dir / "checkpoints"


def _hold_in_child(directories: list[str], ready: Any, as_run_dir: bool) -> None:
    """In a forked child: hold `directories` as a running job does, until killed."""
    if as_run_dir:
        from trainer.run_dir import hold
    else:
        from ckpt.lock import hold
    for path in directories:
        hold(Path(path))
    ready.set()
    time.sleep(600)


@contextlib.contextmanager
def held_elsewhere(*directories: Path, as_run_dir: bool = False) -> Iterator[mp.Process]:
    """Another process holding `directories` as a running job does (`ckpt.lock.hold`, or
    `trainer.run_dir.hold` with `as_run_dir`): a fork of this one, which takes file locks and
    sleeps, touching none of the parent's process groups; its locks are its own as a new
    interpreter's would be, without its seconds of imports. Yields the process (its pid)."""
    context = mp.get_context("fork")
    ready = context.Event()
    proc = context.Process(target=_hold_in_child,
                           args=([str(d) for d in directories], ready, as_run_dir))
    proc.start()
    try:
        assert ready.wait(120), "the holder did not take its locks"
        yield proc
    finally:
        proc.kill()
        proc.join()


def _train_rank(overrides: list[str], run_dir: str) -> None:
    from trainer.train import train

    train(compose_config(overrides), Path(run_dir))


def train_on_ranks(overrides: list[str], run_dir: Path, nproc: int = 1) -> list[dict[str, Any]]:
    """What `torchrun --nproc-per-node nproc -m trainer <overrides>` trains on the CPU, in
    `run_dir`, without the launcher and the imports of a new interpreter per rank
    (tests/trainer/test_cli.py and test_entry_errors.py run the real command line): one rank
    trains in this process, more in forked gloo processes. On the CPU on every machine: forked
    workers cannot use CUDA, and runs compared across world sizes must share a device.
    Checkpoints go to run_dir/checkpoints; returns the metrics rows."""
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = overrides + [f"checkpoint.dir={run_dir / 'checkpoints'}", "trainer.device=cpu"]
    if nproc == 1:
        _train_rank(overrides, str(run_dir))
    else:
        spawn(_train_rank, overrides, str(run_dir), world=nproc, tp=None)
    return read_metrics(run_dir)
