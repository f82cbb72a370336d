"""Data pipeline: the embedded stdlib corpus, megatron indexed datasets, splits and batching.

Every dataset is a token stream (documents back to back, each followed by eod) cut into
fixed-length samples; `DataIterator` walks a seeded per-epoch permutation of those samples and is
fully described by `consumed_samples`, which is what exact checkpoint resume relies on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.data.corpus_files import collect_files
from trainer.data.tokenizer import (
    ByteTokenizer,
    JsonTokenizer,
    Tokenizer,
    load_tokenizer,
    token_dtype,
)
from trainer.errors import UserError

__all__ = [
    "ByteTokenizer", "JsonTokenizer", "load_tokenizer", "embedded_corpus", "TokenStreamDataset",
    "IndexedTokenStream", "build_datasets", "indexed_valid_fraction", "DataIterator",
    "validation_batches",
]

logger = logging.getLogger(__name__)

# Directories of the stdlib that are not library source: test suites and installed packages.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                        "idle_test"})
_CACHE_FORMAT = 1
_ENCODE_BATCH = 64


def embedded_corpus(min_chars: int = 0, max_documents: int | None = None) -> list[tuple[str, str]]:
    """The Python standard library's own .py sources as (relative_name, text), sorted by name.

    Exists on every machine without a download and has many 100K+ character documents.
    Test suites, site-packages, blank files and unreadable or non-UTF-8 files are skipped
    (`corpus_files.collect_files`);
    `min_chars` drops shorter files and `max_documents` keeps the first N (for tiny tests).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in collect_files(root, ["*.py"], skip_dirs=_SKIP_DIRS).files:
        text = path.read_text(encoding="utf-8")
        if len(text) >= min_chars:
            docs.append((path.relative_to(root.resolve()).as_posix(), text))
            if max_documents is not None and len(docs) >= max_documents:
                break
    return docs


@dataclass
class TokenizedCorpus:
    """Documents tokenized back to back; document i (its eod included) is
    tokens[offsets[i]:offsets[i + 1]]."""

    names: list[str]
    tokens: np.ndarray
    offsets: np.ndarray

    def stream(self, order: np.ndarray) -> np.ndarray:
        """The token stream of the documents at `order`, in that order."""
        if len(order) == 0:
            return np.empty(0, dtype=self.tokens.dtype)
        return np.concatenate([self.tokens[self.offsets[i]:self.offsets[i + 1]] for i in order])


def default_cache_dir() -> Path:
    """$LONGCTX_CACHE, else ~/.cache/longctx."""
    return Path(os.environ.get("LONGCTX_CACHE", Path.home() / ".cache" / "longctx"))


def tokenize_embedded(tokenizer: Tokenizer, min_chars: int = 0, max_documents: int | None = None,
                      cache_dir: str | Path | None = None) -> TokenizedCorpus:
    """Tokenize the embedded corpus, reusing an on-disk cache keyed by Python build + tokenizer."""
    key_fields = [_CACHE_FORMAT, sys.version, sysconfig.get_paths()["stdlib"], tokenizer.name,
                  min_chars, max_documents]
    key = hashlib.sha256(json.dumps(key_fields).encode()).hexdigest()[:16]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / f"embedded-{key}.npz"
    if path.is_file():
        with np.load(path) as z:
            return TokenizedCorpus([str(n) for n in z["names"]], z["tokens"], z["offsets"])

    docs = embedded_corpus(min_chars, max_documents)
    eod = np.array([tokenizer.eod], dtype=token_dtype(tokenizer.vocab_size))
    pieces = []
    for start in range(0, len(docs), _ENCODE_BATCH):  # batches let `tokenizers` use all cores
        for ids in tokenizer.encode_arrays([t for _, t in docs[start:start + _ENCODE_BATCH]]):
            pieces += [ids, eod]
    tokens = np.concatenate(pieces) if pieces else eod[:0]
    lengths = np.array([len(p) + 1 for p in pieces[::2]], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    corpus = TokenizedCorpus([n for n, _ in docs], tokens, offsets)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}.npz")
        np.savez(tmp, names=np.array(corpus.names), tokens=tokens, offsets=offsets)
        os.replace(tmp, path)  # atomic: a concurrent reader never sees a partial cache
    except OSError as err:  # a read-only home must not stop training, only slow the next start
        logger.warning("could not cache the tokenized corpus at %s: %s", path, err)
    logger.info("tokenized embedded corpus: %d documents, %d tokens (cache %s)",
                len(docs), len(tokens), path)
    return corpus


def _hash_names(names: list[str]) -> np.ndarray:
    """Stable uniform [0, 1) value per name (sha256; Python's hash() is salted per process)."""
    digests = [hashlib.sha256(n.encode("utf-8")).digest()[:8] for n in names]
    return np.array([int.from_bytes(d, "little") for d in digests], dtype=np.float64) / 2.0**64


def _hash_ids(ids: np.ndarray) -> np.ndarray:
    """Stable uniform [0, 1) value per integer id (splitmix64, vectorised for large indexes)."""
    x = ids.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / 2.0**53


