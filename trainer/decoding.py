"""Greedy decoding for retrieval grading, with teacher forcing so a trial costs about one forward.

A trial passes when the text of greedy's `steps`-token continuation starts with the answer's
text. Re-running the prompt per generated token (no KV cache: DCA and chunked attention have
no incremental path) costs `steps` forwards of the whole prompt. Instead, `greedy_starts_with`:

1. runs prompt + the expected answer's tokens once (teacher forcing). The argmax after
   prompt + answer[:j] is greedy's token j as long as greedy produced answer[:j], so greedy's
   first tokens are known exactly up to and including the first divergence k:
   answer[:k] + [argmax_k] (all `steps` tokens when greedy reproduces the answer);
2. decides each candidate string from that known prefix when it can: with the whole
   continuation known, exactly as before; with a prefix-stable tokenizer (`prefix_stable`:
   decode(x + y) starts with decode(x), trailing U+FFFD of an unfinished UTF-8 character
   aside), a prefix whose text starts with the candidate passes and one that already differs
   from it fails;
3. continues greedy decoding, one token per forward, only for trials still undecided (the
   prefix's text is a proper prefix of a candidate: the same digits with another split, or a
   distractor's value), from the known prefix, until they are decided.

The verdicts are greedy decoding's in exact arithmetic. In floating point, the logits at a
position come from a forward of a longer sequence than greedy's own, which kernels may tile
differently: the last bits can differ, as they already could between batch sizes.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from megatron.core import parallel_state, tensor_parallel

REPLACEMENT = "\ufffd"  # what decoding an unfinished UTF-8 character gives


def logits_of(model: torch.nn.Module, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary logits [b, s, vocab] (gathered across TP ranks, padding rows dropped)."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    logits = model(tokens, positions, None)  # [b, s, V / tp]
    if (parallel_state.model_parallel_is_initialized()
            and parallel_state.get_tensor_model_parallel_world_size() > 1):
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits[..., :vocab_size]


@torch.no_grad()
def greedy_continue(model: torch.nn.Module, prompts: torch.Tensor, steps: int,
                    vocab_size: int) -> torch.Tensor:
    """Greedy decoding of `steps` tokens after each prompt ([b, s] -> [b, steps]).

    Re-runs the whole sequence per token: no KV cache, so every attention variant is exercised
    exactly as in training (DCA and chunked attention have no incremental path here).
    """
    tokens = prompts
    for _ in range(steps):
        nxt = logits_of(model, tokens, vocab_size)[:, -1].argmax(dim=-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, prompts.shape[1]:]


def _by_length(rows: list[list[int]]) -> dict[int, list[int]]:
    """Row indices grouped by row length: every forward is of equal-length rows, unpadded, as
    greedy decoding's own."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        groups[len(row)].append(i)
    return groups


@torch.no_grad()
def teacher_forced_prefix(model: torch.nn.Module, prompts: list[list[int]],
                          forced: list[list[int]], steps: int, vocab_size: int,
                          device: torch.device) -> list[list[int]]:
    """Greedy's first tokens after each prompt, known exactly from one forward of prompt +
    forced tokens: forced[:k] + [greedy's token k] for the first divergence k (at most `steps`
    tokens; all of them when greedy reproduces the forced tokens)."""
    inputs = [f[:steps - 1] for f in forced]  # the last prediction needs no input after it
    rows = [p + f for p, f in zip(prompts, inputs)]
    known: list[list[int]] = [[] for _ in rows]
    for _, index in sorted(_by_length(rows).items()):
        batch = torch.tensor([rows[i] for i in index], device=device)
        argmax = logits_of(model, batch, vocab_size).argmax(dim=-1).tolist()
        for b, i in enumerate(index):
            start = len(prompts[i]) - 1  # the logits predicting the continuation's token 0
            predicted = argmax[b][start:start + len(inputs[i]) + 1]
            k = next((j for j, t in enumerate(inputs[i]) if predicted[j] != t), len(inputs[i]))
            known[i] = inputs[i][:k] + [predicted[k]]
    return known


def judge(text: str, candidates: list[str], complete: bool, prefix_stable: bool
          ) -> list[bool] | None:
    """[text of the whole continuation starts with c, for c in candidates], decided from the
    text of `complete` continuation or of a known prefix of it; None while undecided."""
    if complete:
        return [text.startswith(c) for c in candidates]
    if not prefix_stable:
        return None
    text = text.rstrip(REPLACEMENT)  # an unfinished character may still become anything
    verdict = []
    for c in candidates:
        if c.startswith(text) and not text.startswith(c):
            return None  # consistent with c so far: another split of c, or a partial match
        verdict.append(text.startswith(c))
    return verdict


@torch.no_grad()
def greedy_starts_with(model: torch.nn.Module, tokenizer, prompts: list[list[int]],
                       forced: list[list[int]], candidates: list[list[str]], steps: int,
                       device: torch.device) -> list[list[bool]]:
    """For each prompt i: [tokenizer.decode(greedy's `steps` tokens).startswith(c) for c in
    candidates[i]], as greedy decoding gives it, in about one forward (see module doc);
    `forced[i]` is the continuation expected (the asked key's tokens)."""
    stable = getattr(tokenizer, "prefix_stable", False)
    known = teacher_forced_prefix(model, prompts, forced, steps, tokenizer.vocab_size, device)
    verdicts: list[list[bool] | None] = [None] * len(prompts)
    pending = list(range(len(prompts)))
    while pending:
        for i in pending:
            verdicts[i] = judge(tokenizer.decode(known[i]), candidates[i],
                                len(known[i]) == steps, stable)
        pending = [i for i in pending if verdicts[i] is None]
        rows = [prompts[i] + known[i] for i in pending]
        for _, index in sorted(_by_length(rows).items()):
            batch = torch.tensor([rows[b] for b in index], device=device)
            for b, token in zip(index, greedy_continue(model, batch, 1, tokenizer.vocab_size)):
                known[pending[b]].append(int(token))
    return verdicts  # type: ignore[return-value]  # every entry decided by now
