"""Every command of README.md's ```bash blocks runs as written (so the README cannot drift from
the code), each as its own test (so pytest-xdist spreads them), in one scratch directory that
the test run's workers share, with tiny settings substituted:

- a block preceded by `<!-- readme-test: skip (why) -->` is not run, nor here one marked
  `<!-- readme-test: gpu (what) -->` (tests/gpu/test_readme_gpu.py runs those on a GPU), one
  preceded by `<!-- readme-test: shell -->` runs whole in bash (a multi-line `python -c`),
  and a command that starts with neither `python` nor `torchrun` runs in bash (`printf ... >
  f`); a word with `*` is expanded in the scratch directory as bash would;
- `$PWD` is the scratch directory, which links README.md, docs/ and bench/ from the repository;
- `python -m` commands run in a child forked from an interpreter that imported torch, megatron
  and the trainer once (tests/conftest.py's `run_module`: the same module as `__main__`, argv,
  working directory, environment, exit code and atexit handlers as a new interpreter, without
  its ~7 s of imports); `torchrun --nproc-per-node N -m ...` runs its N ranks so, with the
  environment torchrun gives them (tests/conftest.py's `run_module_ranks`; torchrun itself runs
  in tests/trainer/test_entry_errors.py and test_stop.py); `python script.py` and shell commands
  run as written;
- `pip install` and `pytest` commands are not run (the suite runs itself), nor commands for more
  than 2 ranks or nodes, nor GPU-sized models (`model=gpt_1p3b`, `llama3_8b`);
- `trainer` commands train 2 steps (3 when resuming) of 2 x 64 tokens (512 with retrieval
  examples) of the tiny model (unless a checkpoint gives the model) on 40 documents, without
  wandb, evaluating once at the end if they evaluate, in `outputs/readme/run<N>` (N: the
  command's number among the README's); `trainer.eval` runs one trial at 64 and 128 tokens, the
  RULER suite one sample at 1024 of the command's tasks (`niah_single_1` if it names none), in
  `outputs/readme/eval<N>`; `trainer.generate` writes 8 tokens;
- placeholders name what the earlier commands made: `outputs/.../checkpoints` the latest earlier
  run's checkpoints; `RUN/checkpoints`, `outputs/<date>/<time>/checkpoints` and
  `.../checkpoints/iter_*` the first run's; `path/to/SmolLM2-135M` a tiny Llama (plain RoPE, tied
  embeddings, as SmolLM2) built here
  (tests/ckpt/hf_models.py); `CKPT` and `OTHER` a checkpoint, `DST`/`DST_ZARR`/`NEW_ROOT` new
  paths; `[--optional]` arguments are left out (`--target-tp` kept, at 2: the tiny model has 2
  query groups);
- a command that reads what an earlier one wrote (a run or eval directory, `checkpoint.dir`, a
  `build_data --output-prefix`, a `python -m ckpt SUB SRC DST` destination, a `> file`; a
  pattern such as `outputs/*/*/eval.json`: every earlier eval) needs that command: it runs
  first. Each command runs once whichever test asks first (a lock and a result file per
  command in the scratch directory), and its failure fails the commands that need it.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import glob
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.module_runs import run_module, run_module_ranks

TRAIN = {"trainer.max_steps": "2", "trainer.seq_length": "64", "trainer.micro_batch_size": "2",
         "trainer.global_batch_size": "2", "trainer.warmup_steps": "1",
         "trainer.eval_interval": "0", "eval.train_samples": "1", "data.max_documents": "40",
         "logger": "none"}
RETRIEVAL_LENGTH = "512"  # training with passkey or multi-key examples: room for 4 needles
EVAL = {"eval.lengths": "[64,128]", "eval.depths": "[0.5]", "eval.passkey_trials": "1",
        "eval.multikey_trials": "0", "eval.perplexity_windows": "1", "data.max_documents": "40",
        "logger": "none"}
RULER = {"eval.lengths": "[1024]", "eval.samples": "1", "eval.tasks": "[niah_single_1]"}
GENERATE = {"max_new_tokens": "8"}
GPU_ONLY = re.compile(r"model=(gpt_1p3b|llama3_8b)|--nnodes|--nproc-per-node ([3-9]|\d\d)")
SHELL = "\0"  # marks a whole block for bash
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<mark>[^>]*) -->\n)?```bash\n(?P<body>.*?)```",
                   re.S)
FROM_REPO = ("README.md", "docs", "bench")  # what the commands read from the repository
HF = "hf-llama"  # the tiny Llama that `path/to/SmolLM2-135M` names, built in the scratch dir
FIRST_RUN = "outputs/2026-11-22/12-13-00/checkpoints"  # the README's name for a run's checkpoints


def readme_commands() -> list[str]:
    """The README's commands in order: continuation lines joined, comments and `&&` split."""
    commands = []
    for block in BLOCK.finditer((REPO / "README.md").read_text()):
        if (block["mark"] or "").startswith(("skip", "gpu")):
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


