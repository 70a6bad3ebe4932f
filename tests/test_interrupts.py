"""Ctrl-C during `kvferry demo`: every process ends, the command says so in one line and exits
with code 130 (128 + SIGINT), with or without tensor-parallel worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEMO = (sys.executable, "-m", "kvferry.adapters.cli", "demo", "--requests", "100000")
STARTUP = 90.0
"""Seconds the workers may take to appear on a loaded machine (spawn and imports)."""
RUNNING = 2.0
"""Seconds the demo runs before the interrupt (the workers are serving steps by then)."""
ENDED = 15.0
"""Seconds everything may take to end after the interrupt (well under a second unloaded)."""


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def descendants(root: int) -> list[int]:
    """Return the pids of every process below `root`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (parent := _parent_of(int(entry))) is not None:
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    """Return True while `pid` is a process that has not ended (a zombie has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def interrupt_demo(*flags: str, workers: int) -> tuple[int, str, float, list[int]]:
    """Start the demo, wait for its `workers` worker processes and a moment of serving, send
    SIGINT to its process group (as a terminal's Ctrl-C does); return the exit code, stderr,
    the seconds it took to exit, and the processes below it that are still running."""
    process = subprocess.Popen(
        [*DEMO, "--no-progress", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + STARTUP
        while len(descendants(process.pid)) < workers and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(RUNNING)
        below = descendants(process.pid)
        assert len(below) >= workers, below
        os.killpg(process.pid, signal.SIGINT)
        sent = time.monotonic()
        _, err = process.communicate(timeout=ENDED)
        took = time.monotonic() - sent
        deadline = time.monotonic() + ENDED
        while any(map(running, below)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return process.returncode, err, took, [pid for pid in below if running(pid)]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


@needs_proc
def test_ctrl_c_during_a_tensor_parallel_demo_exits_130_in_one_line_leaving_no_process() -> None:
    code, err, took, left = interrupt_demo("--tp", "2", workers=2)
    assert (code, err) == (130, "kvferry: interrupted\n")
    assert left == []
    assert took < ENDED


@needs_proc
def test_ctrl_c_during_a_demo_in_one_process_exits_130_in_one_line() -> None:
    code, err, _, left = interrupt_demo(workers=0)
    assert (code, err) == (130, "kvferry: interrupted\n")
    assert left == []


@needs_proc
def test_a_stopped_worker_is_named_after_the_reply_timeout_setting() -> None:
    process = subprocess.Popen(
        [*DEMO, "--no-progress", "--tp", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "KVFERRY_WORKER_REPLY_TIMEOUT": "2"},
    )
    try:
        deadline = time.monotonic() + STARTUP
        while len(descendants(process.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(RUNNING)
        workers = [pid for pid in descendants(process.pid) if b"spawn_main" in _cmdline(pid)]
        os.kill(workers[-1], signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = process.communicate(timeout=ENDED + 2)
        assert time.monotonic() - stopped < ENDED + 2
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 1
    assert err.count("\n") == 1
    assert "kvferry: FAILED: worker rank" in err and "within 2 s" in err


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
