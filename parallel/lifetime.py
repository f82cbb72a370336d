"""Helper processes that end with the process that started them.

A killed parent's children are re-parented to pid 1 and live on: megatron's forked checkpoint
writers, a command's spawned worker ranks. Here they ask Linux for SIGKILL when their parent
exits (`PR_SET_PDEATHSIG`), and a parent that is interrupted (SIGINT, SIGTERM) stops its workers
before it unwinds, so that its temporary output can be removed and nothing is left running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.multiprocessing as mp

_PR_SET_PDEATHSIG = 1
_STOP_GRACE_S = 5.0

# The pid whose forked children must die with it (None: forks are left alone).
_guarded_parent: int | None = None


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; unwinding removes partial output (a BaseException, like
    KeyboardInterrupt, so that no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def die_with_parent(parent_pid: int) -> None:
    """In a child of `parent_pid`: be killed when the parent exits (exit at once if it has).

    Linux ties the signal to the thread that forked the child: start helpers from a thread that
    lives as long as the process (the main thread)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def _after_fork_in_child() -> None:
    global _guarded_parent
    if _guarded_parent is not None:
        die_with_parent(_guarded_parent)
        _guarded_parent = os.getpid()  # its own forks, if any, die with it in turn


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def forks_die_with_parent() -> Iterator[None]:
    """Processes forked (without exec) inside the block are killed when this process exits."""
    global _guarded_parent
    previous, _guarded_parent = _guarded_parent, os.getpid()
    try:
        yield
    finally:
        _guarded_parent = previous


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into `Interrupted` in the main thread for the block (SIGTERM would
    otherwise end the process without unwinding, leaving temporary files behind)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupted(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _guarded_worker(rank: int, parent: int, fn: Callable[..., None], args: tuple) -> None:
    die_with_parent(parent)
    fn(rank, *args)


def run_workers(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.start_processes(fn, args, nprocs, start_method="spawn")`, whose
    workers die with this process, and are stopped when the wait for them is interrupted."""
    context = mp.start_processes(_guarded_worker, args=(os.getpid(), fn, args), nprocs=nprocs,
                                 join=False, start_method="spawn")
    try:
        while not context.join():
            pass
    except BaseException:
        stop_processes(context.processes)
        raise


def stop_processes(processes: list[Any]) -> None:
    """SIGTERM every live process of `processes` (multiprocessing Process objects), SIGKILL those
    still alive after a grace period, and reap them."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(_STOP_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()