def _module(words: list[str]) -> str:
    modules = [words[i + 1] for i, w in enumerate(words[:-1])
               if w == "-m" and words[i + 1] != "torch.distributed.run"]
    return modules[0] if modules else ""


def tiny(command: str, place: dict[str, str], n: int) -> list[str] | None:
    """The command as run here (relative paths: it runs in the scratch directory; `$PWD` left
    for the run to fill in), or None when it is not run."""
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
    module = _module(words)
    if module == "trainer":
        loads = any(w.startswith("checkpoint.load=") for w in words)
        settings = TRAIN | {"trainer.max_steps": "3" if loads else "2",
                            "hydra.run.dir": f"outputs/readme/run{n}"}
        if re.search(r"passkey|multikey", command):
            settings["trainer.seq_length"] = RETRIEVAL_LENGTH
        if _value(words, "trainer.eval_interval") not in (None, "0"):
            settings["trainer.eval_interval"] = settings["trainer.max_steps"]  # one, at the end
        if not loads and _value(words, "model") is None:
            settings["model"] = "tiny"  # over an experiment's model
        return _set(words, settings)
    if module == "trainer.eval":
        settings = EVAL | {"hydra.run.dir": f"outputs/readme/eval{n}"}
        if _value(words, "eval.suite") == "ruler":  # the shortest length its tasks' prompts fit
            settings |= {k: v for k, v in RULER.items()
                         if k != "eval.tasks" or _value(words, k) is None}
        return _set(words, settings)
    if module == "trainer.generate":
        return _set(words, GENERATE)
    return words


def _value(words: list[str], key: str) -> str | None:
    found = [w.split("=", 1)[1] for w in words if w.split("=", 1)[0].lstrip("+") == key]
    return found[-1] if found else None


def _products(words: list[str]) -> set[str]:
    """The paths (relative to the scratch directory) that a command writes for later ones."""
    text = " ".join(words)
    made = set(re.findall(r">\s*([\w./-]+)", text)) if words[0] == "bash" else set()
    module = _module(words)
    if module in ("trainer", "trainer.eval"):
        made |= {v for v in (_value(words, "hydra.run.dir"), _value(words, "checkpoint.dir"))
                 if v}
    if module == "trainer.eval":
        made.add(f"{_value(words, 'hydra.run.dir')}/eval.json")
    if module == "trainer.build_data" and "--output-prefix" in words:
        made.add(words[words.index("--output-prefix") + 1])
    if module == "ckpt":  # python -m ckpt SUB SRC DST
        args = words[words.index("ckpt") + 1:]
        if len(args) > 2 and not args[2].startswith("-"):
            made.add(args[2])
    return {p.removeprefix("$PWD/") for p in made}


def _needs(words: list[str], made: dict[str, int]) -> tuple[int, ...]:
    """The earlier commands (`made`: each path to the command that wrote it first) whose paths
    this command names: a path, one of its leading parts, or a pattern's match."""
    needs = set()
    for token in re.split(r"[\s='\"\[\],()]+", " ".join(words)):
        pieces = token.removeprefix("$PWD/").split("/")
        if "*" in token:
            needs |= {n for path, n in made.items() if fnmatch.fnmatchcase(path, "/".join(pieces))}
        else:
            needs |= {made[p] for p in ("/".join(pieces[:i]) for i in range(1, len(pieces) + 1))
                      if p in made}
    return tuple(sorted(needs))


@dataclass(frozen=True)
class Command:
    n: int  # its place among the README's commands
    text: str  # as the README writes it
    words: list[str]  # as run here
    needs: tuple[int, ...]  # the earlier commands whose outputs it reads


def runnable_commands() -> list[Command]:
    """The README commands that run here, each with the earlier commands it needs."""
    first = "outputs/readme/run{}/checkpoints"
    commands: list[Command] = []
    made: dict[str, int] = {}
    last_run: str | None = None
    for n, text in enumerate(readme_commands()):
        first_run = next((c for c in commands if _module(c.words) == "trainer"), None)
        root = first.format(first_run.n) if first_run else "no-run-yet/checkpoints"
        place = {"RUN/checkpoints": root, "path/to/SmolLM2-135M": HF,
                 ".../checkpoints/iter_0000020": f"{root}/iter_0000002", FIRST_RUN: root,
                 "CKPT": f"{root}/iter_0000002", "OTHER": f"{root}/iter_0000002",
                 "DST_ZARR": "zarr", "NEW_ROOT": "from_zarr"}
        words = tiny(text.replace("outputs/.../checkpoints", last_run or "no-run-yet"), place, n)
        if words is None:
            continue
        commands.append(Command(n, text, words, _needs(words, made)))
        for p in _products(words):
            made.setdefault(p, n)
        if (_module(words) == "trainer" and _value(words, "checkpoint.dir") is None
                and _value(words, "checkpoint.save") != "false"):
            last_run = f"{_value(words, 'hydra.run.dir')}/checkpoints"
    return commands


