"""Tiny random Hugging Face models of each supported family, built locally with transformers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from ckpt.hf_import import import_hf

VOCAB = 300  # not a multiple of 128: the import pads it
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-6)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
FAMILIES = {
    # Llama 3.1-style: llama3 rope scaling, untied output layer.
    "llama": lambda tied: LlamaForCausalLM(LlamaConfig(
        **COMMON, tie_word_embeddings=tied,
        rope_parameters=dict(rope_theta=50000.0, **LLAMA3))),
    # Qwen2: q/k/v biases.
    "qwen2": lambda tied: Qwen2ForCausalLM(Qwen2Config(
        **COMMON, tie_word_embeddings=tied, rope_parameters=dict(rope_type="default",
                                                                 rope_theta=1e6))),
    # YaRN rope scaling on a Llama (Qwen2.5-style long-context configs use it).
    "llama-yarn": lambda tied: LlamaForCausalLM(LlamaConfig(
        **COMMON, tie_word_embeddings=tied, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0,
            original_max_position_embeddings=16))),
    # SmolLM2-style: a Llama with plain RoPE (no scaling of its own).
    "llama-plain": lambda tied: LlamaForCausalLM(LlamaConfig(
        **COMMON, tie_word_embeddings=tied, rope_parameters=dict(rope_type="default",
                                                                 rope_theta=100000.0))),
    "mistral": lambda tied: MistralForCausalLM(MistralConfig(
        **COMMON, tie_word_embeddings=tied, sliding_window=None)),
}


def save_hf(directory: Path, family: str, tied: bool, seed: int = 0, **save_kwargs) -> Path:
    """A random fp32 model of `family` saved with save_pretrained (safetensors)."""
    torch.manual_seed(seed)
    model = FAMILIES[family](tied).float()
    with torch.no_grad():  # biases start at zero; random ones make the test see them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory, **save_kwargs)
    return directory


TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def main(argv):\n    return sum(int(x) for x in argv)\n",
    "There is an important piece of information hidden inside a lot of irrelevant text.",
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
]


def save_tokenizer(directory: Path, eos: str = "<|end_of_text|>", vocab_size: int = 290,
                   eos_as_dict: bool = False, text: list[str] | None = None) -> Path:
    """A byte-level BPE `tokenizers` tokenizer trained here on a few strings (every byte is a
    token, so any text encodes), saved as tokenizer.json with a tokenizer_config.json naming
    `eos` (a special token of the vocabulary) as Hugging Face models do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text or TOKENIZER_TEXT, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eos], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    token = {"content": eos, "special": True} if eos_as_dict else eos
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": token}))
    return directory


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


# One save and one import per (family, tied[, tp]) per pytest process, shared by every module
# that asks: the HF tests spent most of their time re-importing the same models.
_SAVED: dict[tuple[str, bool], Path] = {}
_IMPORTED: dict[tuple[str, bool, int], Path] = {}


@pytest.fixture(scope="session")
def hf_imported(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Path]]:
    """`get(family, tied, tp=1)` -> (HF dir, imported checkpoints root), made once per session.
    Tests must not modify either (write elsewhere). Call it while no process group exists
    (before `single_process`): a TP=1 import then runs in this process, not a spawned one."""

    def get(family: str, tied: bool, tp: int = 1) -> tuple[Path, Path]:
        name = f"{family}-{'tied' if tied else 'untied'}"
        if (family, tied) not in _SAVED:
            _SAVED[family, tied] = save_tokenizer(
                save_hf(tmp_path_factory.mktemp(name) / "hf", family, tied))
        hf = _SAVED[family, tied]
        if (family, tied, tp) not in _IMPORTED:
            dst = tmp_path_factory.mktemp(f"{name}-tp{tp}") / "ckpt"
            import_hf(hf, dst, tp)
            _IMPORTED[family, tied, tp] = dst
        return hf, _IMPORTED[family, tied, tp]

    return get
