"""Every ```python and ```sh block of README.md and docs/*.md runs, as a reader would run it.

A python block runs as a script of its own, in an empty folder. When its last line is a
`print(...)` with a comment (or a comment right after one), the comment is what it prints. A sh
block runs line by line from the repository root; `&&` separates commands. A block that is not
meant to run is marked by an HTML comment on the line before it, `<!-- not run: reason -->`:
it is reported as skipped, with its reason, so the marks stay counted.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
RUN_LANGUAGES = ("python", "sh")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<language>[\w+-]*)[ \t]*$")
TIMEOUT_S = 300

SKIPPED_COMMANDS: dict[tuple[str, ...], str] = {
    ("pip", "install"): "installs packages: the suite runs in an environment already set up",
    ("python", "-m", "pip", "install"): "installs packages, as above",
    ("pytest",): "runs the whole suite, this test included",
    ("mkdocs", "serve"): "serves the docs until stopped (CI runs `mkdocs build --strict`)",
}
"""Commands of sh blocks that the test does not run, by their first words, and why."""


@attrs.frozen
class Block:
    """One fenced code block of a page."""

    page: str
    """The page, relative to the repository root."""
    line: int
    """The line of its opening fence (1-based)."""
    language: str
    """The fence's language."""
    code: str
    """Its text, without the list indentation it may sit in."""
    not_run: str | None
    """The reason of its `<!-- not run: ... -->` mark, if it has one."""

    @property
    def where(self) -> str:
        """Return `page:line`."""
        return f"{self.page}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """Return every fenced code block of the Markdown page at `path`, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    page = path.relative_to(ROOT).as_posix()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent = opening.group("indent")
        end = index + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line
            for line in lines[index + 1 : end]
        ]
        previous = next((line for line in reversed(lines[:index]) if line.strip()), "")
        mark = NOT_RUN.match(previous)
        found.append(
            Block(
                page=page,
                line=index + 1,
                language=opening.group("language"),
                code="\n".join(body) + "\n",
                not_run=mark.group("reason") if mark else None,
            )
        )
        index = end + 1
    return found


BLOCKS = [block for page in PAGES for block in code_blocks(page) if block.language in RUN_LANGUAGES]


def _environment() -> dict[str, str]:
    """Return this process's environment without `KVFERRY_*` settings, as a fresh shell has."""
    return {key: value for key, value in os.environ.items() if not key.startswith("KVFERRY_")}


def promised_output(code: str) -> str | None:
    """Return what a python block says it prints: the comment of its last line when that line
    (or the one before a last comment line) calls `print`; None when it promises nothing."""
    lines = [line.strip() for line in code.strip().splitlines()]
    last = lines[-1]
    if "print(" in last and "  # " in last:
        return last.split("  # ", 1)[1].strip()
    if last.startswith("# ") and len(lines) > 1 and lines[-2].startswith("print("):
        return last[2:].strip()
    return None


def shell_commands(code: str) -> list[list[str]]:
    """Return the commands of a sh block: one word list per command, `&&` splitting a line."""
    commands: list[list[str]] = []
    for line in code.replace("\\\n", " ").splitlines():
        command: list[str] = []
        for word in shlex.split(line, comments=True):
            if word == "&&":
                commands.append(command)
                command = []
            else:
                command.append(word)
        if command:
            commands.append(command)
    return commands


def skip_reason(command: list[str]) -> str | None:
    """Return why `command` is not run (its first words are in SKIPPED_COMMANDS), or None."""
    for words, reason in SKIPPED_COMMANDS.items():
        if tuple(command[: len(words)]) == words:
            return reason
    return None


@functools.cache
def _run_command(command: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """Run one command from the repository root (each distinct command once per test run)."""
    program, *arguments = command
    if program == "kvferry":
        argv = [sys.executable, "-m", "kvferry.adapters.cli", *arguments]
    elif program in ("python", "python3"):
        argv = [sys.executable, *arguments]
    else:
        argv = list(command)
    return subprocess.run(
        argv,
        cwd=ROOT,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def _run_python(block: Block, folder: Path) -> None:
    script = folder / "example.py"
    script.write_text(block.code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=folder,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"{block.where} failed:\n{done.stdout}\n{done.stderr}"
    promised = promised_output(block.code)
    if promised is not None:
        printed = done.stdout.strip().splitlines()
        assert printed and printed[-1].strip() == promised, f"{block.where} printed {printed}"


def _run_sh(block: Block) -> None:
    commands = shell_commands(block.code)
    runnable = [command for command in commands if skip_reason(command) is None]
    if not runnable:
        reasons = "; ".join(sorted({str(skip_reason(command)) for command in commands}))
        pytest.skip(f"every command of the block is left out: {reasons}")
    for command in runnable:
        done = _run_command(tuple(command))
        assert done.returncode == 0, (
            f"{block.where}: {shlex.join(command)} exited {done.returncode}:\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_the_code_block_runs(block: Block, tmp_path: Path) -> None:
    if block.not_run is not None:
        pytest.skip(f"marked not run: {block.not_run}")
    if block.language == "python":
        _run_python(block, tmp_path)
    else:
        _run_sh(block)


def test_every_not_run_mark_has_a_reason_and_stands_before_a_runnable_block() -> None:
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        in_block = False
        for number, line in enumerate(lines, start=1):
            if FENCE.match(line):  # an opening or a closing fence
                in_block = not in_block
            if in_block or "not run:" not in line:
                continue
            mark = NOT_RUN.match(line)
            where = f"{page.relative_to(ROOT)}:{number}"
            assert mark is not None and mark.group("reason"), f"{where}: malformed mark {line!r}"
            following = next((text for text in lines[number:] if text.strip()), "")
            fence = FENCE.match(following)
            assert fence is not None and fence.group("language") in RUN_LANGUAGES, (
                f"{where}: the mark is not followed by a python or sh block"
            )


def test_the_readme_shows_two_set_up_commands_and_an_example() -> None:
    readme = [block for block in BLOCKS if block.page == "README.md"]
    assert [block.language for block in readme] == ["sh", "sh", "python"]
    assert all(block.not_run is None for block in readme)


def test_ci_runs_the_readme_commands_as_written() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for block in BLOCKS:
        if block.page == "README.md" and block.language == "sh":
            for line in block.code.strip().splitlines():
                assert line in ci, f".ci/run does not run the README's {line!r}"


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("x = 1\nprint(x)  # 1\n", "1"),
        ("    print(a, b)\n    # () (1,)\n", "() (1,)"),
        ("x = 1  # one\n", None),
        ("print(x)\n", None),
    ],
)
def test_a_print_with_a_comment_promises_its_output(code: str, expected: str | None) -> None:
    assert promised_output(code) == expected


def test_install_commands_are_left_out_and_the_rest_run() -> None:
    commands = shell_commands("pip install -e . && kvferry demo  # the demo\nkvferry plan x.json\n")
    assert [skip_reason(command) is None for command in commands] == [False, True, True]
    assert commands[1] == ["kvferry", "demo"]


def test_a_block_in_a_list_item_loses_the_item_indentation() -> None:
    page = ROOT / "docs" / "session.md"
    nested = [block for block in code_blocks(page) if block.code.startswith("from kvferry.core")]
    assert nested, "the store example of docs/session.md sits in a list item"
    assert all(not line.startswith("  from") for line in nested[0].code.splitlines())
