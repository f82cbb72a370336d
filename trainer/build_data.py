"""Build a megatron indexed dataset (.bin/.idx) from text and JSONL files.

    python -m trainer.build_data corpus.jsonl notes/*.txt --output-prefix data/mycorpus
    python -m trainer.build_data src/ --glob '*.py,*.md' --output-prefix data/code
    python -m trainer.build_data --files-from files.txt --output-prefix data/mycorpus

Train on it with `data.name=indexed data.path=data/mycorpus` (and the same `data.tokenizer`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import stat
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ckpt.destination import DestinationError, check_writable
from parallel.lifetime import Interrupted, interruptible
from trainer.data.corpus_files import DEFAULT_PATTERNS, collect_files, parse_patterns
from trainer.data.tokenizer import load_tokenizer
from trainer.entry import USER_ERRORS, debug_requested, report_user_error
from trainer.errors import UserError

_BATCH_DOCS = 256  # documents per encode_batch call: enough for `tokenizers` to parallelise


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.build_data",
        description="Tokenize text/JSONL files into a megatron indexed dataset (PREFIX.bin, "
                    "PREFIX.idx) plus PREFIX.meta.json recording the tokenizer. Every document "
                    "is followed by the tokenizer's end-of-document id.",
        epilog="Files ending in .jsonl hold one JSON object per line, one document each (the "
               "--text-key field); any other file is one UTF-8 text document. Documents are "
               "written in the order given. A directory INPUT stands for its files matching "
               "--glob, sorted by relative path; its unreadable, non-UTF-8 and empty files are "
               "skipped (a named file that is not UTF-8 is an error).")
    parser.add_argument("inputs", nargs="*", type=Path, metavar="INPUT",
                        help="text or .jsonl files, or directories")
    parser.add_argument("--files-from", type=Path, metavar="LIST",
                        help="a file naming one input file per line, relative to the working "
                             "directory (read after the INPUTs; for more files than a command "
                             "line holds)")
    parser.add_argument("--glob", default=",".join(DEFAULT_PATTERNS),
                        help="comma-separated file-name patterns for directory inputs "
                             "(default: %(default)s)")
    parser.add_argument("--output-prefix", required=True,
                        help="output path without extension, e.g. data/mycorpus")
    parser.add_argument("--tokenizer", default="byte",
                        help="'byte' (default), a `tokenizers` JSON file, or a Hugging Face "
                             "model directory (its tokenizer.json; end of document: its "
                             "tokenizer_config.json eos_token)")
    parser.add_argument("--text-key", default="text",
                        help="JSONL field holding the document text (default: text)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing dataset at the output prefix")
    return parser.parse_args(argv)


def expand_inputs(inputs: list[Path], files_from: Path | None = None,
                  patterns: list[str] | None = None) -> list[Path]:
    """The input files in order: each INPUT (a directory: its `collect_files`), then the
    --files-from list's lines (blank lines ignored)."""
    files: list[Path] = []
    for path in inputs:
        if path.is_dir():
            corpus = collect_files(path, patterns or DEFAULT_PATTERNS)
            print(f"{path}: {corpus.describe()}", file=sys.stderr)
            files += corpus.files
        else:
            files.append(path)
    if files_from is not None:
        if not files_from.exists():
            raise FileNotFoundError(f"--files-from: no file {files_from}")
        if not files_from.is_file():
            raise UserError(f"--files-from {files_from} is not a regular file "
                            f"({_kind(files_from)}): write the list of inputs to a file")
        files += [Path(line) for line in files_from.read_text(encoding="utf-8").splitlines()
                  if line.strip()]
    if not files:
        raise UserError("no input files: name files or directories, or --files-from LIST")
    return files


def _kind(path: Path) -> str:
    mode = path.stat().st_mode
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO or pipe"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _documents(path: Path, text_key: str, progress: tqdm) -> Iterator[str]:
    """Documents of one input file; advances `progress` by bytes read."""
    if path.suffix != ".jsonl":
        data = path.read_bytes()
        progress.update(len(data))
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"{path}: not UTF-8 text ({err})") from err
        return
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            progress.update(len(line))
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{lineno}: invalid JSON ({err})") from err
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise UserError(f"{path}:{lineno}: no string field {text_key!r}")
            try:  # JSON escapes can spell half a surrogate pair, which no tokenizer encodes
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise UserError(f"{path}:{lineno}: field {text_key!r} holds a lone surrogate "
                                f"({err.object[err.start]!r}); fix that \\u escape") from err
            yield text


