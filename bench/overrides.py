"""Hydra overrides as the bench drivers combine them."""

from __future__ import annotations


def merge_overrides(*groups: list[str]) -> list[str]:
    """Hydra overrides, later groups winning per key (Hydra refuses a key given twice)."""
    merged: dict[str, str] = {}
    for group in groups:
        for item in group:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"override {item!r} is not KEY=VALUE")
            merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]
