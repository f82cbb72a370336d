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
# torch deprecations inside megatron's torch_dist loader (its `load_state_dict` call and
# ShardedTensor), three per load on every rank: nothing a user of these checkpoints can change.
warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated", category=FutureWarning)
warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating "
                        "ShardedTensor", category=FutureWarning)
