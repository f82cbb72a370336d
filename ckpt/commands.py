"""The command line of `python -m ckpt`: every command's arguments, and the check of its source
that needs no checkpoint library, in a module that imports none.

A command's own module loads torch, megatron or tensorstore: seconds on a few cores. It is
imported only when the command runs (`_deferred`), after the command's `check` has passed, so
`--help`, a wrong command line and a missing source answer at once. A check is the function its
command starts with (the same refusal, the same message), run before the imports: the source
resolved as the command resolves it. DST is not checked here: each command refuses a problem of
its source's contents before one of DST (`ckpt.destination.staged`), and keeps that order.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

from ckpt.destination import add_destination_arguments
from ckpt.gguf import gguf_file
from ckpt.hf_config import read_config
from ckpt.paths import CHECKPOINT_HELP, resolve_checkpoint
from ckpt.zarr_manifest import manifest_path

Command = Callable[[argparse.Namespace], int]


def _deferred(module: str, name: str = "run") -> Command:
    """`module.name`, imported when the command runs rather than when its parser is built."""
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), name)(args)

    return run


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


def _add_inspect(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "inspect", help="show a checkpoint's step, settings, TP size and tensors",
        description="Show a checkpoint's step, model and attention settings, the TP size it was "
                    "saved at, every tensor's global shape and dtype, and bytes on disk. Reads "
                    "only the index and common state: no tensor data is loaded.")
    p.add_argument("dir", help=CHECKPOINT_HELP)
    p.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    p.set_defaults(run=_deferred("ckpt.inspect"), check=lambda a: resolve_checkpoint(a.dir))


def _add_verify(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "verify", help="read every tensor; optionally compare with another checkpoint",
        description="Read every tensor of a checkpoint and check it is complete and readable: "
                    "all files present and long enough, every file's SHA-256 as recorded at save "
                    "time in checksums.json (naming each changed, missing or extra file), every "
                    "stored item's CRC-32, every pickled object loadable without running code, "
                    "every tensor fully covered by its chunks. With --against, compare the two "
                    "checkpoints tensor by tensor. Exits 1 on any problem or mismatch.")
    p.add_argument("dir", help=CHECKPOINT_HELP)
    p.add_argument("--against", metavar="OTHER",
                   help="compare with this checkpoint: same keys, shapes, dtypes and values")
    p.add_argument("--atol", type=float, default=0.0,
                   help="largest absolute difference that still matches (default 0: bitwise)")
    # OTHER is resolved after DIR is read, so a damaged DIR is named first
    p.set_defaults(run=_deferred("ckpt.verify"), check=lambda a: resolve_checkpoint(a.dir))


def _add_reshape(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "reshape", help="rewrite a checkpoint for another TP / PP size or optimizer format",
        description="Rewrite a training checkpoint for TP=N x PP=M and an optimizer format "
                    "(each defaults to the source's): checks that the model fits (layers per "
                    "stage, heads, query groups, MLP size, vocabulary padding), then N x M CPU "
                    "processes build the model chunks of that layout from the saved config, "
                    "load SRC and save DST, a checkpoints root that `python -m trainer "
                    "checkpoint.load=DST parallel.tp=N parallel.pp=M "
                    "[parallel.distributed_optimizer=...]` resumes from. Needs no GPU. DST "
                    "appears only when complete.")
    p.add_argument("src", help=CHECKPOINT_HELP)
    add_destination_arguments(p, "the new checkpoints root")
    p.add_argument("--target-tp", type=int, metavar="N", help="the new TP size")
    p.add_argument("--target-pp", type=int, metavar="M", help="the new number of pipeline stages")
    p.add_argument("--target-dist-opt", type=_on_off, metavar="on|off",
                   help="the optimizer state in the distributed optimizer's format (on) or the "
                        "plain one (off)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (every tensor's shards, ranks and offsets before and "
                        "after) and write nothing")
    p.add_argument("--model-only", action="store_true",
                   help="write model weights only (no optimizer or scheduler: not resumable)")
    p.add_argument("--verify", action="store_true",
                   help="reload DST and check its tensors are bitwise equal to SRC's")
    p.set_defaults(run=_deferred("ckpt.reshape"), check=lambda a: resolve_checkpoint(a.src))


def _add_zarr(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "export", help="write every tensor as a zarr array (tensorstore)",
        description="Export a checkpoint: every global tensor (model and optimizer state) as a "
                    "zarr v3 array written with tensorstore, chunked along its TP axis, plus "
                    "manifest.json (step, config, shapes, dtypes, TP axes, checksums, the "
                    "[QKV; Gate] split, the common state and RNG states as exact JSON). "
                    "`import` turns it back into a resumable training checkpoint, bit for bit.")
    p.add_argument("src", help=CHECKPOINT_HELP)
    add_destination_arguments(p, "the export directory")
    p.add_argument("--format", choices=["zarr"], required=True, help="the output format")
    p.add_argument("--chunk-tp", type=int, metavar="N",
                   help="align chunks with TP=N ranks' slices (default: the TP size saved at)")
    p.set_defaults(run=_deferred("ckpt.zarr_export", "run_export"),
                   check=lambda a: resolve_checkpoint(a.src))
    p = commands.add_parser(
        "import", help="turn a zarr export back into a training checkpoint",
        description="Write a `python -m ckpt export` directory back as a torch_dist training "
                    "checkpoint (a checkpoints root with one iter_* directory), bit for bit; "
                    "every array is checked against the manifest's SHA-256 first.")
    p.add_argument("src", help="the export directory")
    add_destination_arguments(p, "the new checkpoints root")
    p.set_defaults(run=_deferred("ckpt.zarr_export", "run_import"),
                   check=lambda a: manifest_path(a.src))


def _add_import_hf(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "import-hf", help="import a Hugging Face Llama/Qwen2/Mistral model",
        description="Import a Hugging Face LlamaForCausalLM, Qwen2ForCausalLM or "
                    "MistralForCausalLM directory (config.json + safetensors) as a model-only "
                    "checkpoint at TP=N that `python -m trainer checkpoint.load=DST` fine-tunes "
                    "and `python -m trainer.eval` evaluates. Needs no GPU.")
    p.add_argument("hf_dir", help="the Hugging Face model directory")
    add_destination_arguments(p, "the new checkpoints root")
    p.add_argument("--target-tp", type=int, default=1, metavar="N", help="TP size (default 1)")
    p.add_argument("--dtype", choices=("bf16", "fp32"),
                   help="weights' dtype (default: fp32 if the source is fp32, else bf16)")
    p.add_argument("--dry-run", action="store_true", help="check and describe; write nothing")
    p.set_defaults(run=_deferred("ckpt.hf_import"),
                   check=lambda a: read_config(Path(a.hf_dir).resolve()))


def _check_export_hf(args: argparse.Namespace) -> None:
    if args.max_shard_bytes >= 1:  # else export_hf refuses the shard size first
        resolve_checkpoint(args.src)


def _add_export_hf(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "export-hf", help="export a checkpoint as a Hugging Face Llama/Qwen2 model",
        description="Write a checkpoint (any TP size) as a directory that "
                    "transformers.AutoModelForCausalLM.from_pretrained loads: config.json, "
                    "safetensors and the run's tokenizer files. DCA, chunked and head-gated "
                    "models carry transformers remote code (trust_remote_code=True) that runs "
                    "the attention they were trained with.")
    p.add_argument("src", help=CHECKPOINT_HELP)
    add_destination_arguments(p, "the Hugging Face model directory")
    p.add_argument("--max-shard-bytes", type=int, default=5 * 2**30,
                   help="split model.safetensors into shards with an index above this size")
    p.add_argument("--max-position-embeddings", type=int, metavar="N",
                   help="the context length to record (default: the model's own, the imported "
                        "model's or the trained length; with an extension 4x for DCA, the "
                        "factor's for RoPE scaling); e.g. the length a DCA model serves")
    extend = p.add_argument_group("training-free context extension (no fine-tune)")
    extend.add_argument("--attention", choices=("dca",),
                        help="export a standard-attention model with Dual Chunk Attention")
    extend.add_argument("--dca-chunk-size", type=int, metavar="C",
                        help="DCA's chunk (default 3T/4 of the model's length T)")
    extend.add_argument("--dca-local-size", type=int, metavar="W",
                        help="DCA's local window (default T/16)")
    extend.add_argument("--dca-scaling", choices=("log", "yarn"),
                        help="DCA's logit scaling: log (Llama 4's temperature from the model's "
                             "length T on) or yarn (Qwen2.5-1M's)")
    extend.add_argument("--rope-scaling", choices=("linear", "ntk", "yarn"),
                        help="export with RoPE scaling from the model's length")
    extend.add_argument("--rope-factor", type=float, metavar="S",
                        help="the RoPE scaling factor (default 4)")
    p.set_defaults(run=_deferred("ckpt.hf_export"), check=_check_export_hf)


def _add_gguf(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "gguf-to-hf", help="convert a GGUF model file into a Hugging Face model directory",
        description="Dequantize a Llama/Qwen2/Mistral GGUF file (transformers + gguf) into a "
                    "Hugging Face model directory that import-hf takes.")
    p.add_argument("gguf", help="the .gguf file")
    add_destination_arguments(p, "the Hugging Face model directory")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the weights' dtype (default fp32)")
    p.set_defaults(run=_deferred("ckpt.gguf"), check=lambda a: gguf_file(a.gguf))


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Every command's parser, in the order `--help` lists them; each sets `run` (the command)
    and `check` (its source's refusal, before the imports)."""
    for add in (_add_inspect, _add_verify, _add_reshape, _add_zarr, _add_import_hf,
                _add_export_hf, _add_gguf):
        add(commands)
