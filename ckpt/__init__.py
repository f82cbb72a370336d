"""Checkpoint tools: `python -m ckpt {inspect,verify,reshape,export,import}` (see `--help`).

`ckpt.reader` reads torch_dist checkpoints safely (no model, no code run); the trainer uses it
to check a checkpoint before loading it. The command modules import the trainer and models.
"""

import warnings

# megatron-core warns about each missing optional accelerator package (apex, Transformer Engine)
# on import, and about a deprecated default when a config is built; the commands (and their
# worker processes, which import this package first) say nothing useful with them.
warnings.filterwarnings("ignore", message=".*(Apex is not installed|Transformer Engine and Apex)")
warnings.filterwarnings("ignore", message="full scope is deprecated")
