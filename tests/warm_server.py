"""Imported last by the tests' forkserver (tests/conftest.py), whose children are the gloo ranks
of the in-process training runs (`spawn`, `train_on_ranks`) and the entry points' runs
(tests/module_runs.py): what each of them would otherwise do again, done once in the server.

- `compose_config` caches Hydra's defaults stage per group selection (tests/composition.py), but
  a child starts with the server's cache: empty, each rank of each run composed its selection
  anew (~0.2 s, of ~0.5 s of CPU for a rank of a 2-step run), and Hydra's first composition in a
  process is slower still (its override grammar's caches, its plugins). These are the selections
  the ranks compose: the FAST runs' `logger=none`, alone and with an attention kind.
- The server's objects (the imports' ~0.5 million) are frozen out of the garbage collector's
  scans (`gc.freeze`, inherited by every child): megatron's distributed optimizer calls
  `gc.collect()` in every save and load, which took ~0.65 s of CPU per call and rank over them
  (a 4-rank TP2 x PP2 run saving twice: 1.7 -> 1.1 CPU-s per rank). What a child allocates is
  collected as before.

Nothing of torch runs here: the children must not inherit its thread pools."""

from __future__ import annotations

import gc

from tests.composition import compose_config
from tests.conftest import FAST

for attention in ([], ["+attention=dca"], ["+attention=chunked"], ["+attention=head_gate"],
                  ["+attention=[dca,head_gate]"]):
    compose_config(FAST + attention)
gc.collect()
gc.freeze()
