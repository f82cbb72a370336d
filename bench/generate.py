"""Generation speed: the decoding engine (what `trainer.generate` and `trainer.eval` run) and the
exported transformers remote code, against transformers' own standard attention on the same
weights.

    python -m bench.generate    # the GPU: gpt_1p3b, bf16, DCA, prefill 32K, decode 256
    python -m bench.generate --model tiny --prefill 64 --decode 8 --dca-chunk 16 --dca-local 4 \\
        --device cpu --dtype fp32 --batch 1,2    # a minute on a CPU

One random model of the `conf/model` shape is built by the trainer's factory and saved twice as
a checkpoint (with `--attention` and with standard attention), each exported with
`python -m ckpt export-hf`'s code. Rows (prompts of `--prefill` random tokens, greedy):
- trainer:     trainer/engine's DecodeEngine on the trainer's model, `--attention`, one row per
               `--batch` size (batch > 1: that many different prompts; decode_tok_s counts the
               tokens of every row);
- remote:      the export's remote code (`trust_remote_code=True`) through `generate()`;
- hf_standard: the standard-attention export as transformers' own Llama (SDPA) through
               `generate()`.
- trainer_recompute: `--recompute` tokens, each a forward of the whole sequence
               (trainer.generate's kv_cache=false, the reference the cache is tested against).
prefill_s is the prompt's forward (with the first token); decode_tok_s is tokens per second
over the `--decode` tokens after it (for generate(), timed by a streamer that sees each token).
`agree` counts the decoded tokens equal to the trainer row's, position by position.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
import yaml

from trainer.config import CONF_DIR


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _write_checkpoints(root: Path, args: argparse.Namespace, device: torch.device) -> None:
    """root/variant and root/standard: the same random weights with the two attention configs."""
    from megatron.core.transformer.module import Float16Module

    from ckpt.meta import CheckpointMeta
    from ckpt.save import write_checkpoint
    from models.gpt import BuildOptions, build_model
    from models.schema import AttentionConfig, ModelConfig, ParallelConfig
    from parallel.placement import Layout

    model = ModelConfig(**yaml.safe_load((Path(CONF_DIR) / "model" / f"{args.model}.yaml")
                                         .read_text()))
    attention = AttentionConfig(kind=args.attention, dca_chunk_size=args.dca_chunk,
                                dca_local_size=args.dca_local, chunk_size=args.dca_chunk)
    bf16 = args.dtype == "bf16"
    built = build_model(model, attention, ParallelConfig(), vocab_size=args.vocab,
                        max_sequence_length=args.prefill + args.decode,
                        options=BuildOptions(bf16=bf16, on_gpu=device.type == "cuda"))
    for name, att in (("variant", attention), ("standard", AttentionConfig())):
        meta = CheckpointMeta(model=model, attention=att, layout=Layout(),
                              seq_length=args.prefill + args.decode, vocab_size=args.vocab,
                              tokenizer="byte", model_only=True)
        write_checkpoint(root / name, 0, {"model": built.gpt.sharded_state_dict(),
                                          "extra": meta.to_saved()})
    gpt = Float16Module(built.config, built.gpt) if bf16 else built.gpt
    return gpt.eval()


def _trainer_row(model, prompt: torch.Tensor, decode: int, vocab: int, batch: int,
                 graphs: bool, device: torch.device) -> dict:
    """The engine's prefill of `batch` prompts (the first is `prompt`) and its decode steps:
    timed through its token callback, after a warm-up call (kernel compilation, the graph)."""
    from trainer.engine import DecodeEngine, EngineOptions

    seed = torch.Generator().manual_seed(1)
    rows = [prompt[0].tolist()] + [torch.randint(0, vocab, (prompt.shape[1],),
                                                 generator=seed).tolist()
                                   for _ in range(batch - 1)]
    engine = DecodeEngine(model, vocab, EngineOptions(max_batch=batch, cuda_graphs=graphs))
    engine.generate(rows, 3)  # warm-up
    times: list[float] = []

    def tick(i: int, tokens: list[int]) -> None:
        if i == 0:
            _sync(device)
            times.append(time.perf_counter())

    _sync(device)
    t0 = time.perf_counter()
    out = engine.generate(rows, decode + 1, on_tokens=tick)
    # times[0]: the first token (after the prefill); times[-1]: the last step's
    steps = len(times) - 1
    engine.release()
    return {"variant": "trainer" if batch == 1 else f"trainer_b{batch}",
            "batch": batch, "cuda_graphs": graphs, "prefill_s": times[0] - t0,
            "decode_tok_s": batch * steps / (times[-1] - times[0]), "tokens": out[0][:decode]}


def _recompute_row(model, prompt: torch.Tensor, steps: int, vocab: int,
                   device: torch.device) -> dict:
    """trainer.generate with kv_cache=false: a forward of the whole sequence per token."""
    from trainer.evals.decoding import logits_of

    seq, tokens = prompt, []
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(steps + 1):
            token = logits_of(model, seq, vocab)[:, -1].argmax(-1, keepdim=True)
            if i == 0:
                _sync(device)
                t1 = time.perf_counter()
            else:
                tokens.append(int(seq[0, -1]))
            seq = torch.cat([seq, token], dim=1)
    _sync(device)
    t2 = time.perf_counter()
    return {"variant": "trainer_recompute", "prefill_s": t1 - t0,
            "decode_tok_s": steps / (t2 - t1), "tokens": tokens}


def _hf_row(name: str, directory: Path, prompt: torch.Tensor, decode: int, dtype: torch.dtype,
            device: torch.device, static: bool = False) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """generate() hands it the prompt, then each new token: the times of those calls."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            _sync(device)
            self.times.append(time.perf_counter())

        def end(self) -> None:
            _sync(device)
            self.times.append(time.perf_counter())

    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True,
                                                 dtype=dtype).to(device).eval()
    mask = torch.ones_like(prompt)

    def run(new: int, model: torch.nn.Module = model) -> tuple[list[float], torch.Tensor]:
        clock = Clock()
        _sync(device)
        clock.times.append(time.perf_counter())
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=mask, max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, streamer=clock,
                                 **({"cache_implementation": "static"} if static else {}))
        return clock.times, out[0, prompt.shape[1]:]

    run(2)  # warm-up (kernel selection, remote code import)
    times, out = run(decode + 1)
    # times: start, prompt handed over, token 0 (after the prefill), tokens 1.., end
    del model
    gc.collect()
    return {"variant": name + ("_static" if static else ""), "prefill_s": times[2] - times[0],
            "decode_tok_s": decode / (times[-2] - times[2]), "tokens": out.tolist()[:decode]}


