"""`python -m tests.trainer.holder DIR`: hold DIR as a run holds its run directory
(`trainer.run_dir.hold`), say `held`, and wait to be killed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __name__ == "__main__":
    from trainer.run_dir import hold

    hold(Path(sys.argv[1]))
    print("held", flush=True)
    time.sleep(600)
