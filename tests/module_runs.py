"""The project's `python -m` entry points run as children of the tests' preloaded forkserver
(tests/conftest.py): `start_module`, `run_module` and, as torchrun starts them, `run_module_ranks`.
A new interpreter spends ~7 s of CPU importing torch, megatron and the trainer; a child of the
server has them already."""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
import warnings
from multiprocessing import connection as mp_connection
from pathlib import Path

from tests.conftest import forked_workers, free_port, start_forkserver


def _module_child(args: list[str], cwd: str, env: dict[str, str], out: str, err: str,
                  threads: int | None, new_session: bool, file_size_limit: int | None,
                  fork_ckpt_workers: bool = False, ctrl_c: bool = False) -> None:
    """In a forkserver child: what `python -m args[0] args[1:]` does (the module as `__main__`,
    argv, working directory, environment, exit status, atexit handlers), stdout to `out` and
    stderr to `err`; `threads`: torch's threads, as torchrun's OMP_NUM_THREADS=1 sets them;
    `new_session`: as `subprocess.Popen(start_new_session=True)`; `file_size_limit`: bytes, as
    `ulimit -f` (a write past it fails with EFBIG: Python ignores SIGXFSZ);
    `fork_ckpt_workers`: the checkpoint tool's worker ranks forked from this child (fresh from
    the server: no process groups to inherit) instead of spawned as new interpreters;
    `ctrl_c`: SIGINT taken as an interpreter in a terminal's foreground takes it (Python's
    KeyboardInterrupt handler), also where the tests themselves run as a background job, whose
    processes inherit SIGINT ignored (which the trainer keeps ignored, as it should)."""
    if ctrl_c:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if fork_ckpt_workers:
        import functools

        import ckpt.hf_import
        import ckpt.reshape

        for module in (ckpt.reshape, ckpt.hf_import):
            module.run_workers = functools.partial(forked_workers, start_method="fork")
    if new_session:
        os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if threads:
        import torch

        torch.set_num_threads(threads)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    if file_size_limit is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    sys.argv = list(args)  # run_module makes argv[0] the module's file, as under -m
    # runpy's note that the server preloaded the module: the harness's doing, not the command's
    warnings.filterwarnings("ignore", r".* found in sys.modules after import of package",
                            RuntimeWarning)
    code: int | str | None = 0
    try:
        if args[0].endswith(".py"):  # `python SCRIPT`: its directory first on sys.path
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
        else:
            runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


class ModuleRun:
    """`python -m MODULE ARGS` running in a child of the preloaded forkserver (`start_module`),
    with what the tests use of `subprocess.Popen`: pid, poll, wait, send_signal, kill,
    communicate (stdout and stderr as text), returncode (-N: killed by signal N)."""

    def __init__(self, module: str, args: list[str], cwd: Path, env: dict[str, str],
                 logs: Path, threads: int | None = None, new_session: bool = False,
                 file_size_limit: int | None = None, fork_ckpt_workers: bool = False,
                 ctrl_c: bool = False) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.out, self.err = logs / "stdout", logs / "stderr"
        start_forkserver()
        self.process = mp.get_context("forkserver").Process(
            target=_module_child, args=([module, *args], str(cwd), env, str(self.out),
                                        str(self.err), threads, new_session,
                                        file_size_limit, fork_ckpt_workers, ctrl_c))
        self.process.start()
        self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.process.name, timeout)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        return tuple(p.read_text() if p.exists() else "" for p in (self.out, self.err))

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.output()


_runs = iter(range(1 << 30))


def _module_env(env: dict[str, str | None] | None) -> dict[str, str]:
    full = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return {k: v for k, v in full.items() if v is not None}


def start_module(module: str, args: list[str], cwd: Path,
                 env: dict[str, str | None] | None = None, logs: Path | None = None,
                 threads: int | None = None, new_session: bool = False,
                 file_size_limit: int | None = None,
                 fork_ckpt_workers: bool = False, ctrl_c: bool = False) -> ModuleRun:
    """Start `python -m module args` in `cwd` as a child of the forkserver that imported torch,
    megatron, the trainer and the checkpoint tool once (a new interpreter spends ~7 s on them):
    the entry point's own code from its first line, in a process of its own (its locks, signals
    and exit status are its own). `env` entries set to None are removed from the environment;
    the output goes to files under `logs` (a fresh directory beside `cwd` by default). The
    interpreter's own start (import-time warnings, sys.path, a missing module) is what it does
    not test: tests/trainer/test_entry_errors.py and test_quiet_run.py run new interpreters."""
    logs = logs or cwd.parent / f".{cwd.name}.run{os.getpid()}-{next(_runs)}"
    return ModuleRun(module, args, cwd, _module_env(env), logs, threads, new_session,
                     file_size_limit, fork_ckpt_workers, ctrl_c)


def start_script(script: Path, args: list[str], cwd: Path, logs: Path | None = None,
                 new_session: bool = False) -> ModuleRun:
    """`python SCRIPT args` as `start_module` starts `python -m`: the script run as `__main__`,
    its directory first on sys.path, in a child of the server."""
    return start_module(str(script), args, cwd, logs=logs, new_session=new_session)


def run_module(module: str, args: list[str], cwd: Path,
               env: dict[str, str | None] | None = None, timeout: float = 600,
               file_size_limit: int | None = None,
               fork_ckpt_workers: bool = False) -> subprocess.CompletedProcess:
    """`start_module` to its end: the exit status and output (it is killed after `timeout`)."""
    run = start_module(module, args, cwd, env, file_size_limit=file_size_limit,
                       fork_ckpt_workers=fork_ckpt_workers)
    try:
        run.wait(timeout)
    finally:
        run.kill()
    return subprocess.CompletedProcess([module, *args], run.returncode, *run.output())


def run_module_ranks(module: str, args: list[str], nproc: int, cwd: Path,
                     env: dict[str, str | None] | None = None,
                     timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """`python -m module args` on `nproc` ranks as `torchrun --standalone --nproc-per-node nproc`
    starts them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, one thread each), forked like
    `start_module` instead of new interpreters; torchrun's own part (its agent, its report, the
    error file) is tested with torchrun itself. Returns each rank's result. A port taken by
    another test's processes between `free_port` and rank 0's store (EADDRINUSE: no rank got
    past the rendezvous) is a clean start on another port, as in `conftest.spawn`."""
    retries = 2
    while True:
        port = free_port()
        runs = []
        for rank in range(nproc):
            rank_env = {**(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank),
                        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            runs.append(start_module(module, args, cwd, rank_env, threads=1))
        if _port_taken(runs, timeout) and retries:
            retries -= 1
            continue
        return [subprocess.CompletedProcess([module, *args], run.returncode, *run.output())
                for run in runs]


def _port_taken(runs: list[ModuleRun], timeout: float) -> bool:
    """Wait for every run to end (TimeoutExpired after `timeout` s); True, the others killed, as
    soon as one has failed on a taken port: the other ranks would wait for a store that never
    answers (or is another test's)."""
    deadline = time.monotonic() + timeout
    try:
        while pending := [run for run in runs if run.poll() is None]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(pending[0].process.name, timeout)
            mp_connection.wait([run.process.sentinel for run in pending], timeout=left)
            if any(run.poll() and "EADDRINUSE" in run.output()[1] for run in runs):
                return True
        return False
    finally:
        for run in runs:
            run.kill()