def bench(args: argparse.Namespace) -> list[dict]:
    from ckpt.hf_export import export_hf
    from parallel.distributed import initialize_parallel, shutdown

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    seed = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab, (1, args.prefill), generator=seed).to(device)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        root = Path(tmp)
        initialize_parallel(device, 1, 0)
        try:
            model = _write_checkpoints(root, args, device)
            for batch in args.batch:
                rows.append(_trainer_row(model, prompt, args.decode, args.vocab, batch,
                                         not args.no_graphs, device))
            if args.recompute:
                rows.append(_recompute_row(model, prompt, args.recompute, args.vocab, device))
            del model
        finally:
            shutdown()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        export_hf(root / "variant", root / "hf_variant")
        export_hf(root / "standard", root / "hf_standard")
        rows.append(_hf_row("remote", root / "hf_variant", prompt, args.decode, dtype, device))
        if args.static_cache:
            rows.append(_hf_row("remote", root / "hf_variant", prompt, args.decode, dtype,
                                device, static=True))
        rows.append(_hf_row("hf_standard", root / "hf_standard", prompt, args.decode, dtype,
                            device))
    for row in rows:
        tokens = row.pop("tokens")
        row["agree"] = sum(a == b for a, b in zip(tokens, rows[0].get("_tokens", tokens)))
        rows[0].setdefault("_tokens", tokens)
        row.update(model=args.model, attention=args.attention, prefill=args.prefill,
                   decode=args.decode, dtype=args.dtype, device=str(device))
    rows[0].pop("_tokens")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_1p3b", help="a conf/model name")
    parser.add_argument("--attention", default="dca", choices=("dca", "chunked"))
    parser.add_argument("--dca-chunk", type=int, default=8192,
                        help="DCA's chunk_size (chunked attention's chunk size)")
    parser.add_argument("--dca-local", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prefill", type=int, default=32768)
    parser.add_argument("--decode", type=int, default=256)
    parser.add_argument("--recompute", type=int, default=8,
                        help="also time this many tokens recomputing the whole sequence each "
                             "(trainer.generate kv_cache=false); 0: skip")
    parser.add_argument("--batch", type=lambda text: [int(x) for x in text.split(",")],
                        default=[1, 16], help="the engine's batch sizes, comma-separated")
    parser.add_argument("--no-graphs", action="store_true",
                        help="the engine's decode steps eagerly (no CUDA graph)")
    parser.add_argument("--static-cache", action="store_true",
                        help="the remote-code row with transformers' static cache")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tmp", default=None, help="where the checkpoints and exports go")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    rows = bench(args)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
