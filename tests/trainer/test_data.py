"""Data pipeline: tokenizers, embedded corpus, splits, datasets, resumable iteration, build_data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.build_data import main as build_main
from trainer.data.datasets import (
    ByteTokenizer,
    DataIterator,
    JsonTokenizer,
    TokenStreamDataset,
    _hash_names,
    build_datasets,
    embedded_corpus,
    load_tokenizer,
    split_by_hash,
    tokenize_embedded,
    validation_batches,
)

DOCS = ["first document: héllo wörld ✓", "second\nline two\n", "third " * 50]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def corpus() -> list[tuple[str, str]]:
    return embedded_corpus()


def _word_tokenizer(path: Path, specials: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", *specials])
    tok.train_from_iterator(["hello world", "the quick brown fox", "hello fox"], trainer)
    tok.save(str(path))
    return path


def _write_inputs(tmp_path: Path) -> list[Path]:
    jsonl = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": DOCS[0], "id": 1}), "", json.dumps({"text": ""}),
             json.dumps({"text": DOCS[1]})]
    jsonl.write_text("\n".join(lines) + "\n", encoding="utf-8")
    txt = tmp_path / "doc.txt"
    txt.write_text(DOCS[2], encoding="utf-8")
    return [jsonl, txt]


def _documents_of(stream: np.ndarray, eod: int) -> list[list[int]]:
    """Split a token stream back into documents at eod."""
    cuts = np.flatnonzero(stream == eod)
    return [stream[a + 1 if i else 0:b].tolist() for i, (a, b) in enumerate(zip([-1, *cuts], cuts))]


def test_byte_tokenizer_round_trip() -> None:
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 257 and tok.eod == 256
    text = "def f(x):\n    return 'ünïcødé ✓'\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.encode_arrays([text])[0].tolist() == ids
    assert tok.decode(ids + [tok.eod]) == text
    assert tok.decode([0xFF]) == "\ufffd"


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="byte"):
        load_tokenizer("gpt2")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_json_tokenizer(tmp_path: Path) -> None:
    with_eod = JsonTokenizer(_word_tokenizer(tmp_path / "a.json", ["<|endoftext|>"]))
    assert with_eod.eod == 1 and with_eod.vocab_size == 8
    ids = with_eod.encode("hello fox")
    assert ids == with_eod.encode_batch(["hello fox"])[0]
    assert ids == with_eod.encode_arrays(["hello fox"])[0].tolist()
    assert with_eod.eod not in ids
    assert with_eod.decode(ids + [with_eod.eod]) == "hello fox"

    without = load_tokenizer(str(_word_tokenizer(tmp_path / "b.json", [])))
    assert isinstance(without, JsonTokenizer)
    assert without.eod == 7 and without.vocab_size == 8  # appended after the 7-entry vocab
    assert without.name != with_eod.name


def test_embedded_corpus(corpus: list[tuple[str, str]]) -> None:
    names = [n for n, _ in corpus]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert len(corpus) > 300 and sum(len(t) for _, t in corpus) > 5_000_000
    assert sum(len(t) > 50_000 for _, t in corpus) >= 5
    assert not any(part in {"test", "tests", "idle_test", "site-packages"}
                   for n in names for part in n.split("/")[:-1])
    assert [n for n, _ in embedded_corpus(max_documents=5)] == names[:5]
    assert all(len(t) >= 20_000 for _, t in embedded_corpus(min_chars=20_000))


def test_tokenized_corpus_cache(tmp_path: Path, corpus: list[tuple[str, str]]) -> None:
    tok = ByteTokenizer()
    first = tokenize_embedded(tok, max_documents=20, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("embedded-*.npz"))) == 1
    again = tokenize_embedded(tok, max_documents=20, cache_dir=tmp_path)
    assert again.names == first.names == [n for n, _ in corpus[:20]]
    np.testing.assert_array_equal(again.tokens, first.tokens)
    docs = _documents_of(first.tokens, tok.eod)
    assert [tok.decode(d) for d in docs] == [t for _, t in corpus[:20]]


def test_split_deterministic_and_disjoint(corpus: list[tuple[str, str]], cache_dir: str) -> None:
    names = [n for n, _ in corpus]
    train, valid = split_by_hash(_hash_names(names), 0.05)
    again = split_by_hash(_hash_names(names), 0.05)
    np.testing.assert_array_equal(train, again[0])
    np.testing.assert_array_equal(valid, again[1])
    assert not set(train) & set(valid) and len(train) + len(valid) == len(names)
    assert 0.02 < len(valid) / len(names) < 0.1
    # Tiny corpora still get both sides; valid_fraction=0 means no validation documents.
    assert all(len(s) == 1 for s in split_by_hash(_hash_names(names[:2]), 0.05))
    assert len(split_by_hash(_hash_names(names), 0.0)[1]) == 0

    a = build_datasets("embedded", None, "byte", 512, 0.05, seed=0, cache_dir=cache_dir)
    b = build_datasets("embedded", None, "byte", 512, 0.05, seed=0, cache_dir=cache_dir)
    c = build_datasets("embedded", None, "byte", 512, 0.05, seed=1, cache_dir=cache_dir)
    np.testing.assert_array_equal(a[0].stream, b[0].stream)
    np.testing.assert_array_equal(a[1].stream, c[1].stream)  # validation independent of seed
    assert len(a[0].stream) == len(c[0].stream) and not np.array_equal(a[0].stream, c[0].stream)


def test_dataset_samples_and_batches(cache_dir: str) -> None:
    train, valid, tok = build_datasets("embedded", None, "byte", 64, 0.05, seed=0,
                                       max_documents=30, cache_dir=cache_dir)
    assert len(train) == (len(train.stream) - 1) // 64 and len(valid) > 0
    sample = train[3]
    assert sample.dtype == torch.int64 and sample.shape == (65,)
    assert sample[-1] == train[4][0]  # consecutive samples share one boundary token
    with pytest.raises(IndexError):
        train[len(train)]
    batch = next(DataIterator(train, micro_batch_size=4, seed=0))
    assert batch["tokens"].shape == batch["labels"].shape == batch["loss_mask"].shape == (4, 64)
    assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
    vb = validation_batches(valid, 4, 2)
    assert len(vb) == 2 and torch.equal(vb[0]["tokens"][0], valid[0][:-1])
    assert torch.equal(vb[1]["labels"][3], valid[7][1:])


def test_iterator_resume_is_exact() -> None:
    ds = TokenStreamDataset(np.arange(10 * 23 + 1), 10)  # 23 samples: epochs wrap often
    it = DataIterator(ds, micro_batch_size=4, seed=7)
    batches = [next(it) for _ in range(20)]
    assert it.state_dict() == {"consumed_samples": 80}
    firsts = [int(b["tokens"][i, 0]) // 10 for b in batches for i in range(4)]
    assert sorted(firsts[:23]) == list(range(23))  # each epoch is a permutation
    assert firsts[:23] != list(range(23)) and firsts[:23] != firsts[23:46]
    for k in (0, 5, 13):
        resumed = DataIterator(ds, micro_batch_size=4, seed=7, consumed_samples=k * 4)
        for expected in batches[k:]:
            got = next(resumed)
            assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_dp_sharding_covers_global_batch() -> None:
    ds = TokenStreamDataset(np.arange(8 * 42 + 1), 8)  # 7 global batches per epoch
    whole = DataIterator(ds, micro_batch_size=6, seed=3, consumed_samples=12)
    ranks = [DataIterator(ds, 2, seed=3, consumed_samples=12, dp_rank=r, dp_size=3)
             for r in range(3)]
    for _ in range(20):
        shards = [next(r)["tokens"] for r in ranks]
        expected = next(whole)["tokens"]
        assert torch.equal(torch.cat(shards), expected)
        assert len({int(t[0]) for t in expected}) == 6  # no sample twice in a global batch
    assert {r.state_dict()["consumed_samples"] for r in ranks} == {whole.consumed_samples}


def test_build_data_round_trip(tmp_path: Path) -> None:
    prefix = str(tmp_path / "out" / "ds")
    assert build_main([*map(str, _write_inputs(tmp_path)), "--output-prefix", prefix]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == \
        ["ds.bin", "ds.idx", "ds.meta.json"]
    meta = json.loads(Path(prefix + ".meta.json").read_text())
    assert meta["documents"] == 3 and meta["dtype"] == "uint16"

    tok = ByteTokenizer()
    train, valid, _ = build_datasets("indexed", prefix, "byte", 16, 0.0, seed=0)
    assert len(valid.stream) == 0 and len(validation_batches(valid, 2, 2)) == 0
    full = train.stream[0:len(train.stream)]
    assert len(full) == meta["tokens"]
    assert sorted(_documents_of(full, tok.eod)) == sorted(tok.encode(d) for d in DOCS)
    for a, b in [(0, 5), (3, 40), (30, 200), (0, len(full))]:  # slices across documents
        np.testing.assert_array_equal(train.stream[a:b], full[a:b])
    np.testing.assert_array_equal(train[2].numpy(), full[32:49])

    train2, valid2, _ = build_datasets("indexed", prefix, "byte", 16, 0.5, seed=0)
    assert len(train2.stream) + len(valid2.stream) == len(full)
    assert len(train2.stream) > 0 and len(valid2.stream) > 0


def test_build_data_json_tokenizer(tmp_path: Path) -> None:
    tok_path = str(_word_tokenizer(tmp_path / "tok.json", ["<|endoftext|>"]))
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "hello world"}) + "\n" +
                                      json.dumps({"body": "the quick fox"}) + "\n")
    prefix = str(tmp_path / "ds")
    args = [str(tmp_path / "a.jsonl"), "--output-prefix", prefix, "--tokenizer", tok_path]
    assert build_main([*args, "--text-key", "body"]) == 0
    train, _, tok = build_datasets("indexed", prefix, tok_path, 2, 0.0, seed=0)
    docs = _documents_of(train.stream[0:len(train.stream)], tok.eod)
    assert sorted(docs) == sorted([tok.encode("hello world"), tok.encode("the quick fox")])
    with pytest.raises(ValueError, match="built with tokenizer"):
        build_datasets("indexed", prefix, "byte", 2, 0.0, seed=0)


def test_build_data_refuses_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    inputs = [str(p) for p in _write_inputs(tmp_path)]
    prefix = str(tmp_path / "ds")
    assert build_main([inputs[1], "--output-prefix", prefix]) == 0
    before = Path(prefix + ".bin").read_bytes()
    assert build_main([inputs[0], "--output-prefix", prefix]) == 2  # user error: exit 2
    assert "--overwrite" in capsys.readouterr().err
    assert Path(prefix + ".bin").read_bytes() == before
    assert build_main([inputs[0], "--output-prefix", prefix, "--overwrite"]) == 0
    assert Path(prefix + ".bin").read_bytes() != before
    assert not list(tmp_path.glob("*.tmp-*"))


def test_build_data_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"other": 1}\n')
    assert build_main([str(bad), "--output-prefix", str(tmp_path / "ds")]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert not list(tmp_path.glob("ds*"))  # no partial output left behind
    with pytest.raises(SystemExit) as exc:
        build_main(["--help"])
    assert exc.value.code == 0
    with pytest.raises(ValueError, match="unknown dataset"):
        build_datasets("web", None, "byte", 8, 0.05, seed=0)
    with pytest.raises(FileNotFoundError, match="build_data"):
        build_datasets("indexed", str(tmp_path / "nope"), "byte", 8, 0.05, seed=0)
