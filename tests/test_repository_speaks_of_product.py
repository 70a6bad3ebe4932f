"""Every tracked text file speaks of kvferry, never of how it was developed.

Docs, comments, docstrings, test names and help texts say what kvferry does and how to use it;
a measurement names the hardware, the date and the version it was taken with. The patterns below
are words that only a development log would use: numbered work items, the people or tools that
ran the work, and references to design notes outside the repository. Product words share some
of their nouns (an `OffloadSession`, "the session", a copy target, "the device tables" of CUDA
memory), so each pattern names the development use only.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()
"""This file spells the patterns out, so it is the one file not scanned."""

_ORDINALS = (
    r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
    r"|[a-z]+teenth|twentieth|\d+(?:st|nd|rd|th)"
)
_POSSESSIVE = "(?:'|\u2019)s"
"""An apostrophe (straight or typographic) and an s."""
_RUN_VERBS = r"measured|measures|measure|run|runs|ran|timed|printed|seen|tested|verified|gave|took"
_CUDA_NOUNS = r"tables?|memory|side|allocations?|buffers?|pointers?|address(?:es)?|context|streams?"


@attrs.frozen
class Pattern:
    """A development-process phrase and what to write instead."""

    regex: re.Pattern[str]
    """Matched against each line."""
    instead: str
    """What a product text says in its place."""


PATTERNS = (
    Pattern(
        re.compile(rf"\b(?:{_ORDINALS}) sessions?\b", re.I),
        "state what was measured or decided, not which work session did it",
    ),
    Pattern(re.compile(r"\b[Ss]essions? \d+\b"), "state the fact, not the work session"),
    Pattern(re.compile(rf"\bsession{_POSSESSIVE} runs?\b", re.I), "name the measurement itself"),
    Pattern(re.compile(r"\b[Cc]all [A-Z]\b"), "name the run by hardware, date and version"),
    Pattern(re.compile(r"\b[Ii]ssues? #?\d+"), "state the requirement itself"),
    Pattern(
        re.compile(r"\b[Tt]he issue (?:is silent|names|says|words|asks|lists|leaves)\b"),
        "state the requirement itself",
    ),
    Pattern(re.compile(r"\b[Tt]argets? \d+[a-z]?\b"), "state the bar itself (e.g. '>= 0.90 x')"),
    Pattern(re.compile(r"\b[Ww]hoever\b|\bsteer(?:s|ed|ing)?\b", re.I), "say what kvferry does"),
    Pattern(re.compile(r"\bDESIGN\b"), "state the rule itself, not a design document's section"),
    Pattern(re.compile(r"§\s*\d"), "state the rule itself, not a document's section"),
    Pattern(re.compile(r"\bdesign doc(?:ument)?s?\b", re.I), "state the rule itself"),
    Pattern(
        re.compile(rf"\bdevice(?:{_POSSESSIVE})? (?:H\d{{3}}|host)\b"),
        "name the hardware: 'an NVIDIA H200 (driver ...)' or its host's CPU",
    ),
    Pattern(
        re.compile(
            rf"\b(?:{_RUN_VERBS})\b[^.;:]{{0,40}}?\bon the device\b"
            rf"(?!{_POSSESSIVE}| (?:{_CUDA_NOUNS})\b)",
            re.I,
        ),
        "name the hardware: 'on an NVIDIA H200 (driver ...)', or 'on a GPU'",
    ),
    Pattern(re.compile(rf"\bthe device{_POSSESSIVE}(?=\s*[.,;)])"), "name the hardware"),
    Pattern(re.compile(r"[Bb]enchmark[- ]history"), "state the measurement where it matters"),
    Pattern(
        re.compile(r"\b[\w-]+-[0-9a-f]{7,40}\.(?:png|svg|jpe?g)\b"),
        "name a plot after what it shows, not after a commit",
    ),
    Pattern(re.compile(r"\b(?:not|was|were) lent\b"), "say what was not measured"),
    Pattern(
        re.compile(r"\bdevelopment (?:machine|container|session)s?\b", re.I),
        "name the hardware (CPU, cores) the measurement ran on",
    ),
)
"""The development-process phrases no tracked file may contain."""


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the check reads `git ls-files`")
    listing = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    return [name for name in listing.decode("utf-8").split("\0") if name]


def _text(path: Path) -> str | None:
    """Return the file's text, or None for a binary (or missing) file."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def findings(name: str, text: str) -> list[str]:
    """Return one `file:line: phrase (say instead)` entry per development-process phrase."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for pattern in PATTERNS:
            for match in pattern.regex.finditer(line):
                found.append(f"{name}:{number}: {match.group(0)!r} ({pattern.instead})")
    return found


def test_no_tracked_text_file_speaks_of_the_development_process() -> None:
    found = []
    for name in _tracked_files():
        if name == THIS_FILE:
            continue
        text = _text(ROOT / name)
        if text is not None:
            found.extend(findings(name, text))
    assert not found, "development-process words:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "the thirteenth session's runs after the lanes fix",
        "every session's runs, newest first",
        "The GPU numbers come from call F of the run",
        "Until then, issue 5 is marked blocked.",
        "## Decisions where the issue is silent",
        "PASS: target 1 (each direction >= 0.92 x ceiling)",
        "Whoever steers the project must decide",
        "Implements DESIGN §4.1: a prefix scan",
        "Measured on the device H200 (torch 2.11)",
        "on the device's host, any few milliseconds",
        "(run with `pytest -m gpu` on the device)",
        "moved by 100 us or more between runs on the device.",
        "(each step measured on the device, same command)",
        "figures can be set beside the device's.",
        "every run is in the [benchmark history](docs/benchmark-history.md)",
        "![GB/s against page size](img/transfer-four-13f0d1e.png)",
        "| not run: that kind was not lent |",
        "Last long run (2026-12-02, development container, 2 CPUs)",
    ],
)
def test_a_development_phrase_is_found(line: str) -> None:
    assert findings("page.md", line)


@pytest.mark.parametrize(
    "line",
    [
        "session = OffloadSession(config, catalog, world_size=2)",
        "The session keeps requests and jobs; the session's catalog holds rows.",
        "session lookup: a new request with computed beyond its tokens",
        "the copy's target address and its source",
        "which jobs to wait for before the blocks are reused (call order below)",
        "the job's kernels read the device tables of its own table slot",
        "the job's upload to the device)",
        "the context (read on the device)",
        "Return the submission thread (started now, on the device, at the first call)",
        "each kernel runs on the device's SMs",
        "clamped to the device's",
        "Page-lock `nbytes` at `address` and map them for the device; raise on failure.",
        "Measured on an NVIDIA H200 (driver 580.159.04), 2 December 2026, kvferry 823fafd",
        "![GB/s against page size](img/transfer-page-sizes.png)",
        "a load issues its copies; the issue of ordering is the executor's",
    ],
)
def test_a_product_phrase_is_not_found(line: str) -> None:
    assert findings("page.md", line) == []
