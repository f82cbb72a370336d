"""How far a head gate added at fine-tune time moves an imported model's function at step 0.

Builds tiny random `transformers` models (tests/ckpt/hf_models.py: a Llama without q/k/v biases,
a Qwen2 with them), imports each (`ckpt.hf_import`), then runs the same random tokens through
the imported model without and with `+attention=head_gate` (gate rows at the documented init:
weight 0.1 x the normal init, bias `head_wise_attn_gate_init_bias` where q/k/v biases exist,
loaded as the trainer's fine-tune start does) and prints one JSON line per (family, bias init):
relative logit difference ||gated - plain|| / ||plain||, top-1 agreement, mean KL(plain||gated),
and the mean gate value sigmoid(g) over heads and tokens.

    python bench/hf_gate_start.py                  # the documented default bias (2.0)
    python bench/hf_gate_start.py --bias 2 4 8     # other bias inits, for comparison only
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt.hf_import import import_hf  # noqa: E402
from ckpt.load import load_fine_tune_start, load_model_weights  # noqa: E402
from ckpt.paths import resolve_checkpoint  # noqa: E402
from ckpt.reader import Checkpoint  # noqa: E402
from models.gpt import build_model  # noqa: E402
from models.schema import AttentionConfig, ParallelConfig  # noqa: E402
from parallel.distributed import initialize_parallel, shutdown  # noqa: E402
from tests.ckpt.hf_models import VOCAB, save_hf  # noqa: E402


def measure(root: Path, bias: float, tokens: torch.Tensor) -> dict[str, float]:
    ckpt = resolve_checkpoint(root)
    model = Checkpoint(ckpt).meta.model
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    gated_attention = replace(AttentionConfig(), head_wise_attn_gate=True,
                              head_wise_attn_gate_init_bias=bias)
    out, gates = {}, []
    for name, attention in (("plain", AttentionConfig()), ("gated", gated_attention)):
        built = build_model(model, attention, ParallelConfig(), vocab_size=VOCAB,
                            max_sequence_length=tokens.shape[1])
        (load_fine_tune_start if attention.head_wise_attn_gate else load_model_weights)(
            ckpt, built.gpt)
        for layer in built.gpt.decoder.layers:
            # Runs after the gate's own hook, which has just split the gate off linear_qkv.
            layer.self_attention.linear_qkv.register_forward_hook(
                lambda m, a, o, attn=layer.self_attention: gates.append(
                    torch.sigmoid(attn._gate.float()).mean().item())
                if getattr(attn, "_gate", None) is not None else None)
        with torch.no_grad():
            out[name] = built.gpt.eval()(tokens, positions, None)[..., :VOCAB].double()
    plain, gated = out["plain"], out["gated"]
    log_p, log_q = plain.log_softmax(-1), gated.log_softmax(-1)
    return {
        "rel_logit_diff": ((gated - plain).norm() / plain.norm()).item(),
        "top1_agreement": (plain.argmax(-1) == gated.argmax(-1)).double().mean().item(),
        "kl_plain_gated": (log_p.exp() * (log_p - log_q)).sum(-1).mean().item(),
        "mean_gate": sum(gates) / len(gates),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bias", type=float, nargs="+", default=[2.0],
                   help="head_wise_attn_gate_init_bias values (used where q/k/v biases exist)")
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args()
    tokens = torch.randint(0, VOCAB, (4, a.tokens), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as d:
        for family, tied in (("llama", False), ("qwen2", True)):
            hf = save_hf(Path(d) / family, family, tied)
            import_hf(hf, Path(d) / f"{family}-ckpt", 1)
            for bias in a.bias if family == "qwen2" else [None]:
                initialize_parallel(torch.device("cpu"), tp=1, seed=0)
                try:
                    row = measure(Path(d) / f"{family}-ckpt", bias or 2.0, tokens)
                finally:
                    shutdown()
                print(json.dumps({"family": family, "gate_bias": bias, **row}), flush=True)


if __name__ == "__main__":
    main()