def split_by_hash(u: np.ndarray, valid_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, valid) document indices from per-document hashes; both non-empty when possible."""
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    valid = u < valid_fraction
    # A tiny corpus (max_documents) could otherwise end up with no validation or no training data.
    if valid_fraction > 0 and len(u) >= 2 and not valid.any():
        valid[np.argmin(u)] = True
    if len(u) >= 1 and valid.all():
        valid[np.argmax(u)] = False
    return np.flatnonzero(~valid), np.flatnonzero(valid)


def smallest_valid_fraction(u: np.ndarray, doc_tokens: np.ndarray, min_tokens: int,
                            step: float = 1e-4) -> float | None:
    """The smallest multiple of `step` above min(u) whose `split_by_hash(u, fraction)`
    validation documents hold at least `min_tokens` tokens (`doc_tokens[i]`: document i's), or
    None when none does (the corpus is too small). Validation is then the documents of lowest u
    that together reach `min_tokens`, plus any whose u falls in the same `step`."""
    order = np.argsort(u, kind="stable")
    k = int(np.searchsorted(np.cumsum(doc_tokens[order]), min_tokens))  # first cum >= min
    if k >= len(u) - 1:
        return None
    fraction = round((math.floor(u[order[k]] / step) + 1) * step, 10)  # > u of document k
    if fraction >= 1.0:
        return None
    valid = split_by_hash(u, fraction)[1]  # may move one document back to training
    return fraction if doc_tokens[valid].sum() >= min_tokens else None


def indexed_valid_fraction(path: str, min_tokens: int) -> float | None:
    """`smallest_valid_fraction` for the indexed dataset at prefix `path` (data.name=indexed,
    no data.max_documents)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(path)
    seq_bounds = np.concatenate([[0], np.cumsum(ds.sequence_lengths, dtype=np.int64)])
    doc_bounds = np.asarray(ds.document_indices, dtype=np.int64)  # sequence index per document
    doc_tokens = seq_bounds[doc_bounds[1:]] - seq_bounds[doc_bounds[:-1]]
    return smallest_valid_fraction(_hash_ids(np.arange(len(doc_tokens))), doc_tokens, min_tokens)


class IndexedTokenStream:
    """A megatron IndexedDataset's sequences, in a given order, as one lazily read token stream.

    Only the index (lengths) is held in memory; `stream[a:b]` reads just the tokens it covers.
    """

    def __init__(self, dataset: Any, sequence_ids: np.ndarray) -> None:
        self.dataset = dataset
        self.sequence_ids = np.asarray(sequence_ids, dtype=np.int64)
        lengths = dataset.sequence_lengths[self.sequence_ids].astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("IndexedTokenStream supports contiguous slices only")
        pieces = []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            offset = pos - int(self.starts[i])
            n = min(int(self.starts[i + 1]) - pos, stop - pos)
            if n > 0:
                pieces.append(self.dataset.get(int(self.sequence_ids[i]), offset, n))
                pos += n
            i += 1
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)


class TokenStreamDataset(torch.utils.data.Dataset):
    """Sample i = stream[i*S : i*S + S + 1] as int64 (inputs = [:-1], labels = [1:])."""

    def __init__(self, stream: np.ndarray | IndexedTokenStream, seq_length: int) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.stream = stream
        self.seq_length = seq_length

    def __len__(self) -> int:
        return max(len(self.stream) - 1, 0) // self.seq_length

    def __getitem__(self, idx: int) -> torch.Tensor:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        start = idx * self.seq_length
        chunk = self.stream[start:start + self.seq_length + 1]
        return torch.from_numpy(np.asarray(chunk).astype(np.int64))


def _indexed_streams(path: str, tokenizer: Tokenizer, valid_fraction: float, seed: int,
                     max_documents: int | None) -> tuple[IndexedTokenStream, IndexedTokenStream]:
    # Imported here: megatron.core takes seconds to import and the embedded path never needs it.
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if not IndexedDataset.exists(path):
        raise FileNotFoundError(f"no indexed dataset at prefix {path!r} (need {path}.bin and "
                                f"{path}.idx; build one with `python -m trainer.build_data`)")
    meta_path = Path(f"{path}.meta.json")
    if meta_path.is_file():
        built_with = json.loads(meta_path.read_text())["tokenizer"]
        if built_with != tokenizer.name:
            raise UserError(f"{path} was built with tokenizer {built_with!r} but "
                             f"{tokenizer.name!r} was requested")
    if Path(f"{path}.bin").stat().st_size == 0:  # megatron cannot map it (AttributeError later)
        raise UserError(f"data.path={path}: the indexed dataset is empty ({path}.bin has no "
                        "tokens); rebuild it from non-empty inputs with `python -m "
                        "trainer.build_data`")
    ds = IndexedDataset(path)
    doc_bounds = np.asarray(ds.document_indices, dtype=np.int64)
    n_docs = len(doc_bounds) - 1 if max_documents is None else min(max_documents,
                                                                     len(doc_bounds) - 1)
    train, valid = split_by_hash(_hash_ids(np.arange(n_docs)), valid_fraction)
    train = np.random.default_rng(seed).permutation(train)

    def sequences(docs: np.ndarray) -> np.ndarray:
        # Documents may hold several sequences (megatron's sentence splitting): expand them all.
        counts = doc_bounds[docs + 1] - doc_bounds[docs]
        first = np.repeat(doc_bounds[docs] - (np.cumsum(counts) - counts), counts)
        return first + np.arange(int(counts.sum()))

    return IndexedTokenStream(ds, sequences(train)), IndexedTokenStream(ds, sequences(valid))


