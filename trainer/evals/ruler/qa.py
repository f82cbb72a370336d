"""Question answering over documents (RULER's qa.py: qa_1 on SQuAD, qa_2 on HotpotQA).

The user gives the file; nothing is downloaded. Two shapes are read, checked on load (before
any model work) with errors that name the file and the first thing wrong:

    SQuAD (qa_1):    {"data": [{"paragraphs": [{"context": str, "qas": [{"question": str,
                      "answers": [{"text": str}, ...], "is_impossible": bool?}]}]}]}
    HotpotQA (qa_2): [{"question": str, "answer": str,
                       "context": [[title, [sentence, ...]], ...]}, ...]

As in RULER the documents are the distinct contexts (SQuAD paragraphs; HotpotQA "title\\n"
+ joined sentences), sorted; unanswerable SQuAD questions are skipped. Sample i asks the file's
i-th question (cycling); its prompt holds the question's own documents plus `size` others: first
the other paragraphs of its SQuAD article, then random documents, repeating the collection only
when it runs out. The documents are shuffled and numbered "Document 1:\\n...". References: the
question's answers (any one counts).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.errors import UserError
from trainer.evals.ruler.specs import Draft, QASpec
from trainer.evals.ruler.templates import DOCUMENT, QA_PREFIX, QA_TEMPLATE

SHAPES = {"squad": 'SQuAD ({"data": [{"paragraphs": [{"context", "qas": [...]}]}]})',
          "hotpotqa": 'HotpotQA ([{"question", "answer", "context": [[title, [sentences]]]}])'}


@dataclass(frozen=True)
class Question:
    query: str
    answers: tuple[str, ...]
    gold: tuple[int, ...]  # indices into QAData.docs: the question's own documents
    related: tuple[int, ...]  # other paragraphs of the same SQuAD article


@dataclass(frozen=True)
class QAData:
    questions: tuple[Question, ...]
    docs: tuple[str, ...]


class _Bad(Exception):
    """A shape problem: where, and what is wrong."""


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise _Bad(f"{where} {what}")


def _string(obj, key: str, where: str) -> str:
    _need(isinstance(obj, dict), where, "is not an object")
    _need(isinstance(obj.get(key), str), where, f"has no string {key!r}")
    return obj[key]


def shape_of(data) -> str | None:
    """'squad', 'hotpotqa' or None, from the top level alone."""
    if isinstance(data, dict) and "data" in data:
        return "squad"
    if isinstance(data, list):
        return "hotpotqa"
    return None


def _read_squad(data: dict) -> QAData:
    articles = data["data"]
    _need(isinstance(articles, list), "data", "is not a list")
    contexts = []
    for a, article in enumerate(articles):
        _need(isinstance(article, dict) and isinstance(article.get("paragraphs"), list),
              f"data[{a}]", "has no list 'paragraphs'")
        contexts += [_string(p, "context", f"data[{a}].paragraphs[{i}]")
                     for i, p in enumerate(article["paragraphs"])]
    docs = sorted(set(contexts))
    doc_id = {c: i for i, c in enumerate(docs)}
    questions = []
    for a, article in enumerate(articles):
        own = [doc_id[p["context"]] for p in article["paragraphs"]]
        for i, p in enumerate(article["paragraphs"]):
            where = f"data[{a}].paragraphs[{i}]"
            _need(isinstance(p.get("qas"), list), where, "has no list 'qas'")
            for j, qa in enumerate(p["qas"]):
                at = f"{where}.qas[{j}]"
                query = _string(qa, "question", at)
                if qa.get("is_impossible", False):
                    continue
                _need(isinstance(qa.get("answers"), list), at, "has no list 'answers'")
                answers = tuple(_string(ans, "text", f"{at}.answers[{k}]")
                                for k, ans in enumerate(qa["answers"]))
                if answers:
                    gold = doc_id[p["context"]]
                    questions.append(Question(query, answers, (gold,),
                                              tuple(d for d in own if d != gold)))
    return QAData(tuple(questions), tuple(docs))


def _read_hotpotqa(data: list) -> QAData:
    def doc(entry, where: str) -> str:
        _need(isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
              and isinstance(entry[1], list) and all(isinstance(s, str) for s in entry[1]),
              where, "is not [title, [sentences]]")
        return f"{entry[0]}\n{''.join(entry[1])}"

    items = []
    for n, item in enumerate(data):
        query = _string(item, "question", f"[{n}]")
        answer = _string(item, "answer", f"[{n}]")
        _need(isinstance(item.get("context"), list) and item["context"], f"[{n}]",
              "has no non-empty list 'context'")
        items.append((query, answer, [doc(e, f"[{n}].context[{k}]")
                                      for k, e in enumerate(item["context"])]))
    docs = sorted({d for _, _, ds in items for d in ds})
    doc_id = {d: i for i, d in enumerate(docs)}
    questions = tuple(Question(q, (a,), tuple(dict.fromkeys(doc_id[d] for d in ds)), ())
                      for q, a, ds in items)
    return QAData(questions, tuple(docs))


def load_qa(path: str | os.PathLike, dataset: str) -> QAData:
    """The questions and documents of a QA file of `dataset`'s shape ('squad' | 'hotpotqa');
    UserError naming the file and what is wrong otherwise. Cached per file version."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"RULER QA file {file} does not exist")
    stat = file.stat()
    return _load(str(file), dataset, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _load(path: str, dataset: str, mtime_ns: int, size: int) -> QAData:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"RULER QA file {path} is not readable JSON: {e}") from None
    found = shape_of(data)
    if found != dataset:
        what = f"is {found}-shaped" if found else "is neither SQuAD- nor HotpotQA-shaped"
        raise UserError(f"RULER QA file {path} {what}; this task needs {SHAPES[dataset]}")
    try:
        qa = _read_squad(data) if dataset == "squad" else _read_hotpotqa(data)
    except _Bad as e:
        raise UserError(f"RULER QA file {path} is not {SHAPES[dataset]}: {e}") from None
    if not qa.questions:
        raise UserError(f"RULER QA file {path} has no answerable question")
    return qa


