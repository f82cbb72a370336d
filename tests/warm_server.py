"""Imported last by the tests' forkserver (tests/conftest.py), whose children are the gloo ranks
of the in-process training runs (`spawn`, `train_on_ranks`) and the entry points' runs
(tests/module_runs.py): what each of them would otherwise compose again, composed once here.

`compose_config` caches Hydra's defaults stage per group selection (tests/composition.py), but a
child starts with the server's cache: empty, each rank of each run composed its selection anew
(~0.2 s, of ~0.5 s of CPU for a rank of a 2-step run) and Hydra's first composition in a process
is slower still (its override grammar's caches, its plugins). These are the selections the ranks
compose: the FAST runs' `logger=none`, alone and with an attention kind. Nothing of torch runs
here: the children must not inherit its thread pools."""

from __future__ import annotations

from tests.composition import compose_config
from tests.conftest import FAST

for attention in ([], ["+attention=dca"], ["+attention=chunked"], ["+attention=head_gate"],
                  ["+attention=[dca,head_gate]"]):
    compose_config(FAST + attention)
