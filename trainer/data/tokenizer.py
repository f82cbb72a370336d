"""Tokenizers: byte-level (no files needed) and HuggingFace `tokenizers` JSON files.

Both expose the same small interface: `vocab_size`, `eod`, `name` (a fingerprint used to key
on-disk caches), `encode`, `encode_batch`, `encode_arrays` and `decode`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from trainer.errors import UserError


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    eod: int
    name: str

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def token_dtype(vocab_size: int) -> type[np.integer]:
    """Smallest numpy dtype that holds every id of a vocabulary."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus an end-of-document id 256."""

    vocab_size: int = 257
    eod: int = 256
    name: str = "byte"

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode several texts."""
        return [self.encode(t) for t in texts]

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """Encode straight into uint16 arrays; far faster than lists for large corpora."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint16) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; eod ids are dropped and invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if int(i) != self.eod).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A `tokenizers` JSON file (as saved by `Tokenizer.save` or shipped with HF models).

    `eod` is the id of `eod_token` when the vocabulary has it. Otherwise it is a new id appended
    after the vocabulary (`vocab_size` grows by one); no text ever encodes to that id, so the
    separator can never be confused with content. Encoding adds no special tokens (no BOS/EOS
    post-processing): document boundaries are the data pipeline's job.
    """

    def __init__(self, path: str | Path, eod_token: str = "<|endoftext|>") -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {self.path}")
        try:
            self._tok = HFTokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises its own Exception subclass with any message
            why = " ".join(str(e).split())[:200]
            raise UserError(f"{self.path}: not a `tokenizers` JSON file ({why}); give 'byte', a "
                            "tokenizer.json saved by `tokenizers` or a Hugging Face model "
                            "directory holding one") from None
        base = self._tok.get_vocab_size(with_added_tokens=True)
        eod = self._tok.token_to_id(eod_token)
        self.eod: int = base if eod is None else eod
        self.vocab_size: int = max(base, self.eod + 1)
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
        self.name: str = f"json-{digest}-eod{self.eod}"

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special-token post-processing."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode several texts (in parallel inside `tokenizers`)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """Encode into arrays of the smallest dtype that fits the vocabulary."""
        dtype = token_dtype(self.vocab_size)
        return [np.asarray(ids, dtype=dtype) for ids in self.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids back to text; eod ids are dropped."""
        return self._tok.decode([int(i) for i in ids if int(i) != self.eod],
                                skip_special_tokens=False)


DEFAULT_EOD = "<|endoftext|>"


def hf_eos_token(tokenizer_json: Path) -> str | None:
    """The end-of-sequence token a Hugging Face model directory declares: `eos_token` of the
    `tokenizer_config.json` beside its tokenizer.json (a string, or an AddedToken dict with
    "content"), e.g. Llama 3's `<|end_of_text|>` or Qwen2's `<|endoftext|>`; None without one."""
    config = tokenizer_json.parent / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        settings = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{config}: not valid JSON ({e}); fix or remove it") from None
    if not isinstance(settings, dict):
        raise UserError(f"{config}: must hold a JSON object of settings, not a "
                        f"{type(settings).__name__}; fix or remove it")
    eos = settings.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def load_tokenizer(spec: str) -> ByteTokenizer | JsonTokenizer:
    """"byte" -> ByteTokenizer; a path ending in .json, or a directory holding tokenizer.json
    (a Hugging Face model directory), -> JsonTokenizer. The end-of-document token is the model's
    own `eos_token` (tokenizer_config.json beside tokenizer.json) when it declares one, else
    `<|endoftext|>`; either way a new id only if the vocabulary lacks it."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec) / "tokenizer.json" if Path(spec).is_dir() else Path(spec)
    if path.suffix == ".json":
        return JsonTokenizer(path, hf_eos_token(path) or DEFAULT_EOD)
    raise UserError(f"unknown tokenizer {spec!r}: expected 'byte', a `tokenizers` JSON file "
                     "ending in .json or a Hugging Face model directory holding tokenizer.json")
