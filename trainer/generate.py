"""`python -m trainer.generate checkpoint.load=DIR prompt='Once upon' max_new_tokens=64`

Text from a checkpoint (TP=1, CPU or GPU), printed as it comes: greedy (`temperature=0`, the
default) or sampled (`temperature=0.8 top_p=0.95 seed=1`), the prompt given inline or as a file
(`prompt_file=PATH`). The model is loaded as `trainer.eval` loads it, with the attention it was
trained with (or this command line's: `+attention=dca ...`). Each token costs one forward of
that token against a KV cache (trainer/kv_cache.py); `kv_cache=false` recomputes the whole
sequence per token instead (the reference the cache is tested against). A prompt plus
`max_new_tokens` longer than the model can attend (its own context length, for standard and
chunked attention; DCA has no limit) is refused.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from ckpt.reader import Checkpoint
from ckpt.saved_config import literal
from models.schema import AttentionConfig
from trainer.config import CONF_DIR, TrainConfig, command_line_overrides, register_configs
from trainer.entry import check_overrides, exits_on_user_error
from trainer.errors import UserError
from trainer.evals.decoding import REPLACEMENT


@dataclass
class GenerateConfig(TrainConfig):
    """The run config (for the checkpoint, tokenizer and device) plus generation settings."""

    prompt: str | None = None
    prompt_file: str | None = None  # the prompt's text from a file (instead of `prompt`)
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this much probability
    seed: int = 0
    stop_at_eod: bool = True  # stop after the tokenizer's end-of-document token
    kv_cache: bool = True  # false: a forward of the whole sequence per token


register_configs()
ConfigStore.instance().store(name="generate_config", node=GenerateConfig)


def _attention(cfg: DictConfig, ckpt: Checkpoint) -> DictConfig:
    """The checkpoint's attention, unless this command line sets one."""
    if any(o.lstrip("+~").startswith("attention") for o in command_line_overrides()):
        return cfg.attention
    return OmegaConf.merge(OmegaConf.structured(AttentionConfig),
                           literal(asdict(ckpt.meta.attention)))


def context_limit(ckpt: Checkpoint, attention: DictConfig) -> int | None:
    """The most tokens the model attends: its own context length (ckpt/hf_export.py's
    `model_max_positions`); None for DCA, whose relative positions never exceed its chunk."""
    from ckpt.hf_export import model_max_positions

    return None if attention.kind == "dca" else model_max_positions(ckpt)


def prompt_text(cfg: DictConfig) -> str:
    if (cfg.prompt is None) == (cfg.prompt_file is None):
        raise UserError("give the prompt as prompt='...' or prompt_file=PATH (exactly one)")
    if cfg.prompt_file is not None:
        return Path(cfg.prompt_file).read_text()
    return str(cfg.prompt)


