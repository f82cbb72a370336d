"""`python -m ckpt` answers help and refuses bad input before it imports torch or megatron
(seconds on a few cores): the command line and the input checks live in light modules
(ckpt/commands.py), a command's own module loads only when it runs.

No test here times anything (machines differ); which modules a refusal loaded is the guard."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# In a new interpreter: run `main(argv)` and report its exit status and the heavy packages it
# loaded; a SystemExit (help, argparse's refusals) is an exit status too.
_PROBE = """
import sys
import ckpt.__main__ as m
try:
    code = m.main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
heavy = sorted({k.split(".")[0] for k in sys.modules} & {"torch", "megatron", "tensorstore"})
print("exit", code, "heavy", ",".join(heavy) or "none", file=sys.stderr)
"""


def _ckpt(*argv: str | Path) -> subprocess.CompletedProcess:
    """`python -m ckpt ARGV` as typed."""
    return subprocess.run([sys.executable, "-m", "ckpt", *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _probe(*argv: str | Path) -> tuple[int, str, str]:
    """`ckpt.__main__.main(ARGV)` in a new interpreter: (exit status, heavy packages loaded,
    its stderr without the probe's line)."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    *err, last = proc.stderr.splitlines()
    words = last.split()
    assert words[0] == "exit" and words[2] == "heavy", proc.stderr[-3000:]
    return int(words[1]), words[3], "\n".join(err)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_missing_checkpoint_is_one_error_line_with_exit_2(command: str, tmp_path: Path) -> None:
    line = _one_error_line(_ckpt(command, tmp_path / "nope"))
    assert line == f"error: {tmp_path / 'nope'}: no such file or directory"


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["export-hf", "--help"]])
def test_help_answers_with_exit_0(argv: list[str]) -> None:
    proc = _ckpt(*argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: python -m ckpt") and not proc.stderr
    assert "Traceback" not in proc.stdout


@pytest.mark.parametrize("argv", [["bogus"], ["reshape"], ["export", "SRC", "DST"]])
def test_a_wrong_command_line_is_refused_by_argparse_with_exit_2(argv: list[str]) -> None:
    proc = _ckpt(*argv)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].startswith("python -m ckpt")
    assert "error: " in proc.stderr.splitlines()[-1]


def test_building_the_parser_imports_no_heavy_module() -> None:
    code = ("import sys, ckpt.__main__ as m; m.parser(); "
            "print('torch' in sys.modules, any(k.startswith('megatron') for k in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.split() == ["False", "False"], proc.stdout + proc.stderr[-3000:]


def _refusals(tmp_path: Path) -> list[tuple[list[str | Path], str]]:
    """Every command's argv with a missing source (or not the kind of file it takes), and what
    its one error line says."""
    missing, dst = tmp_path / "missing", tmp_path / "dst"
    (tmp_path / "empty").write_text("")
    return [
        (["inspect", missing], f"{missing}: no such file or directory"),
        (["verify", missing], f"{missing}: no such file or directory"),
        (["reshape", missing, dst, "--target-tp", "2"], f"{missing}: no such file or directory"),
        (["export", missing, dst, "--format", "zarr"], f"{missing}: no such file or directory"),
        (["import", missing, dst], f"{missing / 'manifest.json'} is missing"),
        (["import-hf", missing, dst], f"{missing / 'config.json'}: no config.json"),
        (["export-hf", missing, dst], f"{missing}: no such file or directory"),
        (["gguf-to-hf", missing, dst], f"{missing}: no such GGUF file"),
        (["gguf-to-hf", tmp_path / "empty", dst], "not a GGUF file"),
        (["inspect", tmp_path / "empty"], "is neither a checkpoints root"),
    ]


def test_every_refusal_before_the_imports_loads_nothing_heavy(tmp_path: Path) -> None:
    """Each command's missing source: one `error:` line, exit 2, and neither torch, megatron
    nor tensorstore imported to say so."""
    for argv, words in _refusals(tmp_path):
        code, heavy, err = _probe(*argv)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
        assert words in lines[0], (argv, err)
        assert heavy == "none", (argv, heavy)


def test_help_loads_nothing_heavy() -> None:
    code, heavy, _ = _probe("reshape", "--help")
    assert (code, heavy) == (0, "none")