def pick_documents(rng: np.random.Generator, question: Question, n_docs: int,
                   size: int) -> list[int]:
    """The question's own documents and `size` others (related first), shuffled."""
    related = list(question.related)
    if size <= len(related):
        extra = [related[i] for i in rng.choice(len(related), size=size, replace=False).tolist()]
    else:
        taken = set(question.gold) | set(related)
        others = [d for d in range(n_docs) if d not in taken]
        rest = size - len(related)
        if others:
            cycle = [others[i] for i in rng.permutation(len(others)).tolist()]
            extra = related + (cycle * (rest // len(cycle) + 1))[:rest]
        else:  # every document is the question's: repeat them
            pool = list(question.gold) + related
            extra = related + [pool[i % len(pool)] for i in range(rest)]
    docs = list(question.gold) + extra
    return [docs[i] for i in rng.permutation(len(docs)).tolist()]


def generate(spec: QASpec, rng: np.random.Generator, size: int, length: int, index: int,
             ctx) -> Draft:
    """Sample `index`'s prompt: its question over its documents and `size` others."""
    if spec.path is None:
        raise UserError(f"{spec.name} needs a QA file: the qa_file setting (select_tasks)")
    data = load_qa(spec.path, spec.dataset)
    question = data.questions[index % len(data.questions)]
    order = pick_documents(rng, question, len(data.docs), size)
    context = "\n\n".join(DOCUMENT.format(i=i + 1, document=data.docs[d])
                          for i, d in enumerate(order))
    return Draft(text=QA_TEMPLATE.format(context=context, query=question.query),
                 answer_prefix=QA_PREFIX, references=list(question.answers))
