"""Greedy decoding for retrieval grading: a trial passes when the text of greedy's `steps`-token
continuation starts with the answer's text.

`Greedy` decodes on the engine (trainer/engine) for the trainer's own model at TP=1: prompts
prefilled in batches, logits at each row's last token only, each further token one cached
decode step. Any other model (a callable returning logits [b, s, vocab]: a TP-sharded model,
the tests' scripted ones) is decoded by recomputing the whole sequence per token, rows of
equal length together: the same greedy tokens in exact arithmetic.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from megatron.core import parallel_state, tensor_parallel

# new tokens a retrieval answer may take at most (a key's or value's characters, and spare)
ANSWER_TOKENS = 64


def logits_of(model: torch.nn.Module, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary logits [b, s, vocab] (gathered across TP ranks, padding rows dropped)."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    logits = model(tokens, positions, None)  # [b, s, V / tp]
    if _tp_size() > 1:
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits[..., :vocab_size]


def _tp_size() -> int:
    return (parallel_state.get_tensor_model_parallel_world_size()
            if parallel_state.model_parallel_is_initialized() else 1)


def engine_takes(model: object) -> bool:
    """Whether the engine can decode `model`: the trainer's GPTModel (or its bf16 wrapper) at
    TP=1."""
    from megatron.core.models.gpt import GPTModel

    from trainer.engine.cache import unwrapped

    return (isinstance(model, torch.nn.Module) and isinstance(unwrapped(model), GPTModel)
            and _tp_size() == 1)


class Greedy:
    """Greedy continuations of prompts, `batch_size` at a time, one engine per evaluation (the
    passkey and multi-key tasks share it, and so its cache and its captured decode step)."""

    def __init__(self, model, vocab_size: int, device: torch.device, batch_size: int) -> None:
        from trainer.engine import DecodeEngine, EngineOptions

        self.model, self.vocab_size, self.device = model, vocab_size, device
        self.batch_size = batch_size
        self.engine = (DecodeEngine(model, vocab_size, EngineOptions(max_batch=batch_size))
                       if engine_takes(model) else None)

    def reserve(self, length: int) -> None:
        """Size the engine's cache once for prompts and continuations of up to `length` tokens."""
        if self.engine is not None:
            self.engine.reserve(self.batch_size, length)

    @torch.no_grad()
    def continuations(self, prompts: list[list[int]], steps: int | list[int],
                      progress: str | None = None) -> list[list[int]]:
        """Greedy's first `steps` tokens after each prompt (one count, or one per prompt)."""
        budgets = [steps] * len(prompts) if isinstance(steps, int) else list(steps)
        if self.engine is not None:
            return self.engine.generate(prompts, budgets, progress=progress)
        out: list[list[int]] = [[] for _ in prompts]
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, row in enumerate(prompts):
            groups[len(row), budgets[i]].append(i)
        for (_, n), index in groups.items():  # equal-length rows, unpadded, as greedy's own
            for start in range(0, len(index), self.batch_size):
                rows = index[start:start + self.batch_size]
                tokens = torch.tensor([prompts[i] for i in rows], device=self.device)
                for _ in range(n):
                    nxt = logits_of(self.model, tokens, self.vocab_size)[:, -1].argmax(-1)
                    tokens = torch.cat([tokens, nxt[:, None]], dim=1)
                for i, row in zip(rows, tokens[:, -n:].tolist()):
                    out[i] = row
        return out

    def release(self) -> None:
        """Free the engine's cache and captured graph."""
        if self.engine is not None:
            self.engine.release()

    def report(self, phases) -> None:
        """The engine's split of the decoding time (prefill, steps, capture) into `phases`
        (trainer/timing.py)."""
        if self.engine is not None:
            phases.add_all(self.engine.stats.seconds())

    def starts_with(self, tokenizer, prompts: list[list[int]], candidates: list[list[str]],
                    steps: int | list[int], progress: str | None = None) -> list[list[bool]]:
        """For each prompt i: [the text of greedy's `steps` tokens starts with c, for c in
        candidates[i]]."""
        texts = [tokenizer.decode(t) for t in self.continuations(prompts, steps, progress)]
        return [[text.startswith(c) for c in cands] for text, cands in zip(texts, candidates)]