def check_settings(cfg: DictConfig) -> None:
    if cfg.max_new_tokens < 1:
        raise UserError(f"max_new_tokens={cfg.max_new_tokens}: generate at least 1 token")
    if cfg.temperature < 0 or not 0 < cfg.top_p <= 1:
        raise UserError(f"temperature={cfg.temperature}, top_p={cfg.top_p}: need temperature "
                        ">= 0 (0: greedy) and 0 < top_p <= 1")
    if cfg.parallel.tp != 1 or cfg.parallel.pp != 1 or cfg.parallel.cp != 1:
        raise UserError("trainer.generate runs on one process: set parallel.tp=1 (pp=1, cp=1)")


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generator: torch.Generator | None) -> torch.Tensor:
    """The next token [b, 1] from logits [b, vocab]: argmax at temperature 0, else a draw from
    the softmax at `temperature` restricted to the top-p nucleus."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the nucleus keeps the top token
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    pick = torch.multinomial(sorted_probs.cpu(), 1, generator=generator).to(order.device)
    return order.gather(-1, pick)


def generate(cfg: DictConfig, emit: Callable[[str], None] = lambda text: None) -> list[int]:
    """The new tokens for `cfg` (a GenerateConfig); their text goes to `emit` as it comes."""
    from parallel.distributed import initialize_parallel, shutdown
    from trainer.data.tokenizer import load_tokenizer
    from trainer.eval import checkpoint_data, load_model
    from trainer.init_from import open_load
    from trainer.rope_override import typed_model_keys, with_rope_overrides
    from trainer.validate import check_model, placement

    check_settings(cfg)
    if cfg.checkpoint.load is None:
        raise UserError("give the checkpoint: checkpoint.load=DIR")
    text = prompt_text(cfg)
    ckpt = open_load(cfg.checkpoint.load)
    attention = _attention(cfg, ckpt)
    data = checkpoint_data(cfg, ckpt.meta)
    prompt = load_tokenizer(data.tokenizer).encode(text)
    if not prompt:
        raise UserError("the prompt is empty: give at least one token of text")
    total = len(prompt) + cfg.max_new_tokens
    limit = context_limit(ckpt, attention)
    if limit is not None and total > limit:
        raise UserError(f"the prompt ({len(prompt)} tokens) plus max_new_tokens "
                        f"({cfg.max_new_tokens}) is {total} tokens; this {attention.kind}-"
                        f"attention model attends {limit}: shorten the prompt or lower "
                        "max_new_tokens (or run it with +attention=dca)")
    model_cfg = with_rope_overrides(cfg.model, literal(asdict(ckpt.meta.model)),
                                    typed_model_keys(command_line_overrides()),
                                    ckpt.meta.seq_length, total)
    check_model(model_cfg, attention, cfg.parallel)
    run = OmegaConf.merge(cfg, {"attention": attention, "eval": {"lengths": [total]}})
    device, bf16 = placement(cfg.trainer.device, cfg.trainer.precision)
    initialize_parallel(device, 1, cfg.seed)
    try:
        model, tokenizer = load_model(run, model_cfg, data.tokenizer, ckpt, device, bf16)
        generator = torch.Generator().manual_seed(cfg.seed)
        return _decode(model, tokenizer, prompt, cfg, device, generator, emit)
    finally:
        shutdown()


def _decode(model, tokenizer, prompt: list[int], cfg: DictConfig, device: torch.device,
            generator: torch.Generator, emit: Callable[[str], None]) -> list[int]:
    from trainer.evals.decoding import logits_of
    from trainer.kv_cache import CachedDecoder

    tokens = torch.tensor([prompt], device=device)
    cache = CachedDecoder(model, tokenizer.vocab_size) if cfg.kv_cache else None
    new: list[int] = []
    shown = ""
    with torch.no_grad():
        logits = cache.prefill(tokens) if cache else logits_of(model, tokens,
                                                               tokenizer.vocab_size)[:, -1]
        while True:
            token = sample(logits, cfg.temperature, cfg.top_p, generator)  # [1, 1]
            new.append(int(token))
            done = len(new) == cfg.max_new_tokens or (cfg.stop_at_eod
                                                      and new[-1] == tokenizer.eod)
            text = tokenizer.decode(new)
            text = text if done else text.rstrip(REPLACEMENT)  # a character may be unfinished
            if text.startswith(shown) and len(text) > len(shown):
                emit(text[len(shown):])
                shown = text
            if done:
                return new
            tokens = torch.cat([tokens, token], dim=1)
            logits = cache.step(token) if cache else logits_of(model, tokens,
                                                               tokenizer.vocab_size)[:, -1]


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="generate")
@exits_on_user_error
def main(cfg: DictConfig) -> None:
    start = time.perf_counter()
    new = generate(cfg, emit=lambda text: print(text, end="", flush=True))
    print(flush=True)
    seconds = time.perf_counter() - start
    print(f"{len(new)} tokens in {seconds:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    check_overrides(sys.argv[1:], config_name="generate")
    main()
