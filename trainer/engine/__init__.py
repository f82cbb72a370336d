"""Fast decoding from the trainer's own model: a static KV cache (`cache.py`), batched prefill
and CUDA-graph decode steps (`engine.py`), greedy or nucleus sampling (`sampling.py`)."""

from trainer.engine.engine import DecodeEngine, EngineOptions, EngineStats
from trainer.engine.sampling import Sampling

__all__ = ["DecodeEngine", "EngineOptions", "EngineStats", "Sampling"]
