"""`python -m trainer.generate checkpoint.load=DIR prompt='Once upon' max_new_tokens=64`

Text from a checkpoint (TP=1, CPU or GPU), printed as it comes: greedy (`temperature=0`, the
default) or sampled (`temperature=0.8 top_p=0.95 seed=1`), the prompt given inline or as a file
(`prompt_file=PATH`), or many prompts at once (`prompts_file=PATH`: JSON Lines of strings or of
{"prompt": ...}; one JSON line {"index", "text"} per prompt is printed). The model is loaded as
`trainer.eval` loads it, with the attention it was trained with (or this command line's:
`+attention=dca ...`). Decoding runs on the engine (trainer/engine: a static KV cache, batched
prefill, CUDA-graph decode steps; the `decode` group); `kv_cache=false` recomputes the whole
sequence per token instead (the reference the cache is tested against). A prompt plus
`max_new_tokens` longer than the model can attend (its own context length, for standard and
chunked attention; DCA has no limit) or than the cache bound allows is refused.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from ckpt.reader import Checkpoint
from ckpt.saved_config import literal
from trainer.config import CONF_DIR, TrainConfig, command_line_overrides, register_configs
from trainer.entry import arrange_argv, check_overrides, exits_on_user_error
from trainer.errors import UserError

REPLACEMENT = "\ufffd"  # what decoding an unfinished UTF-8 character gives


@dataclass
class GenerateConfig(TrainConfig):
    """The run config (for the checkpoint, tokenizer and device) plus generation settings."""

    prompt: str | None = None
    prompt_file: str | None = None  # the prompt's text from a file (instead of `prompt`)
    prompts_file: str | None = None  # JSON Lines of prompts, decoded in batches of batch_size
    batch_size: int = 16  # prompts of prompts_file decoded together
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this much probability
    seed: int = 0
    stop_at_eod: bool = True  # stop after the tokenizer's end-of-document token
    kv_cache: bool = True  # false: a forward of the whole sequence per token


register_configs()
ConfigStore.instance().store(name="generate_config", node=GenerateConfig)


def context_limit(ckpt: Checkpoint, attention: DictConfig) -> int | None:
    """The most tokens the model attends: its own context length (ckpt/hf_config.py's
    `model_max_positions`); None for DCA, whose relative positions never exceed its chunk."""
    from ckpt.hf_config import model_max_positions

    return None if attention.kind == "dca" else model_max_positions(ckpt)


def prompt_texts(cfg: DictConfig) -> list[str]:
    """The prompt(s): `prompt`, the text of `prompt_file`, or the lines of `prompts_file`."""
    from trainer.text_input import read_text

    given = [k for k in ("prompt", "prompt_file", "prompts_file") if cfg[k] is not None]
    if len(given) != 1:
        raise UserError("give the prompt as prompt='...', prompt_file=PATH or prompts_file=PATH "
                        "(exactly one)")
    if cfg.prompt is not None:
        return [str(cfg.prompt)]
    if cfg.prompt_file is not None:
        return [read_text(cfg.prompt_file, "prompt_file")]
    texts = []
    for n, line in enumerate(read_text(cfg.prompts_file, "prompts_file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"prompts_file line {n}: not JSON ({err.msg}); write one JSON "
                            'string or {"prompt": "..."} per line') from None
        text = row.get("prompt") if isinstance(row, dict) else row
        if not isinstance(text, str):
            raise UserError(f'prompts_file line {n}: expected a string or {{"prompt": "..."}}')
        texts.append(text)
    if not texts:
        raise UserError(f"prompts_file={cfg.prompts_file} holds no prompt")
    return texts


def check_settings(cfg: DictConfig) -> None:
    from trainer.engine import Sampling

    if cfg.max_new_tokens < 1:
        raise UserError(f"max_new_tokens={cfg.max_new_tokens}: generate at least 1 token")
    if cfg.batch_size < 1:
        raise UserError(f"batch_size={cfg.batch_size}: decode at least 1 prompt at a time")
    try:
        Sampling(cfg.temperature, cfg.top_p, cfg.seed)
    except ValueError as err:
        raise UserError(str(err)) from None
    if cfg.parallel.tp != 1 or cfg.parallel.pp != 1 or cfg.parallel.cp != 1:
        raise UserError("trainer.generate runs on one process: set parallel.tp=1 (pp=1, cp=1)")
    if cfg.decode.prefill_tokens < 1:
        raise UserError(f"decode.prefill_tokens={cfg.decode.prefill_tokens}: must be positive")


def generate(cfg: DictConfig, emit: Callable[[str], None] = lambda text: None
             ) -> list[list[int]]:
    """The new tokens of each prompt of `cfg` (a GenerateConfig); with one prompt, its text goes
    to `emit` as it comes."""
    from trainer.data.tokenizer import load_tokenizer
    from trainer.engine.budget import check_cache
    from trainer.eval import checkpoint_data, load_model, run_attention
    from trainer.init_from import open_load
    from trainer.rope_override import typed_model_keys, with_rope_overrides
    from trainer.validate import check_kernel, check_model, placement

    check_settings(cfg)
    if cfg.checkpoint.load is None:
        raise UserError("give the checkpoint: checkpoint.load=DIR")
    texts = prompt_texts(cfg)
    ckpt = open_load(cfg.checkpoint.load)
    attention = run_attention(cfg, ckpt.meta, ckpt.meta.seq_length)
    data = checkpoint_data(cfg, ckpt.meta)
    tokenizer = load_tokenizer(data.tokenizer)
    prompts = [tokenizer.encode(text) for text in texts]
    if not all(prompts):
        raise UserError("a prompt is empty: give at least one token of text")
    longest = max(len(p) for p in prompts)
    total = longest + cfg.max_new_tokens
    limit = context_limit(ckpt, attention)
    if limit is not None and total > limit:
        raise UserError(f"the prompt ({longest} tokens) plus max_new_tokens "
                        f"({cfg.max_new_tokens}) is {total} tokens; this {attention.kind}-"
                        f"attention model attends {limit}: shorten the prompt or lower "
                        "max_new_tokens (or run it with +attention=dca)")
    model_cfg = with_rope_overrides(cfg.model, literal(asdict(ckpt.meta.model)),
                                    typed_model_keys(command_line_overrides()),
                                    ckpt.meta.seq_length, total)
    check_model(model_cfg, attention, cfg.parallel)
    run = OmegaConf.merge(cfg, {"attention": attention, "eval": {"lengths": [total]}})
    device, bf16 = placement(cfg.trainer.device, cfg.trainer.precision)
    check_kernel(cfg.trainer.attention_kernel, cuda=device.type == "cuda")
    if cfg.kv_cache:
        check_cache(model_cfg, len(prompts), total, cfg.batch_size, bf16,
                    cfg.decode.max_cache_gb, device,
                    "shorten the prompt, lower max_new_tokens or batch_size")
    # megatron (seconds of imports) only once every setting and the prompts have passed
    from parallel.distributed import initialize_parallel, shutdown

    initialize_parallel(device, 1, cfg.seed)
    try:
        model, tokenizer = load_model(run, model_cfg, data.tokenizer, ckpt, device, bf16)
        return _decode(model, tokenizer, prompts, cfg, emit)
    finally:
        shutdown()


def _decode(model, tokenizer, prompts: list[list[int]], cfg: DictConfig,
            emit: Callable[[str], None]) -> list[list[int]]:
    from trainer.engine import DecodeEngine, EngineOptions, Sampling

    sampling = Sampling(cfg.temperature, cfg.top_p, cfg.seed)
    stops = [tokenizer.eod] if cfg.stop_at_eod else []
    if not cfg.kv_cache:
        return [_recompute(model, tokenizer, p, cfg.max_new_tokens, sampling, stops, i)
                for i, p in enumerate(prompts)]
    shown = [""]

    def show(i: int, new: list[int]) -> None:  # one prompt: its text as it comes
        done = len(new) == cfg.max_new_tokens or new[-1] in stops
        text = tokenizer.decode(new)
        text = text if done else text.rstrip(REPLACEMENT)  # a character may be unfinished
        if text.startswith(shown[0]) and len(text) > len(shown[0]):
            emit(text[len(shown[0]):])
            shown[0] = text

    engine = DecodeEngine(model, tokenizer.vocab_size, EngineOptions(
        max_batch=cfg.batch_size, prefill_tokens=cfg.decode.prefill_tokens,
        cuda_graphs=cfg.decode.cuda_graphs))
    return engine.generate(prompts, cfg.max_new_tokens, sampling, stops,
                           progress="generate" if len(prompts) > 1 else None,
                           on_tokens=show if len(prompts) == 1 else None)


@torch.no_grad()
def _recompute(model, tokenizer, prompt: list[int], steps: int, sampling, stops: list[int],
               index: int) -> list[int]:
    """A forward of the whole sequence per token (the reference the engine is tested against),
    sampled as the engine samples prompt `index`."""
    from trainer.engine.sampling import Sampler
    from trainer.evals.decoding import logits_of

    device = next(model.parameters()).device
    sampler = Sampler(sampling, [index], device)
    seq = torch.tensor([prompt], device=device)
    new: list[int] = []
    while len(new) < steps and not (new and new[-1] in stops):
        token = sampler(logits_of(model, seq, tokenizer.vocab_size)[:, -1])
        new.append(int(token))
        seq = torch.cat([seq, token[:, None]], dim=1)
    return new


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="generate")
@exits_on_user_error
def main(cfg: DictConfig) -> None:
    start = time.perf_counter()
    if cfg.prompts_file is None:
        new = generate(cfg, emit=lambda text: print(text, end="", flush=True))
        print(flush=True)
    else:
        new = generate(cfg)
        tokenizer = _tokenizer(cfg)
        for i, tokens in enumerate(new):
            print(json.dumps({"index": i, "text": tokenizer.decode(tokens)}), flush=True)
    seconds = time.perf_counter() - start
    print(f"{sum(map(len, new))} tokens in {seconds:.1f} s", file=sys.stderr)


def _tokenizer(cfg: DictConfig):
    from trainer.data.tokenizer import load_tokenizer
    from trainer.eval import checkpoint_data
    from trainer.init_from import open_load

    return load_tokenizer(checkpoint_data(cfg, open_load(cfg.checkpoint.load).meta).tokenizer)


if __name__ == "__main__":
    check_overrides(sys.argv[1:], config_name="generate")
    sys.argv[1:] = arrange_argv(sys.argv[1:])  # Hydra's flags anywhere on the line
    main()
