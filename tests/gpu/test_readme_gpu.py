"""The README's GPU-sized commands (blocks marked `<!-- readme-test: gpu (what they need) -->`,
which tests/test_readme.py leaves out on the CPU) run as written on the GPU machine: each
command once, in its own directory, with wandb off; a command that needs more GPUs than the
machine has is skipped, naming the count."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BLOCK = re.compile(r"<!-- readme-test: gpu \((?P<needs>[^)]*)\) -->\n```bash\n(?P<body>.*?)```",
                   re.S)


def gpu_commands() -> list[str]:
    """The commands of the README's GPU-marked blocks, continuation lines joined."""
    commands = []
    for block in BLOCK.finditer((REPO / "README.md").read_text()):
        for line in block["body"].replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*", "", line).strip()
            if line:
                commands.append(line)
    return commands


def test_the_readme_marks_its_gpu_commands() -> None:
    """Runs on CPU machines too (no GPU needed to read the README): a GPU command exists."""
    assert gpu_commands()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("command", gpu_commands(),
                         ids=lambda c: "torchrun" if c.startswith("torchrun") else "one_process")
def test_readme_gpu_command_runs(command: str, tmp_path: Path) -> None:
    words = shlex.split(command)
    ranks = int(words[words.index("--nproc-per-node") + 1]) if "--nproc-per-node" in words else 1
    if ranks > torch.cuda.device_count():
        pytest.skip(f"needs {ranks} GPUs, this machine has {torch.cuda.device_count()}")
    if words[0] == "python":
        words[0] = sys.executable
    elif words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", "--standalone", *words[1:]]
    words += ["logger=none", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(words, cwd=tmp_path, capture_output=True, text=True, timeout=1800,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join(
                              [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
