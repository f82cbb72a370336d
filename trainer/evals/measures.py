"""Long-context evaluation: passkey retrieval accuracy and perplexity by context length."""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from trainer.errors import UserError
from trainer.evals.decoding import Greedy, logits_of
from trainer.evals.passkey import answer_text, passkey_prompt, random_key
from trainer.evals.results import (
    AttentionPoint,
    PasskeyCell,
    PerplexityPoint,
    PositionBucket,
)


def bucket_edges(length: int, trained_length: int | None) -> list[int]:
    """Bucket starts 0, T, 2T, 4T, ... below `length` (one bucket when T is unknown): does the
    loss past the trained length T stay flat?"""
    edges = [0]
    edge = trained_length
    while edge is not None and 0 < edge < length:
        edges.append(edge)
        edge *= 2
    return edges


@torch.no_grad()
def passkey_accuracy(model: torch.nn.Module, tokenizer, lengths: list[int], depths: list[float],
                     trials: int, digits: int, batch_size: int, seed: int,
                     device: torch.device, greedy: Greedy | None = None) -> list[PasskeyCell]:
    """Accuracy per (length, depth): a trial passes when the greedy continuation's text starts
    with the key's (compared as text: a subword tokenizer's key may take a different number of
    tokens from trial to trial, or be produced with another split of the same digits, up to one
    token per digit, so each prompt gets as many tokens as its answer has characters). Every
    depth's trials of a length decode together on the engine (`trainer.evals.decoding`)."""
    rng = np.random.default_rng(seed)
    greedy = greedy or Greedy(model, tokenizer.vocab_size, device, batch_size)
    cells = []
    for length in lengths:
        keys = [[random_key(rng, digits) for _ in range(trials)] for _ in depths]
        pairs = [passkey_prompt(tokenizer, length, depth, key)
                 for depth, row in zip(depths, keys) for key in row]
        verdicts = greedy.starts_with(
            tokenizer, [p for p, _ in pairs], [[tokenizer.decode(a)] for _, a in pairs],
            [len(answer_text(key)) for row in keys for key in row], progress=f"passkey {length}")
        for j, depth in enumerate(depths):
            correct = sum(v[0] for v in verdicts[j * trials:(j + 1) * trials])
            cells.append(PasskeyCell(length, depth, correct, trials))
    return cells


@torch.no_grad()
def perplexity_by_length(model: torch.nn.Module, stream: np.ndarray, lengths: list[int],
                         windows: int, batch_size: int, vocab_size: int,
                         device: torch.device,
                         trained_length: int | None = None) -> list[PerplexityPoint]:
    """Mean next-token loss at each length, in total and per position bucket (`bucket_edges`;
    the buckets' token-weighted mean is the total).

    Every length predicts the same tokens: the first `windows` x max(lengths) of the stream, cut
    into non-overlapping windows of that length. Only the context each token sees changes
    between lengths, so the lengths compare with each other (windows of their own text would
    mix a change of text into the change of length)."""
    longest = max(lengths)
    region = min(windows, (len(stream) - 1) // longest) * longest
    if region == 0:
        raise UserError(f"validation stream ({len(stream)} tokens) is shorter than eval "
                        f"length {longest}; lower eval.lengths or use more data")
    points = []
    for length in tqdm(lengths, desc="perplexity", leave=False):
        n = region // length
        per_position = torch.zeros(length, dtype=torch.float64)  # loss summed over windows
        for start in range(0, n, batch_size):
            rows = range(start, min(start + batch_size, n))
            batch = torch.tensor(np.stack([np.asarray(stream[i * length:(i + 1) * length + 1])
                                           for i in rows]).astype(np.int64), device=device)
            logits = logits_of(model, batch[:, :-1], vocab_size).float()
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:],
                                                     reduction="none")  # [b, s]
            per_position += loss.double().sum(dim=0).cpu()
        edges = bucket_edges(length, trained_length) + [length]
        buckets = [PositionBucket(a, e, float(per_position[a:e].sum()) / (n * (e - a)),
                                  n * (e - a)) for a, e in zip(edges, edges[1:])]
        points.append(PerplexityPoint(length, float(per_position.sum()) / (n * length), n,
                                      buckets))
    return points


@torch.no_grad()
def attention_by_distance(model: torch.nn.Module, stream: np.ndarray, lengths: list[int],
                          queries: int, vocab_size: int, device: torch.device,
                          trained_length: int | None = None) -> list[AttentionPoint]:
    """Probe `queries` query positions spread over the second half of the first window of each
    length (the perplexity's text), in one forward each."""
    from models.attention.probe import probing

    points = []
    for length in lengths:
        if len(stream) <= length:
            raise UserError(f"validation stream ({len(stream)} tokens) is shorter than eval "
                            f"length {length}; lower eval.lengths or use more data")
        tokens = torch.tensor(np.asarray(stream[:length]).astype(np.int64), device=device)[None]
        rows = torch.linspace(length // 2, length - 1, queries).round().long().unique()
        edges = bucket_edges(length, trained_length)
        with probing(rows, edges) as probe:
            logits_of(model, tokens, vocab_size)
        layers = [probe.layers[n] for n in sorted(probe.layers)]
        points.append(AttentionPoint(length, rows.tolist(), edges,
                                     [s.entropy for s in layers], [s.mass for s in layers]))
    return points
