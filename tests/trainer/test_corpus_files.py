"""Directory corpora (trainer/data/corpus_files.py), build_data's directory and --files-from
inputs, and the validation share chosen for a token budget (trainer/data/datasets.py
`smallest_valid_fraction`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainer.build_data import main as build_main
from trainer.data.corpus_files import collect_files, parse_patterns
from trainer.data.datasets import indexed_valid_fraction, smallest_valid_fraction, split_by_hash
from trainer.data.tokenizer import ByteTokenizer

# (relative path, content): what a corpus directory holds; KEPT is what must be collected.
TREE = [
    ("b/z.py", "print('z')\n"), ("a.md", "# title\n"), ("b/a.txt", "notes ✓\n"),
    ("b/c/deep.rst", "Deep\n====\n"), ("a10.py", "x = 10\n"), ("a2.py", "x = 2\n"),
    ("empty.py", ""), ("blank.txt", " \n\t\n"), ("image.png", "not matched"),
    ("__pycache__/m.py", "cached = 1\n"), (".git/hooks.py", "hidden = 1\n"),
]
KEPT = ["a.md", "a10.py", "a2.py", "b/a.txt", "b/c/deep.rst", "b/z.py"]


def _make_tree(root: Path, order: list[tuple[str, str]]) -> Path:
    """The TREE under `root`, created in `order` (directory listings follow creation order on
    many filesystems), plus a non-UTF-8 file and a dangling link."""
    for name, text in order:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "latin1.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    (root / "b" / "gone.py").symlink_to(root / "missing.py")
    return root


def test_collection_is_sorted_filtered_and_independent_of_creation_order(tmp_path: Path) -> None:
    patterns = parse_patterns("*.py, *.md,*.txt,,*.rst")
    assert patterns == ["*.py", "*.md", "*.txt", "*.rst"]
    one = collect_files(_make_tree(tmp_path / "one", TREE), patterns)
    two = collect_files(_make_tree(tmp_path / "two", TREE[::-1]), patterns)
    for corpus in (one, two):
        assert [p.relative_to(corpus.root).as_posix() for p in corpus.files] == KEPT
        assert corpus.skipped == {"unreadable": 1, "not_utf8": 1, "empty": 2}
        assert corpus.bytes == sum(len(t.encode()) for n, t in TREE if n in KEPT)
    assert collect_files(tmp_path / "one", ["*.py"], max_files=2).files == one.files[1:3]
    with pytest.raises(FileNotFoundError, match="corpus directory"):
        collect_files(tmp_path / "nope")


def test_sample_is_bounded_deterministic_and_in_corpus_order(tmp_path: Path) -> None:
    root = tmp_path / "c"
    for i in range(40):
        (root / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (root / f"d{i % 4}" / f"f{i:02d}.py").write_text("y" * (100 + i))
    corpus = collect_files(root, ["*.py"])
    sample = corpus.sample(1000)
    assert sample == collect_files(root, ["*.py"]).sample(1000)
    assert 0 < sum(p.stat().st_size for p in sample) <= 1000 and len(sample) >= 7
    assert sample == [p for p in corpus.files if p in sample]
    assert len({p.parent.name for p in sample}) > 1  # spread, not the first directory
    assert corpus.sample(10**9) == corpus.files
    assert len(corpus.sample(1)) == 1  # never empty


def test_build_data_directory_and_file_list_write_the_same_dataset(tmp_path: Path) -> None:
    root = _make_tree(tmp_path / "src", TREE)
    files = [str(root / n) for n in KEPT]
    listing = tmp_path / "files.txt"
    listing.write_text("\n".join(files) + "\n\n")
    outputs = {}
    for mode, args in {"named": files, "list": ["--files-from", str(listing)],
                       "dir": [str(root), "--glob", "*.py,*.md,*.txt,*.rst"]}.items():
        prefix = tmp_path / mode / "ds"
        assert build_main([*args, "--output-prefix", str(prefix)]) == 0
        outputs[mode] = [Path(f"{prefix}{ext}").read_bytes() for ext in (".bin", ".idx",
                                                                          ".meta.json")]
    assert outputs["list"] == outputs["named"] and outputs["dir"] == outputs["named"]
    meta = json.loads(outputs["named"][2])
    assert meta["documents"] == len(KEPT)
    bin_bytes = np.frombuffer(outputs["named"][0], dtype=meta["dtype"])
    eod = meta["eod"]
    expected = b"".join((root / n).read_bytes() for n in KEPT)  # byte tokenizer: ids = bytes
    assert bytes(bin_bytes[bin_bytes != eod].astype(np.uint8)) == expected
    assert build_main(["--output-prefix", str(tmp_path / "x")]) == 2  # no inputs at all
    assert build_main(["--files-from", str(tmp_path / "no.txt"),
                       "--output-prefix", str(tmp_path / "x")]) == 2


def test_smallest_valid_fraction_matches_a_brute_force_search() -> None:
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(2, 30))
        u, tokens = rng.random(n), rng.integers(1, 100, n)
        need = int(rng.integers(1, tokens.sum() + 50))
        found = smallest_valid_fraction(u, tokens, need, step=0.01)
        ok = [k / 100 for k in range(1, 100)
              if k / 100 > u.min() and tokens[split_by_hash(u, k / 100)[1]].sum() >= need]
        assert found == (ok[0] if ok else None), (trial, found, ok[:3])


def test_indexed_valid_fraction_holds_the_tokens(tmp_path: Path) -> None:
    docs = [tmp_path / f"d{i}.txt" for i in range(30)]
    for i, path in enumerate(docs):
        path.write_text("w" * (50 + 10 * i))
    prefix = str(tmp_path / "ds")
    assert build_main([*map(str, docs), "--output-prefix", prefix]) == 0
    from trainer.data.datasets import build_datasets

    for need in (60, 500, 1500):
        fraction = indexed_valid_fraction(prefix, need)
        _, valid, _ = build_datasets("indexed", prefix, "byte", 8, fraction, seed=0)
        assert len(valid.stream) >= need
        smaller = round(fraction - 1e-4, 10)
        if smaller > 0:  # one step less falls short, unless it is the one document that
            _, fewer, _ = build_datasets("indexed", prefix, "byte", 8, smaller, seed=0)
            held = np.asarray(fewer.stream[0:len(fewer.stream)])  # split_by_hash always holds
            assert len(held) < need or (held == ByteTokenizer().eod).sum() == 1
    assert indexed_valid_fraction(prefix, 10**6) is None
