"""`python -m trainer.generate`: cached decoding against recomputation for every attention kind,
sampling, and the refusal of a prompt longer than the model attends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from tests.ckpt.longctx_models import CHUNK, VARIANTS, write_variant
from tests.module_runs import run_module
from trainer.config import CONF_DIR
from trainer.generate import generate

PROMPT = "The grass is green. "  # 20 byte tokens: 64 more cross four chunk boundaries
TRAINED = 128  # the checkpoints' own length: prompt + 64 fits for standard and chunked layers
_WRITTEN: dict[str, Path] = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    def get(name: str) -> Path:
        if name not in _WRITTEN:
            _WRITTEN[name] = write_variant(tmp_path_factory.mktemp(name) / "ckpt", name,
                                           seq_length=TRAINED)
        return _WRITTEN[name]

    return get


def config(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("generate", overrides=overrides)


@pytest.mark.parametrize("name", [  # two in the quick lane (-m 'not slow'), all four in CI
    pytest.param(name, marks=[pytest.mark.slow] if name in ("dca-yarn-gated", "chunked-llama3")
                 else []) for name in VARIANTS])
def test_cached_greedy_decoding_is_recomputation(checkpoint, name: str) -> None:
    args = [f"checkpoint.load={checkpoint(name)}", f"prompt={PROMPT!r}", "max_new_tokens=64",
            "stop_at_eod=false", "trainer.device=cpu"]
    shown: list[str] = []
    cached = generate(config(args), emit=shown.append)
    assert len(cached[0]) == 64 and len(PROMPT) + 64 > 4 * CHUNK
    assert cached == generate(config(args + ["kv_cache=false"]))
    assert len(shown) > 1  # printed as it came, not at the end


def test_dca_with_a_position_scaling_decodes_cached_as_recomputed(checkpoint) -> None:
    """The `log` scaling's factors follow each query's position: the cache reproduces them."""
    args = [f"checkpoint.load={checkpoint('dca-qwen2')}", f"prompt={PROMPT!r}",
            "max_new_tokens=24", "stop_at_eod=false", "trainer.device=cpu", "+attention=dca"]
    scaled = args + ["attention.dca_scaling=log", "attention.dca_scaling_attn_scale=0.5",
                     f"attention.dca_scaling_floor_scale={CHUNK // 2}"]
    cached = generate(config(scaled))
    assert cached == generate(config(scaled + ["kv_cache=false"]))
    assert cached != generate(config(args))  # the factors change what greedy picks


@pytest.mark.slow  # several seconds: CI runs it, the quick lane leaves it
def test_sampling_is_seeded_and_cached_equals_recomputed(checkpoint) -> None:
    args = [f"checkpoint.load={checkpoint('dca-yarn-gated')}", f"prompt={PROMPT!r}",
            "max_new_tokens=40", "stop_at_eod=false", "temperature=1.5", "top_p=0.9",
            "trainer.device=cpu"]
    first = generate(config(args + ["seed=1"]))
    assert first == generate(config(args + ["seed=1", "kv_cache=false"]))
    assert first != generate(config(args + ["seed=2"]))
    assert first != generate(config(args[:-3] + ["trainer.device=cpu"]))  # not greedy


@pytest.mark.slow  # several seconds: CI runs it, the quick lane leaves it
def test_the_command_prints_text_and_refuses_a_prompt_too_long(checkpoint, tmp_path: Path) -> None:
    ckpt = checkpoint("chunked-llama3")
    ok = run_module("trainer.generate", [f"checkpoint.load={ckpt}", "prompt=Hello",
                                         "max_new_tokens=8", "trainer.device=cpu"], tmp_path)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "tokens in" in ok.stderr and not list(tmp_path.iterdir())  # writes nothing
    (tmp_path / "prompt.txt").write_text("x" * 100)
    # A new interpreter: the entry point's one-line refusal as the command line shows it.
    refused = subprocess.run([sys.executable, "-m", "trainer.generate", f"checkpoint.load={ckpt}",
                              f"prompt_file={tmp_path / 'prompt.txt'}", "max_new_tokens=29"],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "error: the prompt (100 tokens) plus max_new_tokens (29) is 129 tokens; this chunked-"
        "attention model attends 128: shorten the prompt or lower max_new_tokens (or run it "
        "with +attention=dca)"]


@pytest.mark.slow  # several seconds: CI runs it, the quick lane leaves it
def test_many_prompts_decode_in_batches_as_each_alone(checkpoint, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"The grass"\n{"prompt": "def main("}\n\n"x"\n')
    args = [f"checkpoint.load={checkpoint('dca-qwen2')}", "max_new_tokens=20",
            "stop_at_eod=false", "trainer.device=cpu"]
    together = generate(config(args + [f"prompts_file={prompts}", "batch_size=2"]))
    alone = [generate(config(args + [f"prompt={p!r}"]))[0] for p in ("The grass", "def main(", "x")]
    assert together == alone


@pytest.mark.parametrize(("extra", "message"), [
    (["top_p=0"], "top_p"), (["top_p=1.5"], "top_p"), (["temperature=-1"], "temperature"),
    (["temperature=nan"], "temperature"), (["batch_size=0"], "batch_size"),
    (["decode.max_cache_gb=0.000001"], "KV cache .* needs .* decode.max_cache_gb"),
    (["decode.max_cache_gb=-1"], "positive size"),
])
def test_bad_settings_are_one_error_before_the_model(checkpoint, extra: list[str],
                                                     message: str) -> None:
    from trainer.errors import UserError

    args = [f"checkpoint.load={checkpoint('dca-qwen2')}", "prompt=Hello", "trainer.device=cpu"]
    with pytest.raises(UserError, match=message):
        generate(config(args + extra))


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary", None, "dir"])
def test_unreadable_prompt_files_are_refused(checkpoint, tmp_path: Path, content) -> None:
    from trainer.errors import UserError

    path = tmp_path / "p"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    args = [f"checkpoint.load={checkpoint('dca-qwen2')}", f"prompt_file={path}",
            "trainer.device=cpu"]
    with pytest.raises(UserError, match="prompt_file"):
        generate(config(args))
    with pytest.raises(UserError, match="not a regular file"):
        generate(config(args[:1] + ["prompt_file=/dev/zero", "trainer.device=cpu"]))
