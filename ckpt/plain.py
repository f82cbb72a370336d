"""Exact JSON for a checkpoint's plain values (what `torch.load(weights_only=True)` returns).

The common state (step, config, scheduler, optimizer hyper-parameters) and the pickled objects
(RNG states) are containers of Python scalars and small tensors. JSON keeps lists, string-keyed
dicts and scalars as they are (Python writes floats so that they read back bit for bit); the
rest is tagged: {"__tuple__": [...]}, {"__dict__": [[key, value], ...]} (non-string keys),
{"__tensor__": base64 bytes, "dtype": ..., "shape": [...]}.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

_TAGS = ("__tuple__", "__dict__", "__tensor__")


def encode(value: Any, where: str = "value") -> Any:
    """A JSON-ready form of `value`; raises TypeError (naming `where`) for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in value):
            return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
        pairs = [[encode(k, where), encode(v, f"{where}.{k}")] for k, v in value.items()]
        return {"__dict__": pairs}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()  # 0-d tensors too
        return {"__tensor__": base64.b64encode(raw).decode(),
                "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    raise TypeError(f"{where}: cannot store a {type(value).__name__} as JSON")


def decode(value: Any) -> Any:
    """The inverse of `encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__dict__" in value:
        return {decode(k): decode(v) for k, v in value["__dict__"]}
    if "__tensor__" in value:
        raw = bytearray(base64.b64decode(value["__tensor__"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, torch.uint8)
        return flat.view(getattr(torch, value["dtype"])).reshape(value["shape"])
    return {k: decode(v) for k, v in value.items()}
