"""`python -m tests.trainer.second_signal`: a process stopping on SIGTERM (`StopOnSignal`) gets
SIGTERM twice; it prints `recorded <signum>` after the first, and `survived` if the second did
not end it within 5 s."""

from __future__ import annotations

if __name__ == "__main__":
    import os
    import signal
    import time

    from trainer.stop import StopOnSignal

    stop = StopOnSignal()
    os.kill(os.getpid(), signal.SIGTERM)
    print("recorded", stop.signum, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    print("survived", flush=True)
