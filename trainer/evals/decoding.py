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
3. repeats 1 for the trials still undecided (the prefix's text is a proper prefix of a
   candidate: the same digits with another split, or a distractor's value), from the known
   prefix, forcing the rest of the first candidate it may still become (`guess`): each round
   adds at least greedy's next token, so it ends within `steps` rounds, as decoding would.

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


def _by_length(rows: list[list[int]]) -> dict[int, list[int]]:
    """Row indices grouped by row length: every forward is of equal-length rows, unpadded, as
    greedy decoding's own."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        groups[len(row)].append(i)
    return groups


@torch.no_grad()
def teacher_forced_prefix(model: torch.nn.Module, prompts: list[list[int]],
                          forced: list[list[int]], steps: int | list[int], vocab_size: int,
                          device: torch.device) -> list[list[int]]:
    """Greedy's first tokens after each prompt, known exactly from one forward of prompt +
    forced tokens: forced[:k] + [greedy's token k] for the first divergence k (at most `steps`
    tokens, per prompt if a list; all of them when greedy reproduces the forced tokens)."""
    budgets = steps if isinstance(steps, list) else [steps] * len(prompts)
    inputs = [f[:n - 1] for f, n in zip(forced, budgets)]  # the last prediction needs no input
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


def guess(tokenizer, text: str, candidates: list[str]) -> list[int]:
    """The rest of the first candidate that `text` may still become, canonically encoded: the
    tokens to force next (a wrong guess costs nothing but its own divergence)."""
    text = text.rstrip(REPLACEMENT)
    return next((tokenizer.encode(c[len(text):]) for c in candidates if c.startswith(text)), [])


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
        more = teacher_forced_prefix(
            model, [prompts[i] + known[i] for i in pending],
            [guess(tokenizer, tokenizer.decode(known[i]), candidates[i]) for i in pending],
            [steps - len(known[i]) for i in pending], tokenizer.vocab_size, device)
        for i, tokens in zip(pending, more):
            known[i] += tokens
    return verdicts  # type: ignore[return-value]  # every entry decided by now
