"""Zipf counts of the frequent-words task (RULER's freq_words_extraction): how often each rank
of the coded vocabulary appears, and the smallest sample in which the top ranks are ordered."""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=16)
def zeta(alpha: float) -> float:
    """Riemann zeta(alpha) for alpha > 1: a partial sum plus the Euler-Maclaurin tail."""
    n = 1000
    head = float(np.sum(np.arange(1, n, dtype=np.float64) ** -alpha))
    tail = n ** (1 - alpha) / (alpha - 1) + 0.5 * n ** -alpha + alpha * n ** (-alpha - 1) / 12
    return head + tail


def zipf_counts(size: int, alpha: float, vocab: int) -> np.ndarray:
    """[vocab] occurrences of rank 1..vocab: int(size * k^-alpha / zeta(alpha))."""
    k = np.arange(1, vocab + 1, dtype=np.float64)
    return (size * k ** -alpha / zeta(alpha)).astype(np.int64)


@functools.lru_cache(maxsize=16)
def fwe_min_words(alpha: float) -> int:
    """The smallest Zipf sample size whose ranks 2, 3, 4 each occur, strictly more often than
    the next rank: below it the three most frequent words are not well defined."""
    k = np.arange(1, 6, dtype=np.float64)
    for start in range(1, 10**9, 10**5):
        sizes = np.arange(start, start + 10**5, dtype=np.float64)[:, None]
        c = (sizes * k ** -alpha / zeta(alpha)).astype(np.int64)  # [sizes, 5]
        ok = (c[:, 3] >= 1) & (c[:, 1] > c[:, 2]) & (c[:, 2] > c[:, 3]) & (c[:, 3] > c[:, 4])
        if ok.any():
            return start + int(np.argmax(ok))
    raise ValueError(f"no Zipf sample size works for alpha={alpha}")
