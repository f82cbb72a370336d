"""RULER-style suite around the generators (trainer/evals/ruler): task selection and its errors,
QA files (SQuAD and HotpotQA shapes, checked on load), length checks, chat templates, the JSONL
for another harness, and the scores (RULER's string matching, effective length)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.trainer.test_ruler_tasks import ESSAY, train_bpe
from trainer.data.tokenizer import ByteTokenizer, load_tokenizer
from trainer.errors import UserError
from trainer.evals.ruler import (
    REGISTRY,
    Sample,
    SuiteResult,
    build_samples,
    check_lengths,
    effective_length,
    load_chat_template,
    read_jsonl,
    render_chat,
    score_predictions,
    select_tasks,
    string_match_all,
    string_match_part,
    write_jsonl,
)

# a real tokenizer where one is at hand (LONGCTX_SMOLLM_DIR: a SmolLM2 model directory)
SMOLLM = Path(os.environ.get("LONGCTX_SMOLLM_DIR", "/nonexistent"))
CHAT = ("{% for m in messages %}{% if loop.first %}<|im_start|>system\nBe brief.<|im_end|>\n"
        "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def squad(n_articles: int = 6, impossible: bool = True) -> dict:
    return {"version": "v2.0", "data": [{"title": f"t{a}", "paragraphs": [
        {"context": f"Article {a} paragraph {p}. The keeper of gate {a}{p} is named "
                    f"Warden{a}x{p}. " + "Nothing else happened there. " * 8,
         "qas": [{"question": f"Who keeps gate {a}{p}?", "id": f"{a}{p}",
                  "answers": [{"text": f"Warden{a}x{p}", "answer_start": 0}],
                  "is_impossible": False}]
                + ([{"question": "Unanswerable?", "answers": [], "is_impossible": True}]
                   if impossible else [])}
        for p in range(3)]} for a in range(n_articles)]}


def hotpot(n: int = 8) -> list:
    return [{"question": f"Which bridge links town {i} to its twin?", "answer": f"Bridge{i}",
             "context": [[f"Town {i}", [f"Town {i} lies on a river. ", f"It has Bridge{i}."]],
                         [f"Twin {i}", ["The twin town is across the water."]]]}
            for i in range(n)]


def write(path: Path, data) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def test_select_tasks_defaults_and_unknown_names(tmp_path: Path) -> None:
    assert [s.name for s in select_tasks()] == list(REGISTRY)[:11]
    with pytest.raises(UserError, match=r"unknown RULER task\(s\) \['niah_single_9'\].*"
                                        r"niah_single_1.*qa_2"):
        select_tasks(["vt", "niah_single_9"])
    with pytest.raises(UserError, match="qa_1 needs a QA file: set qa_file"):
        select_tasks(["qa_1"])
    sq, hp = write(tmp_path / "sq.json", squad()), write(tmp_path / "hp.json", hotpot())
    assert [s.name for s in select_tasks(None, sq)][-1] == "qa_1"
    assert [s.name for s in select_tasks(None, hp)][-1] == "qa_2"
    both = select_tasks(["qa_1", "qa_2"], {"qa_1": sq, "qa_2": hp})
    assert [(s.name, s.path) for s in both] == [("qa_1", sq), ("qa_2", hp)]


@pytest.mark.parametrize("content, problem", [
    (None, "does not exist"),
    ("{not json", "not readable JSON"),
    ({"foo": 1}, "neither SQuAD- nor HotpotQA-shaped"),
    ([{"question": "q", "answer": "a", "context": [["t", ["s"]]]}], "is hotpotqa-shaped"),
    ({"data": [{"paragraphs": [{"qas": []}]}]}, r"data\[0\]\.paragraphs\[0\] has no string "
                                                 "'context'"),
    ({"data": [{"paragraphs": [{"context": "c", "qas": [{"question": "q"}]}]}]},
     r"qas\[0\] has no list 'answers'"),
    ({"data": [{"paragraphs": [{"context": "c", "qas": []}]}]}, "no answerable question"),
])
def test_bad_qa_files_are_named_with_what_is_wrong(tmp_path: Path, content, problem) -> None:
    path = tmp_path / "qa.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(UserError, match=f"{re.escape(str(path))}.*{problem}"):
        select_tasks(["qa_1"], str(path))


def test_qa_prompts_hold_the_questions_documents(tmp_path: Path) -> None:
    sq = write(tmp_path / "sq.json", squad())
    samples = build_samples(select_tasks(["qa_1"], sq), [3000], 3, ByteTokenizer(),
                            progress=False)
    for i, s in enumerate(samples):  # sample i asks the i-th answerable question
        article, paragraph = divmod(i, 3)
        assert s.references == [f"Warden{article}x{paragraph}"]
        assert f"Question: Who keeps gate {article}{paragraph}?" in s.input
        assert s.input.count(f"named Warden{article}x{paragraph}.") == 1
        numbers = [int(n) for n in re.findall(r"^Document (\d+):$", s.input, re.M)]
        assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) > 5
        for other in {0, 1, 2} - {paragraph}:  # its article's other paragraphs come first
            assert f"Article {article} paragraph {other}." in s.input
        assert s.input.endswith("Question: Who keeps gate " + f"{article}{paragraph}? Answer:")
        assert 0.9 * 3000 <= len(s.prompt_ids) + 32 <= 3000
        assert s.metric == "string_match_part"
    hp = write(tmp_path / "hp.json", hotpot())
    s = build_samples(select_tasks(["qa_2"], hp), [1000], 1, ByteTokenizer(), progress=False)[0]
    assert s.references == ["Bridge0"]
    assert "Town 0\nTown 0 lies on a river. It has Bridge0." in s.input
    assert "Twin 0\nThe twin town is across the water." in s.input


def test_check_lengths_names_each_short_task(tmp_path: Path) -> None:
    specs = select_tasks(["niah_single_1", "vt", "cwe"])
    check_lengths(specs, [3000], ByteTokenizer())
    with pytest.raises(UserError, match=r"vt at 600 \(minimum \d+\); cwe at 600 \(minimum \d+\)"
                                        r".*vocab_words=True") as e:
        check_lengths(specs, [600, 3000], ByteTokenizer())
    assert "niah_single_1" not in str(e.value) and "3000" not in str(e.value)
    with pytest.raises(UserError, match="positive integers"):
        check_lengths(specs, [0], ByteTokenizer())


def test_chat_template_wraps_the_task_and_counts_toward_the_length(tmp_path: Path) -> None:
    assert render_chat(CHAT, "hi") == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>"
                                       "user\nhi<|im_end|>\n<|im_start|>assistant\n")
    bpe = train_bpe(tmp_path / "bpe")
    base = build_samples([REGISTRY["niah_single_1"]], [2000], 1, bpe, progress=False)[0]
    chat = build_samples([REGISTRY["niah_single_1"]], [2000], 1, bpe, progress=False,
                         chat_template=CHAT)[0]  # format 'auto': chat
    assert base.input.startswith("A special magic number") and chat.input.startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nA special magic number")
    assert chat.input.endswith("<|im_end|>\n<|im_start|>assistant\n" + chat.answer_prefix)
    assert chat.answer_prefix == base.answer_prefix
    assert chat.prompt_ids[0] == bpe.encode("<|im_start|>")[0]  # the marker is one token
    assert len(chat.prompt_ids) + 128 <= 2000 and chat.input.count("The grass") < \
        base.input.count("The grass")  # the chat wrapping took haystack's room
    forced_base = build_samples([REGISTRY["niah_single_1"]], [2000], 1, bpe, progress=False,
                                chat_template=CHAT, template="base")[0]
    assert forced_base.input == base.input
    with pytest.raises(UserError, match="'chat' needs the tokenizer's chat template"):
        build_samples([REGISTRY["vt"]], [2000], 1, bpe, template="chat", progress=False)
    with pytest.raises(UserError, match="does not parse"):
        build_samples([REGISTRY["vt"]], [2000], 1, bpe, chat_template="{% for %}",
                      progress=False)


def test_load_chat_template(tmp_path: Path) -> None:
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": CHAT}]}))
    assert load_chat_template(tmp_path) == CHAT
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path) == "J"


@pytest.mark.skipif(not (SMOLLM / "tokenizer.json").is_file(), reason="no local SmolLM2")
def test_a_real_tokenizer_and_its_chat_template() -> None:
    tok = load_tokenizer(str(SMOLLM))
    specs = select_tasks(["niah_multikey_1", "vt", "cwe", "fwe"])
    samples = build_samples(specs, [4096], 1, tok, text_source=ESSAY, vocab_words=True,
                            chat_template=load_chat_template(SMOLLM), progress=False)
    for s in samples:
        assert s.input.startswith("<|im_start|>system\nYou are a helpful AI assistant")
        assert 0.97 * 4096 <= len(s.prompt_ids) + s.max_new_tokens <= 4096


def test_jsonl_round_trip(tmp_path: Path) -> None:
    samples = build_samples(select_tasks(["niah_multivalue", "fwe"]), [1500], 2,
                            ByteTokenizer(), text_source=ESSAY, progress=False)
    path = write_jsonl(samples, tmp_path / "out" / "ruler.jsonl")
    assert read_jsonl(path) == samples
    assert [p.name for p in path.parent.iterdir()] == ["ruler.jsonl"]  # no temporary left
    first = json.loads(path.read_text().splitlines()[0])
    assert first["input"] + first["answer_prefix"] == samples[0].input
    assert first["outputs"] == samples[0].references and first["length"] == 1500
    assert {"index", "task", "answer_prefix", "max_new_tokens", "metric"} <= set(first)


def sample(task: str, length: int, refs: list[str], metric: str = "string_match_all") -> Sample:
    return Sample(task, length, 0, "prompt", "", [1], refs, 8, metric)


def test_string_matching_is_rulers() -> None:
    assert string_match_all("The number is 1234567.", ["1234567"]) == 100.0
    assert string_match_all("It is 7654321 (a distractor's)", ["1234567"]) == 0.0
    values = ["111", "222", "333", "444"]
    assert string_match_all("111, 333 and 444", values) == 75.0  # fraction found
    assert string_match_all("ABC-def", ["abc-DEF"]) == 100.0  # case-insensitive
    assert string_match_part("Paris, or maybe Lyon", ["london", "paris"]) == 100.0
    assert string_match_part("Berlin", ["london", "paris"]) == 0.0


def test_scores_averages_and_effective_length() -> None:
    samples = [sample("niah_single_1", 4096, ["12"]), sample("niah_single_1", 4096, ["34"]),
               sample("qa_1", 4096, ["x", "y"], "string_match_part"),
               sample("niah_single_1", 8192, ["56"]),
               sample("qa_1", 8192, ["z"], "string_match_part")]
    result = score_predictions(samples, ["12", "no", "Y!", "56", "z"])
    cells = {(s.task, s.length): (s.score, s.samples) for s in result.scores}
    assert cells == {("niah_single_1", 4096): (50.0, 2), ("qa_1", 4096): (100.0, 1),
                     ("niah_single_1", 8192): (100.0, 1), ("qa_1", 8192): (100.0, 1)}
    assert result.averages == {4096: 75.0, 8192: 100.0}
    assert result.effective_length is None  # 4096 is below 85.6, so nothing counts
    assert score_predictions(samples, ["12", "34", "x", "56", "z"]).effective_length == 8192
    again = SuiteResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again == result
    assert "average" in result.table()
    with pytest.raises(ValueError, match="5 samples but 4 predictions"):
        score_predictions(samples, ["a"] * 4)


def test_effective_length_rule() -> None:
    assert effective_length({4096: 95, 8192: 90, 16384: 86.0, 32768: 70}) == 16384
    assert effective_length({4096: 95, 8192: 80, 16384: 90}) == 4096  # a dip ends it
    assert effective_length({4096: 85.6, 8192: 90}) is None  # "above": strictly
    assert effective_length({}) is None
    assert effective_length({4096: 60, 8192: 55}, threshold=50) == 8192
    for bad in (0, -1, 100.5):
        with pytest.raises(UserError, match=r"threshold must be in \(0, 100\]"):
            effective_length({4096: 90}, threshold=bad)
