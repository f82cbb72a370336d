"""Long-context evaluation tasks (`python -m trainer.eval` runs them): passkey and multi-key
retrieval prompts, greedy decoding to grade them, and the measurements (`measures.py`)."""
