"""Fake causal language models for retrieval grading: a script picks each answer token from the
prompt and the answer so far, at every position."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

import torch

from trainer.evals.decoding import logits_of
from trainer.evals.passkey import answer_text

# The answer starts after either question: passkey's or multi-key's (any name).
QUESTION = re.compile(r"What is the pass key(?: for (\w+))?\? The pass key (?:for \w+ )?is$")
ANSWER = 16  # at most this many answer tokens
Script = Callable[[str, list[int]], int]  # (prompt text, answer ids so far) -> next id


class ScriptedModel(torch.nn.Module):
    """Logits [b, s, width]: one-hot on `script`'s token at every position from the end of the
    row's (last) question on, flat before it. Causal by construction."""

    def __init__(self, tokenizer, script: Script, width: int = 384) -> None:
        super().__init__()
        self.tokenizer, self.script, self.width = tokenizer, script, width

    def _answer_start(self, row: list[int]) -> int | None:
        """Index of the first token after the question (None: the row has no question), found
        among the last `ANSWER` positions (answers are shorter)."""
        for start in range(len(row), max(0, len(row) - ANSWER), -1):
            if QUESTION.search(self.tokenizer.decode(row[max(0, start - 60):start])):
                return start
        return None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: None) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, self.width)
        for b, row in enumerate(tokens.tolist()):
            start = self._answer_start(row)
            if start is None:
                continue
            prompt = self.tokenizer.decode(row[:start])
            for p in range(start - 1, len(row)):
                logits[b, p, self.script(prompt, row[start:p + 1])] = 1.0
        return logits


class Counting(torch.nn.Module):
    """Counts a model's forwards and the token positions they process."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.calls, self.tokens = model, 0, 0

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: None) -> torch.Tensor:
        self.calls += 1
        self.tokens += tokens.numel()
        return self.model(tokens, positions, mask)


def asked_and_others(prompt: str) -> tuple[str, list[str]]:
    """The answer texts (" 71432": `answer_text`) of the asked key and of the other keys of a
    passkey or multi-key prompt."""
    asked = re.findall(r"What is the pass key(?: for (\w+))?\?", prompt)[-1]
    found = dict(re.findall(r"The pass key (?:for (\w+) )?is (\d+)\. Remember", prompt))
    return answer_text(found[asked]), [answer_text(v) for n, v in found.items() if n != asked]


def follow(target: list[int], answer: list[int], otherwise: int) -> int:
    """The next token of `target` while the answer follows it, else `otherwise`."""
    n = len(answer)
    return target[n] if answer == target[:n] and n < len(target) else otherwise


def draw(*parts: object) -> int:
    """A deterministic pseudo-random integer from `parts`."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def noisy_script(tokenizer, seed: int, splits: Callable[[str], list[list[int]]]) -> Script:
    """A random model over retrieval answers: per trial a plan (the asked key or a distractor,
    in any of its token splits, a partial match, or noise), per token a chance of a stray
    digit, eod or random token. `splits(text)` lists token splits of a digit string."""
    digit_ids = [t for d in "0123456789" for t in tokenizer.encode(d)]

    def script(prompt: str, answer: list[int]) -> int:
        asked, others = asked_and_others(prompt)
        plan = draw(seed, prompt[-400:]) % 6
        value = others[draw(seed, prompt[-300:]) % len(others)] if plan in (2, 3) and others \
            else asked
        options = splits(value)
        target = options[draw(seed, value) % len(options)]
        if plan == 4:  # partial: a correct start, then wrong digits
            cut = 1 + draw(seed, "cut", value) % (len(value) - 1)  # a digit, not the space
            target = tokenizer.encode(value[:cut] + str((int(value[cut]) + 1) % 10) + "0")
        roll = draw(seed, prompt[-200:], tuple(answer))
        if plan == 5 or roll % 7 == 0:
            pool = digit_ids + [tokenizer.eod, roll % tokenizer.vocab_size]
            return pool[roll % len(pool)]
        return follow(target, answer, digit_ids[roll % len(digit_ids)])

    return script


@torch.no_grad()
def greedy_continue(model: torch.nn.Module, prompts: torch.Tensor, steps: int,
                    vocab_size: int) -> torch.Tensor:
    """Greedy decoding of `steps` tokens after each prompt ([b, s] -> [b, steps]), re-running
    the whole sequence per token: the tests' reference."""
    tokens = prompts
    for _ in range(steps):
        nxt = logits_of(model, tokens, vocab_size)[:, -1].argmax(dim=-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, prompts.shape[1]:]
