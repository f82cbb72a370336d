"""Issue 30: every command of README.md's ```bash blocks runs as written (so the README cannot
drift from the code), in order, in one scratch directory, with tiny settings substituted:

- a block preceded by `<!-- readme-test: skip (why) -->` is not run (GPU-only examples), one
  preceded by `<!-- readme-test: shell -->` runs whole in bash (a multi-line `python -c`), and
  a command that starts with neither `python` nor `torchrun` runs in bash (`printf ... > f`);
- `$PWD` is the scratch directory;
- `python -m` commands run in a child forked from an interpreter that imported torch, megatron
  and the trainer once (`run_module`: the same module as `__main__`, argv, working directory,
  environment, exit code and atexit handlers as a new interpreter, without its ~7 s of imports);
  `torchrun` and shell commands run as written;
- `pip install` and `pytest` commands are not run (the suite runs itself), nor commands for more
  than 2 ranks or nodes, nor GPU-sized models (`model=gpt_1p3b`, `llama3_8b`);
- `trainer` commands train 2 steps (3 when resuming) of 2 x 64 tokens of the tiny model on 40
  documents, without wandb; `trainer.eval` runs one trial at 64 and 128 tokens;
- placeholders name what the earlier commands made: `RUN/checkpoints`, `outputs/<date>/<time>/
  checkpoints` and `.../checkpoints/iter_*` the first run's checkpoints, `outputs/.../checkpoints`
  the latest run's, `path/to/Llama-3.2-1B` a tiny Llama built here (tests/ckpt/hf_models.py),
  `CKPT` and `OTHER` a checkpoint, `DST`/`DST_ZARR`/`NEW_ROOT` new paths; `[--optional]`
  arguments are left out (`--target-tp` kept, at 2: the tiny model has 2 query groups).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import re
import runpy
import shlex
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

TRAIN = {"trainer.max_steps": "2", "trainer.seq_length": "64", "trainer.micro_batch_size": "2",
         "trainer.global_batch_size": "2", "trainer.eval_interval": "0",
         "data.max_documents": "40", "logger": "none"}
EVAL = {"eval.lengths": "[64,128]", "eval.depths": "[0.5]", "eval.passkey_trials": "1",
        "eval.multikey_trials": "0", "eval.perplexity_windows": "1", "data.max_documents": "40",
        "logger": "none"}
GPU_ONLY = re.compile(r"model=(gpt_1p3b|llama3_8b)|--nnodes|--nproc-per-node ([3-9]|\d\d)")
SHELL = "\0"  # marks a whole block for bash
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<mark>[^>]*) -->\n)?```bash\n(?P<body>.*?)```",
                   re.S)


def readme_commands() -> list[str]:
    """The README's commands in order: continuation lines joined, comments and `&&` split."""
    commands = []
    for block in BLOCK.finditer((REPO / "README.md").read_text()):
        if (block["mark"] or "").startswith("skip"):
            continue
        if (block["mark"] or "").startswith("shell"):
            commands.append(SHELL + block["body"])
            continue
        for line in block["body"].replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*", "", line).strip()
            commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def _set(words: list[str], settings: dict[str, str]) -> list[str]:
    """Replace each setting's value where the command sets it; append the others."""
    keys = {w.split("=", 1)[0].lstrip("+") for w in words if "=" in w}
    words = [f"{w.split('=', 1)[0]}={settings[w.split('=', 1)[0].lstrip('+')]}"
             if "=" in w and w.split("=", 1)[0].lstrip("+") in settings else w for w in words]
    return words + [f"{k}={v}" for k, v in settings.items() if k not in keys]


def tiny(command: str, place: dict[str, str], n: int) -> list[str] | None:
    """The command as run here, or None when it is not run."""
    if command.startswith(("pip ", "pytest")) or GPU_ONLY.search(command):
        return None
    if command.startswith(SHELL):
        return ["bash", "-ec", command[len(SHELL):]]
    if not command.startswith(("python ", "torchrun ")):
        return ["bash", "-ec", command]
    command = command.replace("[--target-tp 4]", "--target-tp 2")  # the tiny model: 2 groups
    command = re.sub(r"\s\[--[^\]]*\]", "", command)
    place = place | {"DST": "zarr" if "--format zarr" in command else f"dst{n}"}
    for name, value in place.items():
        command = re.sub(rf"(?<![\w/.]){re.escape(name)}(?![\w])", value, command)
    words = [re.sub(r"^model=gpt_\w+$", "model=tiny", w) for w in shlex.split(command)]
    if words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", "--standalone", *words[1:]]
    elif words[0] == "python":
        words[0] = sys.executable
    modules = [words[i + 1] for i, w in enumerate(words[:-1])
               if w == "-m" and words[i + 1] != "torch.distributed.run"]
    module = modules[0] if modules else ""
    if module == "trainer":
        steps = "3" if any(w.startswith("checkpoint.load=") for w in words) else "2"
        return _set(words, TRAIN | {"trainer.max_steps": steps, "hydra.run.dir": f"run{n}"})
    if module == "trainer.eval":
        return _set(words, EVAL | {"hydra.run.dir": f"eval{n}"})
    return words


def _run_module_here(args: list[str], cwd: str, env: dict[str, str], log: str) -> None:
    """In a forkserver child: what `python -m args[0] args[1:]` does, output to `log`."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.argv = list(args)  # run_module makes argv[0] the module's file, as under -m
    code: int | str | None = 0
    try:
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_module(words: list[str], cwd: Path, env: dict[str, str],
               log: Path) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` (words) in a child of the forkserver that conftest preloads."""
    child = mp.get_context("forkserver").Process(
        target=_run_module_here, args=(words[2:], str(cwd), env, str(log)))
    child.start()
    child.join(timeout=600)
    if child.exitcode is None:
        child.kill()
        child.join()
    output = log.read_text() if log.exists() else "(the child wrote nothing)"
    return subprocess.CompletedProcess(words, child.exitcode, output, "")


def test_every_readme_command_runs(tmp_path: Path) -> None:
    from tests.ckpt.hf_models import save_hf, save_tokenizer

    for name in ("docs", "README.md"):
        (tmp_path / name).symlink_to(REPO / name)
    hf = save_tokenizer(save_hf(tmp_path / "hf-llama", "llama", False))
    first = tmp_path / "run0" / "checkpoints"
    place = {"RUN/checkpoints": str(first), "path/to/Llama-3.2-1B": str(hf),
             ".../checkpoints/iter_0000020": str(first / "iter_0000002"),
             "outputs/2026-11-22/12-13-00/checkpoints": str(first),
             "CKPT": str(first / "iter_0000002"), "OTHER": str(first / "iter_0000002"),
             "DST_ZARR": "zarr", "NEW_ROOT": "from_zarr"}
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # bash's `python`
    ran, last_run = 0, first
    for n, command in enumerate(readme_commands()):
        command = command.replace("outputs/.../checkpoints", str(last_run))
        words = tiny(command.replace("$PWD", str(tmp_path)), place, ran)
        if words is None:
            continue
        if words[:2] == [sys.executable, "-m"] and words[2] != "torch.distributed.run":
            proc = run_module(words, tmp_path, env, tmp_path / f"command{n}.log")
        else:
            proc = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=600)
        assert proc.returncode == 0, (
            f"README command {n}: {command}\nran: {shlex.join(words)}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        if f"hydra.run.dir=run{ran}" in words and (tmp_path / f"run{ran}" / "checkpoints").exists():
            last_run = tmp_path / f"run{ran}" / "checkpoints"
        ran += 1
    assert ran >= 20, ran