def build(inputs: list[Path], output_prefix: str, tokenizer: str = "byte",
          text_key: str = "text", overwrite: bool = False) -> dict[str, int | str]:
    """Write the dataset under temporary names and rename when complete; returns a summary."""
    missing = [str(p) for p in inputs if not p.exists()]
    if missing:
        raise FileNotFoundError(f"input files not found: {', '.join(missing)}")
    for path in inputs:
        if not path.is_file():
            raise UserError(f"{path} is not a regular file ({_kind(path)}): give text or .jsonl "
                            "files (a directory named as an INPUT stands for its --glob files)")
    _check_prefix(output_prefix)
    outputs = {ext: Path(f"{output_prefix}{ext}") for ext in (".bin", ".idx", ".meta.json")}
    existing = [str(p) for p in outputs.values() if p.exists()]
    if existing and not overwrite:
        raise UserError(f"output exists: {', '.join(existing)} (pass --overwrite)")

    tok = load_tokenizer(tokenizer)
    with warnings.catch_warnings():  # megatron.core warns about optional GPU kernels on import
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    dtype = DType.optimal_dtype(tok.vocab_size)
    outputs[".bin"].parent.mkdir(parents=True, exist_ok=True)
    tmp = {ext: p.with_name(f"{p.name}.tmp-{os.getpid()}") for ext, p in outputs.items()}
    builder = IndexedDatasetBuilder(str(tmp[".bin"]), dtype=dtype)
    eod = np.array([tok.eod], dtype=dtype)
    documents = tokens = skipped = 0

    def flush(batch: list[str]) -> None:
        nonlocal documents, tokens
        for ids in tok.encode_arrays(batch):
            builder.add_item(torch.from_numpy(np.concatenate([ids, eod]).astype(dtype)))
            builder.end_document()
            documents += 1
            tokens += len(ids) + 1
        batch.clear()

    try:
        total = sum(p.stat().st_size for p in inputs)
        with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing") as progress:
            batch: list[str] = []
            for path in inputs:
                for text in _documents(path, text_key, progress):
                    if not text:
                        skipped += 1
                        continue
                    batch.append(text)
                    if len(batch) >= _BATCH_DOCS:
                        flush(batch)
            flush(batch)
        if not documents:
            raise UserError(f"no documents in {', '.join(map(str, inputs))}: every input is "
                            "empty, so nothing was written; give files that hold text")
        builder.finalize(str(tmp[".idx"]))
        meta = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "eod": tok.eod,
                "dtype": np.dtype(dtype).name, "documents": documents, "tokens": tokens}
        tmp[".meta.json"].write_text(json.dumps(meta, indent=2) + "\n")
        for ext in (".bin", ".idx", ".meta.json"):  # meta last: it marks a complete dataset
            os.replace(tmp[ext], outputs[ext])
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise UserError(f"no space left on device (ENOSPC) while writing {output_prefix}.bin/"
                        f".idx: nothing was written (the partial files were removed); free "
                        f"space, or choose another --output-prefix ({err.strerror})") from err
    finally:
        with contextlib.suppress(OSError):  # closing flushes: on a full disk that fails too
            builder.data_file.close()
        for p in tmp.values():
            p.unlink(missing_ok=True)
    return {"documents": documents, "tokens": tokens, "skipped_empty": skipped,
            "dtype": np.dtype(dtype).name, "tokenizer": tok.name,
            **{ext.lstrip("."): str(p) for ext, p in outputs.items()}}


def _check_prefix(prefix: str) -> None:
    """A file prefix (`data/corpus`) in a directory that exists or can be made and written."""
    if prefix.replace(os.sep, "/").rsplit("/", 1)[-1] in ("", ".", ".."):
        raise UserError(f"--output-prefix {prefix} names a directory, not a file prefix (it "
                        f"would write the hidden {prefix}.bin); give e.g. {prefix.rstrip('/')}"
                        "/corpus")
    try:
        check_writable(Path(prefix).resolve())
    except DestinationError as err:
        raise UserError(f"--output-prefix {prefix}: {err}") from None


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = _parse_args(argv)
    try:
        with interruptible():  # SIGTERM unwinds too: the temporary files are removed
            inputs = expand_inputs(args.inputs, args.files_from, parse_patterns(args.glob))
            summary = build(inputs, args.output_prefix, args.tokenizer, args.text_key,
                            args.overwrite)
    except USER_ERRORS as err:
        if debug_requested():
            raise
        report_user_error(err)
        return 2
    except Interrupted as err:
        print(f"error: {err}; nothing was written", file=sys.stderr)
        return 128 + err.signum
    print(f"wrote {summary['documents']} documents, {summary['tokens']} tokens "
          f"({summary['dtype']}, tokenizer {summary['tokenizer']}; "
          f"{summary['skipped_empty']} empty documents skipped)")
    for key in ("bin", "idx", "meta.json"):
        print(f"  {summary[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
