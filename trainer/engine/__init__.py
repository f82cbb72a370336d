"""Fast decoding from the trainer's own model: a static KV cache (`cache.py`), batched prefill
and CUDA-graph decode steps (`engine.py`), greedy or nucleus sampling (`sampling.py`), and the
cache's sizes checked before any model loads (`budget.py`).

The names below load their modules on first use (PEP 562): `budget` and `sampling` stay light,
so a command checks its settings before the engine's megatron imports (seconds on a CPU).
"""

import importlib

_WHERE = {"DecodeEngine": "engine", "EngineOptions": "engine", "EngineStats": "engine",
          "Sampling": "sampling"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
