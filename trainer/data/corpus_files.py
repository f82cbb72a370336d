"""Text files under a directory, as a deterministic corpus (`build_data DIR`, the benches).

    files = collect_files(Path("/usr/lib/python3/dist-packages"), ["*.py", "*.md"])

The same directory and patterns give the same list in the same order on every run and machine
layout: paths sorted by their POSIX path relative to the directory, hidden directories and
`__pycache__` not entered, and files that cannot be read, are not UTF-8 or hold no text skipped
(counted, so the caller can say so).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PATTERNS = ("*.py", "*.md", "*.txt", "*.rst")
SKIP_DIRS = frozenset({"__pycache__"})


@dataclass
class CorpusFiles:
    """The collected files (absolute paths, in corpus order) and what was left out."""

    root: Path
    files: list[Path] = field(default_factory=list)
    bytes: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: {"unreadable": 0, "not_utf8": 0,
                                                              "empty": 0})

    def describe(self) -> str:
        """One line for a log: how many files and bytes, and what was skipped."""
        left_out = ", ".join(f"{n} {why}" for why, n in self.skipped.items() if n) or "none"
        return (f"{len(self.files)} files, {self.bytes / 1e6:.1f} MB of text under {self.root} "
                f"(skipped: {left_out})")

    def sample(self, max_bytes: int) -> list[Path]:
        """A deterministic subset of at most `max_bytes` (at least one file) spread over the
        whole corpus: files ranked by a hash of their relative path, taken while they fit,
        returned in corpus order."""
        def rank(path: Path) -> bytes:
            return hashlib.sha256(path.relative_to(self.root).as_posix().encode()).digest()

        chosen, total = set(), 0
        for path in sorted(self.files, key=rank):
            size = path.stat().st_size
            if chosen and total + size > max_bytes:
                continue
            chosen.add(path)
            total += size
        return [p for p in self.files if p in chosen]


def parse_patterns(spec: str) -> list[str]:
    """'*.py,*.md' -> ['*.py', '*.md'] (blank entries dropped)."""
    return [p.strip() for p in spec.split(",") if p.strip()]


def collect_files(root: Path, patterns: Sequence[str] = DEFAULT_PATTERNS,
                  max_files: int | None = None,
                  skip_dirs: frozenset[str] = SKIP_DIRS) -> CorpusFiles:
    """Every file under `root` whose name matches one of `patterns` (fnmatch), sorted by relative
    path, not entering hidden directories or `skip_dirs`; unreadable, non-UTF-8 and empty (or
    whitespace-only) files are skipped. `max_files` keeps the first N kept files (toy runs)."""
    root = root.resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus directory not found: {root}")
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        rel = Path(dirpath).relative_to(root)
        names += [(rel / f).as_posix() for f in filenames
                  if any(fnmatch.fnmatchcase(f, p) for p in patterns)]
    corpus = CorpusFiles(root)
    for name in sorted(names):
        path = root / name
        try:
            data = path.read_bytes()
        except OSError:
            corpus.skipped["unreadable"] += 1
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            corpus.skipped["not_utf8"] += 1
            continue
        if not text.strip():
            corpus.skipped["empty"] += 1
            continue
        corpus.files.append(path)
        corpus.bytes += len(data)
        if max_files is not None and len(corpus.files) >= max_files:
            break
    return corpus