def build_datasets(name: str, path: str | None, tokenizer: str, seq_length: int,
                   valid_fraction: float, seed: int, max_documents: int | None = None,
                   cache_dir: str | None = None,
                   ) -> tuple[TokenStreamDataset, TokenStreamDataset, Tokenizer]:
    """(train, valid, tokenizer) for "embedded" (stdlib corpus) or "indexed" (`path` prefix).

    The split is by document, from a stable hash of the document's name (embedded) or index
    (indexed), independent of `seed` so validation losses compare across seeds. `seed` orders the
    training documents within the stream; the validation stream keeps corpus order.
    """
    tok = load_tokenizer(tokenizer)
    if name == "embedded":
        corpus = tokenize_embedded(tok, max_documents=max_documents, cache_dir=cache_dir)
        train, valid = split_by_hash(_hash_names(corpus.names), valid_fraction)
        train = np.random.default_rng(seed).permutation(train)
        streams = corpus.stream(train), corpus.stream(valid)
    elif name == "indexed":
        if not path:
            raise UserError("data name 'indexed' needs a path (the .bin/.idx prefix)")
        streams = _indexed_streams(path, tok, valid_fraction, seed, max_documents)
    else:
        raise UserError(f"unknown dataset {name!r}: expected 'embedded' or 'indexed'")
    train_ds, valid_ds = (TokenStreamDataset(s, seq_length) for s in streams)
    logger.info("data %s: %d train / %d validation samples of %d tokens", name, len(train_ds),
                len(valid_ds), seq_length)
    return train_ds, valid_ds, tok


def _collate(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    batch = torch.stack(samples)
    tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    # Every label is a real token: the stream has no padding. The field exists for data that will.
    return {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(labels.shape)}


class DataIterator:
    """Infinite, deterministic, resumable micro-batches for one data-parallel rank.

    Global sample g (g = 0, 1, ...) is sample perm_e[g % N] of epoch e = g // N, where perm_e is a
    permutation drawn from numpy's Generator seeded by (seed, e). Each step consumes one global
    batch of micro_batch_size * dp_size samples; rank r takes the r-th slice. The position is
    therefore just `consumed_samples`, and restoring it reproduces the remaining batches exactly,
    even under a different dp_size. A global batch that straddles an epoch boundary may hold a
    sample twice (once from each epoch). `mix(g, sample)`, when given, may replace global sample
    g (the passkey mix: trainer/evals/passkey.py).
    """

    def __init__(self, dataset: torch.utils.data.Dataset, micro_batch_size: int, seed: int,
                 consumed_samples: int = 0, dp_rank: int = 0, dp_size: int = 1,
                 mix: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> None:
        if len(dataset) == 0:
            raise ValueError("dataset has no samples: the corpus is shorter than seq_length + 1")
        if micro_batch_size < 1 or not 0 <= dp_rank < dp_size or consumed_samples < 0:
            raise ValueError(f"bad iterator arguments: micro_batch_size={micro_batch_size}, "
                             f"dp_rank={dp_rank}, dp_size={dp_size}, consumed={consumed_samples}")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.consumed_samples = consumed_samples
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.mix = mix
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _sample_index(self, g: int) -> int:
        epoch, pos = divmod(g, len(self.dataset))
        if epoch != self._epoch:
            self._perm = np.random.default_rng((self.seed, epoch)).permutation(len(self.dataset))
            self._epoch = epoch
        return int(self._perm[pos])

    def _sample(self, g: int) -> torch.Tensor:
        sample = self.dataset[self._sample_index(g)]
        return self.mix(g, sample) if self.mix else sample

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        first = self.consumed_samples + self.dp_rank * self.micro_batch_size
        samples = [self._sample(g) for g in range(first, first + self.micro_batch_size)]
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return _collate(samples)

    def state_dict(self) -> dict[str, int]:
        """Global samples consumed so far; pass it back as `consumed_samples` to resume."""
        return {"consumed_samples": self.consumed_samples}


def validation_batches(dataset: torch.utils.data.Dataset, micro_batch_size: int,
                       num_batches: int) -> list[dict[str, torch.Tensor]]:
    """The first `num_batches` micro-batches in dataset order (fixed, for comparable eval).

    A dataset shorter than that gives fewer batches, the last possibly partial; empty gives [].
    """
    n = min(len(dataset), micro_batch_size * num_batches)
    return [_collate([dataset[i] for i in range(s, min(s + micro_batch_size, n))])
            for s in range(0, n, micro_batch_size)]
