"""Save and stop on SIGTERM or SIGUSR1 (what a scheduler's preemption, `timeout`, torchrun's
shutdown or SLURM's `--signal=USR1@60` send before they kill a job) and on SIGINT (Ctrl-C).

The handler only records the signal; the training loop asks before each step, every rank agreeing
on the step (a rank that got the signal late must not skip the collective save), saves a checkpoint
and ends with status 128 + signal, so that rerunning with `checkpoint.load=` loses nothing. A
second signal while stopping ends the process at once, as the first would have without us (a
second SIGINT as KeyboardInterrupt, which `python -m trainer` reports in one line after the save
it cut short removed its `iter_N.tmp`). The handler is installed when training starts: a signal
during setup ends the process as before. A SIGINT the process ignores (a job started in the
background by a shell) stays ignored.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Stopped(Exception):
    """Training stopped on a signal after saving; the entry point exits with `exit_status`."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")
        self.signum, self.step = signum, step

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopOnSignal:
    """Records SIGTERM / SIGUSR1 / SIGINT while installed (main thread only; elsewhere it
    records nothing and the signals keep their handlers)."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:  # the second signal: stop now, the way the default handler would
            self.uninstall()
            signal.raise_signal(signum)
            return
        self.signum = signum

    def requested(self, device: torch.device) -> int:
        """The signal any rank has received (0: none). A collective: call it on every rank at
        the same point of the loop."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous = {}
