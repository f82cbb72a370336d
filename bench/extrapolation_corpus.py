"""The training corpus of `bench/extrapolation.py`: the BPE tokenizer it trains, and with --corpus
DIR the megatron indexed dataset it builds from DIR's text files, the validation share that
`trainer.eval` needs, and how many epochs the training makes."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.data.corpus_files import collect_files, parse_patterns

DEFAULT_VALID_FRACTION = 0.05  # DataConfig's default: kept when it already holds enough
MANY_EPOCHS = 2.0  # more passes over the corpus text than this are worth a warning
LISTING = "corpus_files.txt"  # in --work: the files a --corpus run's dataset holds


def fail(message: str) -> None:
    """A user error: one `error:` line and exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def train_tokenizer(path: Path, vocab: int, texts: Iterable[str]) -> None:
    """Byte-level BPE on `texts`; eod is `<|endoftext|>` (JsonTokenizer's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)


def embedded_tokenizer(path: Path, vocab: int, max_documents: int | None) -> None:
    """The tokenizer of the default run: BPE on the embedded corpus (the stdlib's sources)."""
    from trainer.data.datasets import embedded_corpus

    if path.is_file():
        return
    print(f"training a {vocab}-token BPE tokenizer on the embedded corpus -> {path}", flush=True)
    train_tokenizer(path, vocab, (text for _, text in embedded_corpus(
        max_documents=max_documents)))


@dataclass
class Corpus:
    """A --corpus dataset and the facts results.json's meta records about it."""

    directories: list[str]
    globs: list[str]
    files: int
    bytes: int
    skipped: dict[str, int]
    tokenizer_files: int
    tokenizer_bytes: int
    prefix: str
    documents: int
    tokens: int
    min_valid_tokens: int
    valid_fraction: float
    valid_tokens: int = 0
    train_samples: int = 0
    epochs: float = 0.0

    def overrides(self) -> list[str]:
        """`python -m trainer` / `trainer.eval` settings that train and evaluate on it."""
        return ["data.name=indexed", f"data.path={self.prefix}",
                f"data.valid_fraction={self.valid_fraction:g}"]

    def meta(self) -> dict[str, Any]:
        return asdict(self)


def build_corpus(directories: list[Path], globs: str, work: Path, vocab: int, sample_mb: float,
                 max_files: int | None, min_valid_tokens: int,
                 run: Callable[[str, list[str], Path], None]) -> Corpus:
    """Collect the directories' files, train the tokenizer on them (a bounded sample when they
    are large), build `work/corpus` with `python -m trainer.build_data --files-from` (through
    `run`), and choose data.valid_fraction so that the validation split holds
    `min_valid_tokens` when the corpus allows. A rerun with the same `work` reuses the tokenizer
    and the dataset (refused if the files differ)."""
    from trainer.data.datasets import indexed_valid_fraction

    patterns = parse_patterns(globs)
    roots = [d.resolve() for d in directories]
    nested = [f"{a} in {b}" for a in roots for b in roots if a != b and a.is_relative_to(b)]
    if nested or len(set(roots)) < len(roots):
        fail(f"--corpus: directories overlap ({', '.join(nested) or 'given twice'}), so files "
             "would be read twice; give each directory once and none inside another")
    found = []
    for directory in directories:  # each directory's files in order, the directories in turn
        left = None if max_files is None else max_files - sum(len(c.files) for c in found)
        if left is not None and left <= 0:
            break
        found.append(collect_files(directory, patterns, left))
        print(f"corpus: {found[-1].describe()}, patterns {','.join(patterns)}", flush=True)
    files = [p for c in found for p in c.files]
    total = sum(c.bytes for c in found)
    if not files:
        fail(f"--corpus {' '.join(map(str, directories))}: no readable UTF-8 file matches "
             f"--corpus-glob {globs}; name another directory or other patterns")
    listing, tokenizer, prefix = work / LISTING, work / "tokenizer.json", work / "corpus"
    text = "".join(f"{p}\n" for p in files)
    if listing.is_file() and listing.read_text(encoding="utf-8") != text:
        fail(f"--work {work} holds a dataset of other files ({listing}); give another --work, "
             "or delete it to start over")
    if not listing.is_file() and tokenizer.is_file():
        fail(f"--work {work} holds a run on the embedded corpus (its {tokenizer}); give "
             "another --work for --corpus, or delete it to start over")
    tmp = listing.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, listing)

    # Each directory gives its share of the sample, by bytes.
    sample = [p for c in found for p in c.sample(int(sample_mb * 1e6 * c.bytes / total))]
    sample_bytes = sum(p.stat().st_size for p in sample)
    if tokenizer.is_file():
        print(f"reusing {tokenizer}", flush=True)
    else:
        share = "all of them" if len(sample) == len(files) else (
            f"a sample: {len(sample)} of {len(files)} files, {sample_bytes / 1e6:.1f} of "
            f"{total / 1e6:.1f} MB, spread over the corpus by a hash of the path "
            "(--tokenizer-sample-mb)")
        print(f"training a {vocab}-token BPE tokenizer on {share} -> {tokenizer}", flush=True)
        train_tokenizer(tokenizer, vocab, (p.read_text(encoding="utf-8") for p in sample))

    if Path(f"{prefix}.meta.json").is_file():
        print(f"reusing {prefix}", flush=True)
    else:
        run("trainer.build_data", ["--files-from", str(listing), "--output-prefix", str(prefix),
                                   "--tokenizer", str(tokenizer), "--overwrite"],
            work / "build_data.log")
    built = json.loads(Path(f"{prefix}.meta.json").read_text())
    needed = indexed_valid_fraction(str(prefix), min_valid_tokens)
    fraction = 0.5 if needed is None else max(DEFAULT_VALID_FRACTION, needed)
    skipped = {why: sum(c.skipped[why] for c in found) for why in found[0].skipped}
    return Corpus([str(c.root) for c in found], patterns, len(files), total, skipped,
                  len(sample), sample_bytes, str(prefix), built["documents"], built["tokens"],
                  min_valid_tokens, fraction)


def count_epochs(corpus: Corpus, tokenizer: Path, seq: int, samples: int,
                 retrieval_fraction: float) -> None:
    """Fill in the split's sizes and the epochs `samples` training samples make; log them."""
    from trainer.data.datasets import build_datasets

    train, valid, _ = build_datasets("indexed", corpus.prefix, str(tokenizer), seq,
                                     corpus.valid_fraction, seed=0)
    corpus.valid_tokens, corpus.train_samples = len(valid.stream), len(train)
    corpus.epochs = samples / len(train)
    enough = "enough" if corpus.valid_tokens >= corpus.min_valid_tokens else \
        "NOT enough: the corpus is too small; trainer.eval reads fewer perplexity windows"
    print(f"corpus: {corpus.documents} documents, {corpus.tokens} tokens; data.valid_fraction="
          f"{corpus.valid_fraction:g} holds out {corpus.valid_tokens} validation tokens "
          f"({enough} for {corpus.min_valid_tokens}: the perplexity windows of the longest "
          f"length and the multi-key filler); {len(train)} training samples of {seq} tokens",
          flush=True)
    print(f"training: {samples} samples = {corpus.epochs:.2f} epochs of the training split "
          f"(retrieval examples replace {retrieval_fraction:.0%} of the samples)", flush=True)
    passes = corpus.epochs * (1 - retrieval_fraction)
    if passes > MANY_EPOCHS:
        print(f"WARNING: the model will see each corpus token ~{passes:.1f} times; add --corpus "
              "directories for a larger corpus", flush=True)
