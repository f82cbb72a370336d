"""Which `trainer.eval` task fits which length: a task that does not fit a length is skipped
there with one note (a prompt too short for its needles, a validation text too short for a
window), so the default lengths (T, 2T, 4T) run on any checkpoint the trainer can produce."""

from __future__ import annotations

import logging

import numpy as np
from omegaconf import DictConfig

from trainer.errors import UserError
from trainer.evals.passkey import passkey_prompt
from trainer.evals.retrieval import place_needles

log = logging.getLogger(__name__)


def _fits(check, length: int) -> str | None:
    """None when `check(length)` succeeds, else why not."""
    try:
        check(length)
    except UserError as err:
        return str(err)
    return None


def fitting_lengths(tokenizer, stream, e: DictConfig) -> dict[str, list[int]]:
    """The lengths of `e.lengths` each task runs at (passkey, multikey, perplexity)."""
    key = "9" * e.passkey_digits
    rng = np.random.default_rng(0)
    checks = {
        "passkey": lambda n: passkey_prompt(tokenizer, n, 0.5, key),
        "multikey": lambda n: place_needles(tokenizer, n, 0.5, e.multikey_keys, e.passkey_digits,
                                            rng, lambda k: [0] * k),
        "perplexity": lambda n: _window(stream, n),
    }
    fit: dict[str, list[int]] = {}
    for task, check in checks.items():
        fit[task], skipped = [], []
        for n in e.lengths:
            why = _fits(check, n)
            if why:
                skipped.append((n, why))
            else:
                fit[task].append(n)
        if skipped and not (task == "multikey" and e.multikey_trials == 0):
            log.warning("eval: %s skipped at length %s: %s", task,
                        ", ".join(str(n) for n, _ in skipped), skipped[0][1])
    if not any(fit.values()):
        raise UserError(f"eval.lengths={list(e.lengths)}: no task fits any of them; raise "
                        "eval.lengths")
    return fit


def _window(stream, length: int) -> None:
    if len(stream) <= length:
        raise UserError(f"the validation text ({len(stream)} tokens) is shorter than one window; "
                        "use more data (data.max_documents, data.valid_fraction)")


GB = 1 << 30


def perplexity_rows(model, vocab_rows: int, e: DictConfig, tp: int, bf16: bool, device) -> int:
    """How many windows of the longest of `e.lengths` the perplexity forwards together: up to
    `e.batch_size`, as many as fit in the device's memory (a GPU's total, the RAM available on
    the CPU), counting the logits [rows, length, vocabulary] whole (the model's, a float copy,
    the log-softmax), the prefill's largest activations and the weights. A UserError, before the
    checkpoint's model is loaded, when not even one fits: one line rather than `can't allocate`
    deep inside the first forward."""
    import psutil
    import torch

    from models.gpt import ffn_hidden_size
    from models.schema import head_dim_of

    length = max(e.lengths)
    itemsize = 2 if bf16 else 4
    h, heads = model.hidden_size, model.num_attention_heads
    qkv = (heads + 2 * (model.num_query_groups or heads)) * head_dim_of(model)
    ffn = ffn_hidden_size(model) * (2 if model.swiglu else 1)  # the MLP's first projection
    layer = h * qkv + heads * head_dim_of(model) * h + h * ffn + ffn_hidden_size(model) * h
    params = model.num_layers * layer + vocab_rows * h * (2 if model.untie_embeddings else 1)
    weights = params * itemsize // tp
    logits = length * vocab_rows * (itemsize + 8)  # one row's
    # the residual stream and its norm, q/k/v, the MLP's first projection and its activation
    prefill = length * (4 * h + qkv + ffn + ffn_hidden_size(model)) * itemsize
    if device.type == "cuda":
        limit, where = torch.cuda.get_device_properties(device).total_memory, "the GPU holds"
    else:
        limit, where = psutil.virtual_memory().available, "of RAM available"
    wanted = max(1, min(e.batch_size, e.perplexity_windows))
    rows = min(wanted, (limit - weights) // (logits + prefill))
    if rows < 1:
        need = weights + logits + prefill
        raise UserError(
            f"eval.lengths={list(e.lengths)}: one sequence of {length} tokens needs about "
            f"{need / GB:.1f} GB (logits [1, {length}, {vocab_rows}]: {logits / GB:.1f} GB, "
            f"the prefill's activations {prefill / GB:.1f} GB, the weights {weights / GB:.1f} "
            f"GB), over the {limit / GB:.1f} GB {where}: lower eval.lengths")
    if rows < wanted:
        log.info("eval: the perplexity at %d tokens forwards %d window(s) at a time (of "
                 "eval.batch_size %d) to fit the %.1f GB %s", length, rows, e.batch_size,
                 limit / GB, where)
    return int(rows)
