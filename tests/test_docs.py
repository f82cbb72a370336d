"""The documentation describes the project as it is now.

- No tracked text file names a tracker issue, tells the story of the work periods that produced
  it, or points outside the repository (`FORBIDDEN` below; the examples that its own test must
  catch are in this file alone, which the check skips). Raw results under docs/results are text
  too: a machine path in them is written relative to the repository root.
- docs/benchmarks.md holds current figures only: at most 300 lines.
- docs/results, the raw files behind the figures, stays under 1 MB; every file there and every
  image under docs/figures is cited by the docs, and every such path the docs cite exists.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
RESULTS = "docs/results"
FIGURES = "docs/figures"
BENCHMARKS_MAX_LINES = 300
RESULTS_MAX_BYTES = 1_000_000

ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth")
LATER_ORDINALS = ORDINALS.split("|", 2)[2]  # "third" on: "first run" also names a tool's run
FORBIDDEN = {
    "a tracker issue": re.compile(r"\b[Ii]ssues? #?\d+"),
    "a tracker reference": re.compile(r"(?<![\w&/#-])#\d{2,}\b"),
    "a work period": re.compile(
        r"(?i)\b(?:(?:" + ORDINALS + r"|last|previous|next|this|that|earlier|later|each|every|one"
        r"|a|whole|the) sessions?(?:'s)?\b"
        r"|(?:" + LATER_ORDINALS + r") (?:h100 |h200 |gpu )?(?:run|round)s?\b"
        r"|(?:first|second) (?:h100|h200|gpu|device) (?:run|session)s?\b"
        r"|round \d+\b|work periods?\b)"),
    "a path outside the repository": re.compile(r"\.\./shared\b|\bSPEC\.md\b|(?<![\w.~-])/work/"),
}
URL = re.compile(r"https?://\S+")


def tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.decode().split("\0") if p]


def read_text(path: str) -> str | None:
    """The file's text, or None for a binary (or, in the work tree, deleted) file."""
    try:
        data = (ROOT / path).read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def forbidden_mentions(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the match) for every forbidden mention in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        bare = URL.sub("", line)  # an anchor or a pull request in a URL is a source, not a tracker
        for what, pattern in FORBIDDEN.items():
            found += [(number, what, m.group(0)) for m in pattern.finditer(bare)]
    return found


def docs_text() -> str:
    """Everything that cites results and figures: docs/*.md and README.md."""
    paths = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    return "\n".join(p.read_text(encoding="utf-8") for p in paths if p.is_file())


@pytest.mark.parametrize("text, what", [
    ("see issue 17 items 4-5", "a tracker issue"),
    ("(Issue 32's goals)", "a tracker issue"),
    ("fixed in #41", "a tracker reference"),
    ("the eleventh session's tree", "a work period"),
    ("The last session guessed", "a work period"),
    ("Fourth H100 run (2026-11-23)", "a work period"),
    ("as in the fifth run", "a work period"),
    ("Second H100 run: passkey", "a work period"),
    ("round 2 of the review", "a work period"),
    ("the wheel preamble of ../shared/device/fetch-wheels.sh", "a path outside the repository"),
    ("(SPEC.md's table)", "a path outside the repository"),
    ("SMOLLM = Path('/work/models_cache/x')", "a path outside the repository"),
])
def test_the_patterns_catch_the_narrative(text: str, what: str) -> None:
    assert [w for _, w, _ in forbidden_mentions(text)] == [what]


@pytest.mark.parametrize("text", [
    "@pytest.fixture(scope=\"session\")",
    "`cmd` in its own session, start_new_session=True",
    "======== test session starts ========",
    "a wandb session; made once per session",
    "the first run filled the caches, as a second run on the same machine finds them",
    "the next run takes the directory; this run's optimizer",
    "https://github.com/Dao-AILab/flash-attention/pull/2896#issuecomment-12345",
    "https://example.org/page#42",
    "hydra.run.dir=/tmp/work/pk, color #1f77b4, a sixth of the tokens, `x[#]`",
])
def test_the_patterns_leave_ordinary_words(text: str) -> None:
    assert forbidden_mentions(text) == []


def test_no_tracked_file_names_an_issue_a_work_period_or_an_outside_path() -> None:
    hits = []
    for path in tracked():
        if path == THIS:
            continue
        text = read_text(path)
        if text is not None:
            hits += [f"{path}:{n}: {what}: {match!r}"
                     for n, what, match in forbidden_mentions(text)]
    assert not hits, f"{len(hits)} mentions:\n" + "\n".join(hits[:60])


def test_benchmarks_holds_current_figures_only() -> None:
    lines = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= BENCHMARKS_MAX_LINES, len(lines)


def test_the_readme_reads_in_minutes() -> None:
    """The README: what it is, the two commands, one short section per workflow (<= 350 lines);
    the rest lives in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 350, len(lines)


def test_results_stay_small() -> None:
    size = sum(p.stat().st_size for p in (ROOT / RESULTS).rglob("*") if p.is_file())
    assert size <= RESULTS_MAX_BYTES, f"{RESULTS}: {size:,} bytes"


def test_every_cited_result_and_figure_exists() -> None:
    text = docs_text()
    cited = set(re.findall(r"docs/(?:results|figures)/[\w./+-]*", text))
    cited |= {"docs/" + p for p in re.findall(r"\]\((figures/[^)\s]+)\)", text)}
    missing = sorted(p for p in (c.rstrip(".,;:") for c in cited) if not (ROOT / p).exists())
    assert not missing, missing


def test_every_result_and_figure_is_cited() -> None:
    """A file is cited by its path; below a folder of docs/results also by the folder's path and
    its name, or by the folder's path alone (a whole folder of raw results)."""
    text = docs_text()

    def mentioned(name: str) -> bool:
        return re.search(r"(?<![\w./-])" + re.escape(name) + r"(?![\w-])", text) is not None

    def cited(path: Path) -> bool:
        rel = path.relative_to(ROOT).as_posix()
        parent = path.parent.relative_to(ROOT).as_posix()
        if rel in text or (rel.startswith(FIGURES) and f"figures/{path.name}" in text):
            return True
        if parent in (RESULTS, FIGURES) or parent not in text:
            return False
        whole_folder = re.search(re.escape(parent + "/") + r"(?![\w.-])", text) is not None
        return whole_folder or mentioned(path.name)

    files = [p for d in (RESULTS, FIGURES) for p in (ROOT / d).rglob("*") if p.is_file()]
    uncited = sorted(p.relative_to(ROOT).as_posix() for p in files if not cited(p))
    assert not uncited, uncited
