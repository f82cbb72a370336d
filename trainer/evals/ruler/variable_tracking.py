"""Variable tracking prompts (RULER's variable_tracking.py: the vt task).

A chain of `num_hops` assignments hidden one statement per line among the noise lines:

    VAR QWXZT = 48213
    The grass is green. The sky is blue. ...
    VAR MPLOE = VAR QWXZT
    ...
    Question: Find all variables that are assigned the value 48213 in the text above.
     Answer: According to the chain(s) of variable assignment in the text above, 5 variables
    are assigned the value 48213, they are:

The references are the first chain's num_hops + 1 variable names (5 random capitals each); the
chains' values are distinct. RULER puts a one-shot example first: the same task with 3-letter
names in a haystack fitted to 500 tokens (its prompt, answer prefix included, then " ", the
answer and a blank line). RULER builds that example once and renames its variables and value per
sample; here each sample draws its own, which is the same thing. Its haystack size is fitted
once per spec (`ctx.example_size`), so every sample's example has the same number of lines.
"""

from __future__ import annotations

import string

import numpy as np

from trainer.evals.ruler.haystack import insert_at_depths, insert_lines, split_sentences
from trainer.evals.ruler.specs import Draft, VariableTrackingSpec
from trainer.evals.ruler.templates import NOISE, VT_PREFIX, VT_TEMPLATE
from trainer.evals.ruler.words import distinct, letter_strings

ICL_LETTERS, LETTERS = 3, 5
ICL_MAX_HOPS = 10


def make_chains(rng: np.random.Generator, num_chains: int, num_hops: int,
                letters: int) -> tuple[list[list[str]], list[list[str]], list[str]]:
    """(variable names per chain, statements per chain, value per chain): names distinct
    capitals, values distinct 5-digit numbers; hops keep RULER's trailing space."""
    names = letter_strings(rng, num_chains * (num_hops + 1), letters, string.ascii_uppercase)
    groups = [names[i * (num_hops + 1):(i + 1) * (num_hops + 1)] for i in range(num_chains)]
    values = distinct(lambda m: [str(v) for v in rng.integers(10000, 99999, size=m).tolist()],
                      num_chains)
    chains = [[f"VAR {g[0]} = {value}"] + [f"VAR {g[j + 1]} = VAR {g[j]} " for j in
                                             range(num_hops)] for g, value in zip(groups, values)]
    return groups, chains, values


def interleave(rng: np.random.Generator, chains: list[list[str]]) -> list[str]:
    """All statements, the chains randomly merged, each chain's order kept."""
    owners = [i for i, chain in enumerate(chains) for _ in chain]
    owners = [owners[j] for j in rng.permutation(len(owners)).tolist()]
    nxt = [0] * len(chains)
    out = []
    for i in owners:
        out.append(chains[i][nxt[i]])
        nxt[i] += 1
    return out


def context_text(spec: VariableTrackingSpec, rng: np.random.Generator, size: int,
                 chains: list[list[str]], ctx) -> str:
    """The haystack of `size` noise lines (or essay words) with the chains in it."""
    if spec.haystack == "noise":
        lines = [NOISE] * size
        for chain in chains:
            lines = insert_lines(rng, lines, chain)
        context = "\n".join(lines)
    else:
        sentences = split_sentences(ctx.essay(rng, size))
        context = insert_at_depths(rng, sentences,
                                   [s.strip() + "." for s in interleave(rng, chains)])
    return context.replace(". \n", ".\n")


def task_text(spec: VariableTrackingSpec, rng: np.random.Generator, size: int, num_hops: int,
              letters: int, ctx) -> tuple[str, str, list[str]]:
    """(filled template, filled answer prefix, the first chain's names)."""
    groups, chains, values = make_chains(rng, spec.num_chains, num_hops, letters)
    context = context_text(spec, rng, size, chains, ctx)
    fill = {"query": values[0], "num_v": num_hops + 1}
    return VT_TEMPLATE.format(context=context, **fill), VT_PREFIX.format(**fill), groups[0]


def example_prompt(spec: VariableTrackingSpec, rng: np.random.Generator, size: int,
                   ctx) -> tuple[str, list[str]]:
    """The one-shot example's prompt (answer prefix included) and its answer."""
    text, prefix, names = task_text(spec, rng, size, min(ICL_MAX_HOPS, spec.num_hops),
                                    ICL_LETTERS, ctx)
    return text + prefix, names


def generate(spec: VariableTrackingSpec, rng: np.random.Generator, size: int, length: int,
             index: int, ctx) -> Draft:
    """One vt prompt with `size` haystack units, RULER's one-shot example first."""
    text, prefix, names = task_text(spec, rng, size, spec.num_hops, LETTERS, ctx)
    if spec.icl:
        example_size = ctx.example_size(
            ("vt-example", spec), spec.icl_tokens,
            lambda r, n: example_prompt(spec, r, n, ctx)[0])
        prompt, answer = example_prompt(spec, rng, example_size, ctx)
        text = prompt + " " + " ".join(answer) + "\n" + "\n" + text
    return Draft(text=text, answer_prefix=prefix, references=names)
