"""Checkpoint tools: `python -m ckpt {inspect,verify,reshape,export,import}` (see `--help`).

The checkpoint format lives here: `paths` (layout of a checkpoints root), `state` (what a
training checkpoint holds), `save` (crash-safe writes), `load` (checked loads), `reader` (safe
reading without a model or code run) and the tools built on them. `ckpt` imports `models` and
`parallel`, never `trainer`.
"""

import warnings

# megatron-core warns about each missing optional accelerator package (apex, Transformer Engine)
# on import, and about a deprecated default when a config is built; the commands (and their
# worker processes, which import this package first) say nothing useful with them.
warnings.filterwarnings("ignore", message=".*(Apex is not installed|Transformer Engine and Apex)")
warnings.filterwarnings("ignore", message="full scope is deprecated")
