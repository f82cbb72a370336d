"""Training, evaluation and data tools (`python -m trainer`, `trainer.eval`, `trainer.build_data`).

megatron-core announces each missing optional accelerator package (Apex, Transformer Engine)
with a UserWarning when its modules are imported. This package is imported before any of its
modules, so the filter is in place before the first megatron import of every entry point (a
filter set after the import that warns is too late).
"""

import warnings

warnings.filterwarnings("ignore", message=r".*(Apex is not installed|Transformer Engine and Apex)")
# ... and about a deprecated default when a config is built.
warnings.filterwarnings("ignore", message="full scope is deprecated")
