"""The suite's entry points: choose tasks, check lengths, build samples, write them out.

    specs = select_tasks(["niah_single_1", "vt"], qa_file=None)   # checks names and QA files
    check_lengths(specs, [4096, 8192], tokenizer)                   # too short: UserError
    samples = build_samples(specs, [4096, 8192], 50, tokenizer, seed=0, text_source=text)
    write_jsonl(samples, "ruler.jsonl")                             # for another harness
    ... decode each sample.prompt_ids for up to sample.max_new_tokens ...
    result = score_predictions(samples, predictions)                # scoring.py

Everything that can be checked without a model is checked here first: task names, QA files
(their shape), prompt format and chat template, haystack text, lengths.

The JSONL holds one object per sample, RULER's fields plus ours:
    {"index", "task", "length", "input" (the prompt without the answer prefix, as RULER writes
     it), "answer_prefix", "outputs" (references), "max_new_tokens", "metric",
     "prompt_tokens", "prompt_ids"}
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from trainer.errors import UserError
from trainer.evals.ruler.fit import Context
from trainer.evals.ruler.haystack import TextSource
from trainer.evals.ruler.qa import load_qa, shape_of
from trainer.evals.ruler.specs import REGISTRY, CommonWordsSpec, QASpec, Sample, TaskSpec
from trainer.evals.ruler.templates import PromptFormat

QAFiles = str | os.PathLike | Mapping[str, str | os.PathLike] | None


def _qa_path(spec: QASpec, qa_file: QAFiles) -> str | None:
    if qa_file is None:
        return None
    if isinstance(qa_file, Mapping):
        path = qa_file.get(spec.name)
        return None if path is None else str(path)
    return str(qa_file)


def _file_shape(path: str) -> str | None:
    """The shape of a QA file, read once to choose the QA tasks a lone file serves."""
    try:
        return shape_of(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # load_qa reports it


def select_tasks(names: Sequence[str] | None = None, qa_file: QAFiles = None) -> list[TaskSpec]:
    """The specs of the named tasks (None: all that can run), QA files checked now.

    `qa_file`: one file (SQuAD-shaped for qa_1, HotpotQA-shaped for qa_2), or a mapping
    {"qa_1": path, "qa_2": path}. With `names` None the QA tasks are included when a file
    of their shape is given (a lone file serves the task of its shape).
    """
    if isinstance(names, str):
        names = [names]
    if names is None:
        names = [n for n, s in REGISTRY.items() if not isinstance(s, QASpec)]
        if isinstance(qa_file, Mapping):
            names += [n for n in ("qa_1", "qa_2") if n in qa_file]
        elif qa_file is not None:
            shape = _file_shape(str(qa_file))
            names += [n for n in ("qa_1", "qa_2") if REGISTRY[n].dataset == shape] or ["qa_1"]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise UserError(f"unknown RULER task(s) {unknown}: the tasks are {list(REGISTRY)}")
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise UserError(f"RULER tasks listed twice: {twice}")
    specs = []
    for name in names:
        spec = REGISTRY[name]
        if isinstance(spec, QASpec):
            path = _qa_path(spec, qa_file)
            if path is None:
                raise UserError(f"RULER task {name} needs a QA file: set qa_file to a "
                                f"{'SQuAD' if spec.dataset == 'squad' else 'HotpotQA'}-shaped "
                                "JSON file")
            load_qa(path, spec.dataset)  # shape checked before any model work
            spec = replace(spec, path=path)
        specs.append(spec)
    return specs


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    bad = [n for n in lengths if not isinstance(n, int) or isinstance(n, bool) or n <= 0]
    if bad or not lengths:
        raise UserError(f"RULER lengths must be positive integers, got {list(lengths)}")
    return list(lengths)


def check_lengths(tasks: Sequence[TaskSpec], lengths: Sequence[int], tokenizer, *,
                  template: str = "auto", chat_template: str | None = None,
                  chat_variables: Mapping[str, str] | None = None, seed: int = 0,
                  vocab_words: bool = False) -> None:
    """UserError listing every (task, length) whose shortest prompt + tokens_to_generate is
    over the length (measured on the probe prompt, in the prompt format, at the smallest
    haystack; the settings as `build_samples` gets them)."""
    ctx = Context(tokenizer, seed, PromptFormat(template, chat_template, chat_variables),
                  vocab_words=vocab_words)
    problems, hint = [], ""
    for spec in tasks:
        for length in _check_lengths(lengths):
            need = ctx.minimum(spec, length)
            if need > length:
                problems.append(f"{spec.name} at {length} (minimum {need})")
                if isinstance(spec, CommonWordsSpec) and not vocab_words:
                    hint = ("; cwe: words from the tokenizer's vocabulary (vocab_words=True) "
                            "take fewer tokens")
    if problems:
        raise UserError("RULER lengths too short for their tasks' prompts: "
                        + "; ".join(problems) + hint)


def build_samples(task_specs: Sequence[TaskSpec], lengths: Sequence[int],
                  samples_per_task: int, tokenizer, seed: int = 0,
                  text_source: TextSource | None = None, template: str = "auto",
                  chat_template: str | None = None, *,
                  chat_variables: Mapping[str, str] | None = None, vocab_words: bool = False,
                  cache: dict | None = None, progress: bool = True) -> list[Sample]:
    """`samples_per_task` samples of every task at every length, in (task, length, index)
    order.

    text_source: the essay haystack's text (a string, documents, or a callable giving either);
        needed by the essay-haystack tasks only.
    template: 'base', 'chat' or 'auto' (chat when `chat_template` is given); chat_variables:
        extra names the chat template uses (bos_token, ...).
    vocab_words: draw words from the tokenizer's vocabulary instead of pseudo-words.
    cache: fitted sizes to reuse across calls (same tokenizer and text source only).
    """
    if not isinstance(samples_per_task, int) or samples_per_task < 1:
        raise UserError(f"samples_per_task must be a positive integer, got {samples_per_task!r}")
    lengths = _check_lengths(lengths)
    needs_text = [s.name for s in task_specs if s.needs_text]
    if needs_text and text_source is None:
        raise UserError(f"RULER tasks {needs_text} need haystack text: pass text_source (e.g. "
                        "the validation corpus decoded to text)")
    ctx = Context(tokenizer, seed, PromptFormat(template, chat_template, chat_variables),
                  text_source, vocab_words, cache)
    items = [(spec, length, index) for spec in task_specs for length in lengths
             for index in range(samples_per_task)]
    with tqdm(total=len(items), desc="RULER samples", leave=False, disable=not progress) as bar:
        return ctx.samples(items, done=lambda _: bar.update())


def _record(sample: Sample) -> dict:
    if not sample.input.endswith(sample.answer_prefix):
        raise ValueError(f"{sample.task}[{sample.index}]: input does not end with its prefix")
    cut = len(sample.input) - len(sample.answer_prefix)
    return {"index": sample.index, "task": sample.task, "length": sample.length,
            "input": sample.input[:cut], "answer_prefix": sample.answer_prefix,
            "outputs": sample.references, "max_new_tokens": sample.max_new_tokens,
            "metric": sample.metric, "prompt_tokens": len(sample.prompt_ids),
            "prompt_ids": sample.prompt_ids}


def write_jsonl(samples: Sequence[Sample], path: str | os.PathLike) -> Path:
    """One JSON object per sample (see the module doc), written to a temporary file in the
    same directory and renamed over `path`, so a reader never sees half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for sample in samples:
                f.write(json.dumps(_record(sample), ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def read_jsonl(path: str | os.PathLike) -> list[Sample]:
    """The samples `write_jsonl` wrote."""
    samples = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            samples.append(Sample(task=r["task"], length=r["length"], index=r["index"],
                                  input=r["input"] + r["answer_prefix"],
                                  answer_prefix=r["answer_prefix"], prompt_ids=r["prompt_ids"],
                                  references=r["outputs"], max_new_tokens=r["max_new_tokens"],
                                  metric=r["metric"]))
    return samples