COMMANDS = runnable_commands()
BY_NUMBER = {c.n: c for c in COMMANDS}


def _ranks(words: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`torchrun [--standalone] --nproc-per-node N -m MODULE ARGS` (`words`: what follows
    `torchrun`) as its ranks, forked like `run_module` (`run_module_ranks`)."""
    at = words.index("-m")
    flags, module, args = words[:at], words[at + 1], words[at + 2:]
    assert set(flags) - {"--standalone"} == {"--nproc-per-node", flags[-1]}, flags
    ranks = run_module_ranks(module, args, int(flags[flags.index("--nproc-per-node") + 1]), cwd,
                             env)
    failed = [r for r in ranks if r.returncode != 0]
    return subprocess.CompletedProcess(words, (failed or ranks)[0].returncode,
                                       "".join(r.stdout for r in ranks),
                                       "".join(r.stderr for r in ranks))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock across the xdist workers."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Scratch:
    """The scratch directory the README's commands share: each runs once, after what it needs,
    whichever test (on whichever worker) asks first; the result is kept in `.results/`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / ".results").mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
                    "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # bash's python
        with _locked(root / ".results" / "setup.lock"):
            if not (root / HF).exists():
                from tests.ckpt.hf_models import save_hf, save_tokenizer

                for name in FROM_REPO:
                    (root / name).symlink_to(REPO / name)
                save_tokenizer(save_hf(root / f"{HF}.tmp", "llama-plain", True))
                (root / f"{HF}.tmp").rename(root / HF)

    def run(self, n: int) -> dict:
        """Command n's exit code and output, running what it needs first."""
        command = BY_NUMBER[n]
        for need in command.needs:
            if self.run(need)["returncode"] != 0:
                pytest.fail(f"README command {n} needs command {need}, which failed: "
                            f"{BY_NUMBER[need].text}")
        result = self.root / ".results" / f"{n}.json"
        with _locked(self.root / ".results" / f"{n}.lock"):
            if not result.exists():
                words = []
                for word in (w.replace("$PWD", str(self.root)) for w in command.words):
                    matches = sorted(glob.glob(word, root_dir=self.root)) if "*" in word else []
                    words += matches or [word]  # as bash expands a pattern
                if words[:3] == [sys.executable, "-m", "torch.distributed.run"]:
                    proc = _ranks(words[3:], self.root, self.env)
                elif words[:2] == [sys.executable, "-m"]:
                    # the checkpoint tool's ranks forked, not spawned: their spawn is tested in
                    # tests/ckpt/test_ckpt_signals.py
                    proc = run_module(words[2], words[3:], self.root, self.env,
                                      fork_ckpt_workers=True)
                else:
                    proc = subprocess.run(words, cwd=self.root, env=self.env, capture_output=True,
                                          text=True, timeout=600)
                result.write_text(json.dumps({
                    "returncode": proc.returncode, "ran": shlex.join(words),
                    "output": f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"}))
        return json.loads(result.read_text())


@pytest.fixture(scope="session")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Scratch:
    """One directory for the test run: under xdist, beside the workers' own temp directories."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return Scratch(base / "readme")


def _id(command: Command) -> str:
    """`07-trainer-+experiment=passkey`: the number, the module or script, its first words."""
    if command.words[0] == "bash":
        words = command.text.lstrip(SHELL).split()[:2]
    else:
        launcher = ["torchrun"] if "torch.distributed.run" in command.words else []
        module = _module(command.words)
        text = shlex.split(command.text)
        shown = [w for i, w in enumerate(text[1:], 1) if not w.startswith("-")
                 and not text[i - 1].startswith("--") and w != module]
        words = launcher + [module or Path(shown[0]).name] + shown[1 - bool(module):][:2]
    return f"{command.n:02d}-" + re.sub(r"[^\w.=+-]+", "_", "-".join(words))[:50]


def test_the_readme_has_its_commands() -> None:
    assert len(COMMANDS) >= 20, [c.text for c in COMMANDS]
    assert {"trainer", "trainer.eval", "trainer.generate", "trainer.build_data", "ckpt"} <= {
        _module(c.words) for c in COMMANDS}


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS, ids=_id)
def test_readme_command_runs(scratch: Scratch, command: Command) -> None:
    result = scratch.run(command.n)
    assert result["returncode"] == 0, (
        f"README command {command.n}: {command.text}\nran: {result['ran']}\n{result['output']}")
