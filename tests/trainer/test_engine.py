"""The decoding engine (trainer/engine) against recomputation: for every attention kind, the
cached greedy tokens equal a full forward per token (fp32), batched ragged prompts equal one by
one, a prompt prefilled in pieces equals one prefilled whole, the cache at its bucket edges, and
seeded sampling."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from models.gpt import build_model
from models.schema import AttentionConfig, ParallelConfig
from tests.ckpt.longctx_models import CHUNK, MODEL, VARIANTS, VOCAB
from trainer.engine import DecodeEngine, EngineOptions, Sampling
from trainer.engine.engine import LENGTH_MULTIPLE

DCA = AttentionConfig(kind="dca", dca_chunk_size=CHUNK, dca_local_size=4)
# DCA's length scalings, steep enough to move these models' logits: `log` (factors from the
# query's position alone, so a forward of the whole sequence is the reference) on the
# successive and inter parts only; `yarn` (from the length, see the test of its own)
LOG = replace(DCA, dca_scaling="log", dca_scaling_parts="succ_inter", dca_scaling_attn_scale=0.5,
              dca_scaling_floor_scale=CHUNK // 2)
YARN = replace(DCA, dca_scaling="yarn", dca_scaling_attn_scale=0.5,
               dca_scaling_original_length=CHUNK)
KINDS = {**{name: v for name, v in VARIANTS.items()},
         "standard": (MODEL, AttentionConfig()),
         # a local window of 1: the chunk length C - w is odd, positions wrap at odd offsets
         "dca-odd": (MODEL, replace(DCA, dca_local_size=1)),
         "dca-log": (MODEL, LOG)}


def model_of(name: str, seed: int = 0) -> torch.nn.Module:
    model, attention = KINDS[name]
    torch.manual_seed(seed)
    built = build_model(model, attention, ParallelConfig(), vocab_size=VOCAB,
                        max_sequence_length=16 * CHUNK)
    return built.gpt.eval()


def recomputed(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[int]:
    """The greedy choice after `prompt` and each prefix of `tokens`, from one forward of the
    whole sequence without a cache: equal to `tokens` exactly when each is what greedy decoding
    by a forward per token picks (causal attention: a position's logits do not depend on the
    tokens after it)."""
    seq = prompt + tokens[:-1]
    with torch.no_grad():
        logits = model(torch.tensor([seq]), torch.arange(len(seq))[None], None)[0, :, :VOCAB]
    return logits[len(prompt) - 1:].argmax(-1).tolist()


def prompts(n: int, seed: int = 1, lengths: tuple[int, ...] = ()) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = lengths or tuple(int(x) for x in torch.randint(3, 5 * CHUNK, (n,), generator=g))
    return [torch.randint(0, VOCAB, (s,), generator=g).tolist() for s in sizes]


@pytest.mark.parametrize("name", list(KINDS))
def test_cached_greedy_equals_recomputation_for_ragged_batches(single_process, name: str) -> None:
    model = model_of(name)
    batch = prompts(5, lengths=(1, CHUNK - 1, CHUNK, 2 * CHUNK + 3, 3 * CHUNK + 7))
    steps = 2 * CHUNK + 2  # every row crosses at least two chunk boundaries while decoding
    engine = DecodeEngine(model, VOCAB, EngineOptions(max_batch=4))
    together = engine.generate(batch, steps)
    for prompt, tokens in zip(batch, together):
        assert len(tokens) == steps and tokens == recomputed(model, prompt, tokens)
    alone = [DecodeEngine(model, VOCAB, EngineOptions(max_batch=1)).generate([p], steps)[0]
             for p in batch]
    assert alone == together


@pytest.mark.parametrize("name", ["dca-yarn-gated", "chunked-llama3", "standard", "dca-log"])
def test_a_prompt_prefilled_in_pieces_equals_one_prefilled_whole(single_process,
                                                                 name: str) -> None:
    model = model_of(name)
    batch = prompts(3, lengths=(5 * CHUNK + 3, 2 * CHUNK, 7))
    whole = DecodeEngine(model, VOCAB).generate(batch, 9)
    for piece in (CHUNK - 3, CHUNK, 2 * CHUNK + 1):
        pieces = DecodeEngine(model, VOCAB, EngineOptions(prefill_tokens=piece))
        assert pieces.generate(batch, 9) == whole


def test_logits_of_the_engine_equal_the_full_forward(single_process) -> None:
    """Not only the argmax: the prefill's and each step's logits (fp32, 1e-5)."""
    model = model_of("dca-qwen2")
    prompt = prompts(1, lengths=(3 * CHUNK + 1,))[0]
    seen = []
    engine = DecodeEngine(model, VOCAB)
    original = engine._logits

    def record(tokens):
        out = original(tokens)
        seen.append(out.clone())
        return out

    engine._logits = record
    tokens = engine.generate([prompt], 6)[0]
    seq = prompt + tokens
    with torch.no_grad():
        full = model(torch.tensor([seq]), torch.arange(len(seq))[None], None)[0, :, :VOCAB]
    for j, logits in enumerate(seen):
        torch.testing.assert_close(logits[0], full[len(prompt) - 1 + j], rtol=1e-5, atol=1e-5)


def test_a_length_scaling_decodes_by_the_length_when_each_token_is_computed(
        single_process, monkeypatch) -> None:
    """DCA's `yarn` scaling follows the sequence's length: a cached prompt keeps the factors of
    its prefill (its own length) and a generated token takes those of its position + 1. The
    reference is a full forward whose factor table is exactly that, per prompt (the ragged
    prompts prefill together, each row at its own length); prefilled in pieces, the same tokens
    (fp32)."""
    from models.attention.dca import plan
    from models.attention.dca.scaling import token_factors

    torch.manual_seed(0)
    model = build_model(MODEL, YARN, ParallelConfig(), vocab_size=VOCAB,
                        max_sequence_length=16 * CHUNK).gpt.eval()
    scaling = model.decoder.layers[0].self_attention.core_attention.scaling
    batch = prompts(3, seed=4, lengths=(3 * CHUNK + 1, 3 * CHUNK + 1, 2 * CHUNK + 5))
    steps = CHUNK + 3
    seen: list[torch.Tensor] = []
    engine = DecodeEngine(model, VOCAB, EngineOptions(max_batch=4))
    original = engine._logits
    engine._logits = lambda tokens: seen.append(original(tokens)) or seen[-1]
    out = engine.generate(batch, steps)
    pieces = DecodeEngine(model, VOCAB, EngineOptions(max_batch=4, prefill_tokens=CHUNK + 3))
    assert pieces.generate(batch, steps) == out
    assert len(seen) == 1 + steps - 1  # one prefill of the three, then the steps
    for i, (prompt, tokens) in enumerate(zip(batch, out)):
        n, seq = len(prompt), prompt + tokens[:-1]
        pos = torch.arange(len(seq))
        table = token_factors(scaling, CHUNK, pos, torch.where(pos < n, n, pos + 1)).T

        def factors(scaling, chunk_size, seq, bounds, num_parts, dtype, device, *rest,
                    table=table, **options):
            return table[:num_parts, :seq].to(dtype=dtype, device=device)

        monkeypatch.setattr(plan, "query_factors", factors)
        with torch.no_grad():
            full = model(torch.tensor([seq]), pos[None], None)[0, :, :VOCAB]
        monkeypatch.undo()
        # the engine's rows: the prompts longest first (here their order)
        torch.testing.assert_close(seen[0][i], full[n - 1], rtol=1e-5, atol=5e-5)
        for j in range(1, steps):
            torch.testing.assert_close(seen[j][i], full[n - 1 + j], rtol=1e-5, atol=5e-5)
        assert tokens == full[n - 1:].argmax(-1).tolist()


def test_the_cache_at_its_bucket_edges(single_process) -> None:
    """Prompt + new tokens exactly filling a cache bucket, and one more (a bigger bucket)."""
    model = model_of("dca-qwen2")
    engine = DecodeEngine(model, VOCAB)
    edge = prompts(1, lengths=(LENGTH_MULTIPLE - 4,))[0]
    filled = engine.generate([edge], 4)[0]
    assert engine.cache.length == LENGTH_MULTIPLE
    one_more = engine.generate([edge], 5)[0]
    assert engine.cache.length == 2 * LENGTH_MULTIPLE
    assert one_more == recomputed(model, edge, one_more) and filled == one_more[:4]


def test_a_reserved_cache_serves_smaller_batches_and_shorter_prompts(single_process) -> None:
    """One cache (and on a GPU one captured step) for an evaluation: after `reserve`, smaller
    batches and shorter prompts decode in it, spare rows and all, with the tokens a fresh
    engine of their own size gives."""
    model = model_of("dca-qwen2")
    engine = DecodeEngine(model, VOCAB, EngineOptions(max_batch=4))
    engine.reserve(4, 2 * LENGTH_MULTIPLE)
    cache = engine.cache
    for batch in (prompts(4, seed=2), prompts(3, seed=3), prompts(1, seed=4)):
        out = engine.generate(batch, 5)
        assert engine.cache is cache
        assert out == DecodeEngine(model, VOCAB, EngineOptions(max_batch=len(batch))).generate(
            batch, 5)


def test_the_engine_counts_its_tokens_and_splits_its_time(single_process) -> None:
    engine = DecodeEngine(model_of("standard"), VOCAB)
    batch = prompts(3)
    start = time.perf_counter()
    out = engine.generate(batch, [2, 5, 1])
    wall = time.perf_counter() - start
    s = engine.stats
    assert (s.prompts, s.prompt_tokens, s.new_tokens) == (
        3, sum(map(len, batch)), sum(map(len, out))) and [len(t) for t in out] == [2, 5, 1]
    assert s.prefill_s > 0 and s.decode_s > 0 and s.capture_s == 0  # no graphs on the CPU
    assert s.prefill_s + s.decode_s <= wall
    engine.generate(batch[:1], 1)  # a prefill only: the decode time stays
    assert engine.stats.decode_s == s.decode_s and engine.stats.prompts == 4


def test_stop_tokens_and_budgets_per_prompt(single_process) -> None:
    model = model_of("standard")
    batch = prompts(3)
    free = DecodeEngine(model, VOCAB).generate(batch, 12)
    stop = free[1][4]
    out = DecodeEngine(model, VOCAB).generate(batch, [12, 12, 3], stop_tokens=[stop])
    assert out[1] == free[1][:free[1].index(stop) + 1]  # the stop token ends it, included
    assert out[2] == free[2][:3] or stop in out[2]


def test_sampling_is_seeded_per_prompt(single_process) -> None:
    model = model_of("dca-yarn-gated")
    batch = prompts(4)
    hot = Sampling(temperature=1.5, top_p=0.9, seed=3)
    first = DecodeEngine(model, VOCAB, EngineOptions(max_batch=4)).generate(batch, 20, hot)
    again = DecodeEngine(model, VOCAB, EngineOptions(max_batch=2)).generate(batch, 20, hot)
    assert first == again  # the same per prompt whatever the batch
    other = DecodeEngine(model, VOCAB).generate(batch, 20, replace(hot, seed=4))
    assert other != first
    assert first != DecodeEngine(model, VOCAB).generate(batch, 20)  # not greedy


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=float("nan")),
                                 dict(top_p=0.0), dict(top_p=1.5)])
def test_sampling_settings_are_checked(bad: dict) -> None:
    with pytest.raises(ValueError):
        Sampling(**bad)


def test_the_ruler_decode_allocates_one_cache_for_all_its_cells(single_process,
                                                                monkeypatch) -> None:
    """Cells of growing length (a short task first) decode in the one cache reserved for the
    longest: no reallocation (on a GPU: no second graph capture) between cells."""
    from trainer.engine import engine as engine_module
    from trainer.evals.ruler.specs import Sample
    from trainer.evals.ruler_run import decode

    made = []

    class Counted(engine_module.LayerCache):
        def __init__(self, *args, **kwargs) -> None:
            made.append(args[1:])  # (rows, length)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine_module, "LayerCache", Counted)

    class Tokenizer:
        vocab_size, eod = VOCAB, 0

        def decode(self, ids: list[int]) -> str:
            return " ".join(map(str, ids))

    # (task, prompt tokens, new tokens): the short cell first
    cells = [("short", 8, 2), ("short", 8, 2), ("long", LENGTH_MULTIPLE + 8, 3)]
    ids = prompts(3, lengths=tuple(n for _, n, _ in cells))
    samples = [Sample(task, n + m, i, "", "", p, ["x"], m, "string_match_all")
               for i, ((task, n, m), p) in enumerate(zip(cells, ids))]
    texts = decode(model_of("standard"), Tokenizer(), samples, EngineOptions(max_batch=2),
                   progress=False)
    assert made == [(2, 2 * LENGTH_MULTIPLE)] and len(texts) == 3


def test_the_ruler_decode_recomputes_where_the_engine_does_not_run(
        single_process, monkeypatch) -> None:
    """Where the engine does not run (tensor parallelism), the suite decodes by recomputation:
    that path gives the engine's texts, cut after the stop token as the engine stops (DCA, and
    DCA with the position-dependent `log` scaling; fp32)."""
    from trainer.evals import ruler_run
    from trainer.evals.ruler.specs import Sample

    class Tokenizer:
        vocab_size = VOCAB

        def __init__(self, eod: int) -> None:
            self.eod = eod

        def decode(self, ids: list[int]) -> str:
            return " ".join(map(str, ids))

    budgets = [6, 6, 9, 4]
    ids = prompts(4, seed=3, lengths=(2 * CHUNK + 3, 2 * CHUNK + 3, CHUNK + 5, 3 * CHUNK))
    samples = [Sample("t", len(p) + m, i, "", "", p, ["x"], m, "string_match_all")
               for i, (p, m) in enumerate(zip(ids, budgets))]
    options = EngineOptions(max_batch=2)
    model = model_of("dca-qwen2")
    whole = ruler_run.decode(model, Tokenizer(-1), samples, options, progress=False)
    eod = int(whole[2].split()[3])  # a stop token greedy meets mid-answer: a text is cut
    cached = ruler_run.decode(model, Tokenizer(eod), samples, options, progress=False)
    assert len(cached[2].split()) <= 4 < budgets[2]
    monkeypatch.setattr(ruler_run, "engine_takes", lambda model: False)
    assert ruler_run.decode(model, Tokenizer(eod), samples, options, progress=False) == cached
    monkeypatch.undo()
    scaled = model_of("dca-log")
    cached = ruler_run.decode(scaled, Tokenizer(-1), samples, options, progress=False)
    assert [len(t.split()) for t in cached] == budgets
    monkeypatch.setattr(ruler_run, "engine_takes", lambda model: False)
    assert ruler_run.decode(scaled, Tokenizer(-1), samples, options, progress=False) == cached
