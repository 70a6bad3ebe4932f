"""Tensor-parallel worker processes: one executor per rank's shard, driven by bound-plan messages.

Standard-library multiprocessing only (spawn, one pipe per rank, no network protocol of its own);
workers never plan: they run the jobs the scheduler side sends and report what ended.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from multiprocessing import resource_tracker
from typing import Any, NoReturn, Protocol

import attrs

from kvferry.adapters.messages import (
    Completions,
    decode_completions,
    decode_jobs,
    encode_completions,
)
from kvferry.adapters.session import CompletionReport, OffloadSession, RecomputeRange
from kvferry.adapters.wire import encode_jobs_binary
from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.errors import InvalidInputError, KvferryError
from kvferry.core.plan import Direction
from kvferry.executors.base import Executor

DEFAULT_REPLY_TIMEOUT = 120.0
"""Seconds a rank may take to answer one command before it counts as hung."""
DEFAULT_START_TIMEOUT = 180.0
"""Seconds a rank may take to start (spawn, imports, CUDA initialisation, allocations)."""

Handler = Callable[[Any], Any]
"""A shard's extra command: takes a picklable payload, returns a picklable value."""


# -- errors ----------------------------------------------------------------------------------------


class WorkerError(KvferryError):
    """A worker process failed; `rank` says which."""

    def __init__(self, rank: int, reason: str) -> None:
        self.rank = rank
        self.reason = reason
        super().__init__(f"worker rank {rank}: {reason}")


class WorkerCrashedError(WorkerError):
    """A worker process ended without being asked to (or its pipe broke); `error` is what it
    said of why, when it could say (an error no command caught), with its traceback."""

    def __init__(
        self,
        rank: int,
        exitcode: int | None,
        error: str | None = None,
        remote_traceback: str | None = None,
    ) -> None:
        self.exitcode = exitcode
        self.error = error
        self.remote_traceback = remote_traceback
        why = f": {error}" if error else ""
        super().__init__(rank, f"process ended unexpectedly (exit code {exitcode}){why}")


class WorkerTimeoutError(WorkerError):
    """A worker process did not answer within the timeout (it is presumed hung)."""

    def __init__(self, rank: int, seconds: float, command: str) -> None:
        self.seconds = seconds
        self.command = command
        super().__init__(rank, f"no answer to {command!r} within {seconds:g} s")


class WorkerRaisedError(WorkerError):
    """A command raised inside a worker process; the worker is still running."""

    def __init__(self, rank: int, error_type: str, message: str, remote_traceback: str) -> None:
        self.error_type = error_type
        self.message = message
        self.remote_traceback = remote_traceback
        super().__init__(rank, f"{error_type}: {message}")


# -- what a rank runs ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class WorkerShard:
    """What one rank owns: the executor over its shard, and extra commands it answers."""

    executor: Executor
    """The executor registered over this rank's KV tensors (its share of the KV heads)."""
    handlers: Mapping[str, Handler] = attrs.field(factory=dict)
    """Extra commands by name (`WorkerPool.call`), e.g. to write or read pages in a demo."""


class ShardFactory(Protocol):
    """Builds a rank's shard inside its worker process; must be picklable (a module-level
    function, or an instance of a module-level class), since it travels to a spawned process."""

    def __call__(self, rank: int, world_size: int) -> WorkerShard:
        """Return the shard of `rank` out of `world_size` (allocate its tensors here)."""
        ...


@attrs.frozen(kw_only=True)
class WorkerInfo:
    """What a rank says of itself once started."""

    rank: int
    """Its rank."""
    pid: int
    """Its process id."""
    device: str
    """Where its KV tensors live (`cpu`, `cuda:N`)."""
    layout_fingerprint: str
    """Its executor's layout fingerprint (the same on every rank of one job)."""
    row_bytes: tuple[int, ...]
    """Bytes of one CPU-tier row of each group."""
    num_rows: tuple[int, ...]
    """Rows of each group in its CPU tier."""


# -- the worker process ----------------------------------------------------------------------------

_STEP = "step"
_CALL = "call"
_CLOSE = "close"
_OK = "ok"
_ERROR = "error"
_FATAL = "fatal"
"""A worker's last message: the error that ends it, sent unasked before it exits."""


def _error_reply(error: BaseException, tag: str = _ERROR) -> tuple[str, str, str, str]:
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return (tag, type(error).__name__, str(error), text)


class _Runner:
    """One rank's job runner: waits for the jobs to flush, submits a step's loads before its
    stores, and reports every job that ended as a completion message of its rank. A job this
    rank refuses at submit is reported as failed (other ranks may have run it), never left in
    flight."""

    def __init__(self, executor: Executor, rank: int) -> None:
        self.executor = executor
        self._rank = rank
        self._in_flight: set[int] = set()
        self._results: list[JobResult] = []

    def step(self, jobs: bytes, flush: Sequence[int]) -> bytes:
        """Run one step's message; return the completion message of what ended since."""
        self._collect(self.executor.wait([job for job in flush if job in self._in_flight]))
        bound = decode_jobs(jobs)
        for direction in (Direction.LOAD, Direction.STORE):
            self._submit([job for job in bound if job.plan.direction is direction])
        self._collect(self.executor.poll())
        return self._message()

    def shutdown(self) -> bytes:
        """Drain and close the executor; return the completion message of what was left."""
        self._collect(self.executor.close())
        return self._message()

    def _submit(self, jobs: Sequence[BoundPlan]) -> None:
        for job in jobs:
            try:
                self.executor.submit(job)
            except KvferryError as error:
                reason = f"refused by rank {self._rank}: {type(error).__name__}: {error}"
                self._results.append(
                    JobResult(job_id=job.job_id, success=False, nbytes=0, seconds=0.0, error=reason)
                )
                continue
            self._in_flight.add(job.job_id)

    def _collect(self, results: Iterable[JobResult]) -> None:
        for result in results:
            self._in_flight.discard(result.job_id)
            self._results.append(result)

    def _message(self) -> bytes:
        results, self._results = self._results, []
        return encode_completions(self._rank, results)


_GONE = (EOFError, OSError)
"""What the pipe raises once the scheduler side is gone (EOF, a broken pipe, a reset)."""


def _answer(
    connector: _Runner,
    handlers: Mapping[str, Handler],
    message: tuple[Any, ...],
) -> tuple[Any, ...]:
    """Return the reply to one command (an error reply when the command raised)."""
    tag = message[0]
    try:
        if tag == _STEP:
            _, jobs, flush = message
            return (_OK, connector.step(jobs, flush))
        if tag == _CALL:
            _, name, payload = message
            handler = handlers.get(name)
            if handler is None:
                raise InvalidInputError(
                    field="command", expected="one of " + ", ".join(sorted(handlers)), got=name
                )
            return (_OK, handler(payload))
        raise InvalidInputError(field="message", expected="a known command", got=tag)
    except Exception as error:
        return _error_reply(error)


def _reply(conn: multiprocessing.connection.Connection, reply: tuple[Any, ...]) -> bool:
    """Send `reply` (or the error of an answer that cannot be pickled); return False when the
    scheduler side is gone."""
    try:
        try:
            conn.send(reply)
        except _GONE:
            raise
        except Exception as error:  # pickling fails before a byte is written: the pipe is fine
            conn.send(_error_reply(error))
    except _GONE:
        return False
    return True


def _serve(
    conn: multiprocessing.connection.Connection,
    connector: _Runner,
    handlers: Mapping[str, Handler],
) -> None:
    """Answer commands until close (drain, report what was left) or until the scheduler side
    is gone; the executor is closed either way."""
    try:
        while True:
            try:
                message = conn.recv()
            except _GONE:  # the scheduler side is gone: drain, and leave quietly
                return
            if message[0] == _CLOSE:
                with contextlib.suppress(*_GONE):
                    conn.send((_OK, connector.shutdown()))
                return
            if not _reply(conn, _answer(connector, handlers, message)):
                return
    finally:
        connector.executor.close()


def worker_main(
    conn: multiprocessing.connection.Connection,
    factory: ShardFactory,
    rank: int,
    world_size: int,
) -> None:
    """Run one rank: build its shard, say so, then answer the scheduler side's commands until
    it says close (drain the executor, report what was left) or hangs up.

    This is the target of the spawned process; SIGINT is ignored here (and blocked from the
    start, see `_sigint_blocked`), so that a Ctrl-C reaches the scheduler side only, which then
    ends the workers. When the scheduler side is gone the worker leaves quietly; an error no
    command caught is sent to it (the crash it sees names it) and ends the worker with exit
    code 1, without a traceback on stderr.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        shard = factory(rank, world_size)
        if not isinstance(shard, WorkerShard):
            raise InvalidInputError(field="factory", expected="a WorkerShard", got=shard)
        executor = shard.executor
        if not isinstance(executor, Executor):
            raise InvalidInputError(field="executor", expected="an Executor", got=executor)
        connector = _Runner(executor, rank)
        info = WorkerInfo(
            rank=rank,
            pid=os.getpid(),
            device=executor.device,
            layout_fingerprint=executor.layout.fingerprint,
            row_bytes=executor.layout.row_pitches,
            num_rows=executor.host_tier.num_rows,
        )
    except Exception as error:
        with contextlib.suppress(*_GONE):
            conn.send(_error_reply(error))
        conn.close()
        return
    try:
        conn.send((_OK, info))
        _serve(conn, connector, shard.handlers)
    except _GONE:
        return
    except BaseException as error:
        with contextlib.suppress(*_GONE):
            conn.send(_error_reply(error, _FATAL))
        sys.exit(1)  # multiprocessing ends the process quietly on SystemExit
    finally:
        conn.close()


# -- the scheduler side ----------------------------------------------------------------------------


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread while processes are started: a spawned process inherits the
    mask, so a Ctrl-C during its start-up (imports, before `worker_main` ignores SIGINT) never
    prints a KeyboardInterrupt traceback there. A SIGINT that came meanwhile is delivered here
    when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: nothing to block
        yield
        return
    # Spawning starts multiprocessing's resource tracker once, and unblocks SIGINT after doing
    # so: have it started before blocking, or the first worker would start unblocked.
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@attrs.define
class _Rank:
    rank: int
    process: Any
    conn: multiprocessing.connection.Connection


class WorkerPool:
    """`world_size` worker processes, one per rank, each running the same jobs on its shard.

    Every command goes to every rank and waits for every answer, with a timeout: a rank that
    dies raises WorkerCrashedError, one that does not answer WorkerTimeoutError, one whose
    command raised WorkerRaisedError — each naming the rank. After a crash or a timeout the pool
    is broken: it refuses further commands, and `close` ends the processes that are left.
    """

    def __init__(
        self,
        factory: ShardFactory,
        world_size: int,
        *,
        reply_timeout: float = DEFAULT_REPLY_TIMEOUT,
        start_timeout: float = DEFAULT_START_TIMEOUT,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise InvalidInputError(field="world_size", expected="an integer >= 1", got=world_size)
        for name, value in (("reply_timeout", reply_timeout), ("start_timeout", start_timeout)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise InvalidInputError(field=name, expected="seconds > 0", got=value)
        self._timeout = float(reply_timeout)
        self._broken: WorkerError | None = None
        self._interrupted = False
        """A command was cut short (by Ctrl-C, say): the pipes are out of step."""
        self._closed = False
        context = multiprocessing.get_context("spawn")
        self._ranks: list[_Rank] = []
        try:
            for rank in range(world_size):
                ours, theirs = context.Pipe(duplex=True)
                process = context.Process(
                    target=worker_main,
                    args=(theirs, factory, rank, world_size),
                    name=f"kvferry-worker-{rank}",
                    daemon=True,
                )
                with _sigint_blocked():
                    process.start()
                theirs.close()  # only the child holds its end: its death reads as EOF here
                self._ranks.append(_Rank(rank=rank, process=process, conn=ours))
            infos = self._gather("start", float(start_timeout))
        except BaseException:
            self.terminate()
            raise
        self._infos: tuple[WorkerInfo, ...] = tuple(infos)
        first = self._infos[0].layout_fingerprint
        for info in self._infos[1:]:
            if info.layout_fingerprint != first:
                self.close()
                raise InvalidInputError(
                    field=f"layout_fingerprint of rank {info.rank}",
                    expected=f"rank 0's {first}",
                    got=info.layout_fingerprint,
                )

    # -- reading -------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Return the number of ranks."""
        return len(self._ranks)

    @property
    def infos(self) -> tuple[WorkerInfo, ...]:
        """Return what each rank said of itself at start, by rank."""
        return self._infos

    @property
    def layout_fingerprint(self) -> str:
        """Return the layout fingerprint every rank shares (bind plans to it)."""
        return self._infos[0].layout_fingerprint

    # -- commands ------------------------------------------------------------------------------

    def submit(
        self, jobs: Sequence[BoundPlan] | bytes, *, flush: Iterable[int] = ()
    ) -> tuple[Completions, ...]:
        """Send `jobs` (bound plans, or a binary or JSON jobs message) to every rank; each first
        waits for its `flush` jobs still in flight, then submits loads before stores.

        Returns, per rank, the jobs that ended since its last report (feed them to
        `report_all`). The jobs run asynchronously on GPU executors.
        """
        message = jobs if isinstance(jobs, bytes) else encode_jobs_binary(jobs)
        return self._step(message, tuple(int(j) for j in flush))

    def poll(self) -> tuple[Completions, ...]:
        """Return, per rank, the jobs that ended since its last report."""
        return self._step(encode_jobs_binary(()), ())

    def wait(self, job_ids: Iterable[int]) -> tuple[Completions, ...]:
        """Block until the given jobs end on every rank; return, per rank, every job that ended
        since its last report (those and any others). Jobs a rank already reported are skipped.
        """
        return self._step(encode_jobs_binary(()), tuple(int(j) for j in job_ids))

    def call(self, name: str, payload: Any = None) -> tuple[Any, ...]:
        """Run the shards' extra command `name` with the same `payload` on every rank; return
        the answers by rank."""
        return self.call_each(name, [payload] * self.world_size)

    def call_each(self, name: str, payloads: Sequence[Any]) -> tuple[Any, ...]:
        """Run the shards' extra command `name` on every rank, with `payloads[rank]`; return
        the answers by rank."""
        if len(payloads) != self.world_size:
            raise InvalidInputError(
                field="payloads", expected=f"one per rank ({self.world_size})", got=len(payloads)
            )
        self._check_usable()
        with self._command():
            for entry, payload in zip(self._ranks, payloads, strict=True):
                self._send(entry, (_CALL, name, payload))
            return tuple(self._gather(name, self._timeout))

    def close(self) -> tuple[Completions, ...]:
        """Drain every rank (each waits for its jobs and closes its executor) and end the
        processes; return, per rank, the jobs that were still unreported (idempotent: a second
        call returns nothing). A broken pool, or one whose last command was interrupted, ends
        its processes and returns nothing."""
        if self._closed:
            return ()
        if self._broken is not None or self._interrupted:
            self.terminate()
            return ()
        try:
            for entry in self._ranks:
                self._send(entry, (_CLOSE,))
            replies = self._gather("close", self._timeout)
        except BaseException:
            self.terminate()
            raise
        for entry in self._ranks:
            entry.process.join(self._timeout)
        self.terminate()
        return tuple(self._completions(replies))

    def terminate(self) -> None:
        """End every worker process now, without draining (what a failure leaves to do)."""
        self._closed = True
        for entry in self._ranks:
            entry.conn.close()
            if entry.process.is_alive():
                entry.process.terminate()
        deadline = time.monotonic() + 1.0  # SIGTERM ends a worker at once unless it is stopped
        for entry in self._ranks:
            entry.process.join(max(deadline - time.monotonic(), 0.0))
            if entry.process.is_alive():
                entry.process.kill()
                entry.process.join()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.terminate()

    # -- plumbing --------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise InvalidInputError(field="pool", expected="an open worker pool", got="closed")
        if self._interrupted:
            raise InvalidInputError(
                field="pool",
                expected="a pool whose last command completed (close it)",
                got="a command was interrupted",
            )

    @contextlib.contextmanager
    def _command(self) -> Iterator[None]:
        """Mark the pool out of step when a command is cut short by anything but a worker's
        own error (a KeyboardInterrupt between sending and gathering, say)."""
        try:
            yield
        except WorkerError:
            raise
        except BaseException:
            self._interrupted = True
            raise

    def _step(self, jobs: bytes, flush: tuple[int, ...]) -> tuple[Completions, ...]:
        self._check_usable()
        with self._command():
            for entry in self._ranks:
                self._send(entry, (_STEP, jobs, flush))
            replies = self._gather("jobs", self._timeout)
        return tuple(self._completions(replies))

    def _completions(self, replies: list[Any]) -> list[Completions]:
        out = []
        for entry, data in zip(self._ranks, replies, strict=True):
            completions = decode_completions(data)
            if completions.worker != entry.rank:
                raise InvalidInputError(
                    field="worker",
                    expected=f"rank {entry.rank} on its own pipe",
                    got=completions.worker,
                )
            out.append(completions)
        return out

    def _send(self, entry: _Rank, message: tuple[Any, ...]) -> None:
        try:
            entry.conn.send(message)
        except _GONE:
            self._crashed(entry)

    def _fail(self, error: WorkerError) -> NoReturn:
        self._broken = error
        raise error

    def _crashed(self, entry: _Rank, last: tuple[Any, ...] | None = None) -> NoReturn:
        """Raise WorkerCrashedError for a rank that ended, with the error it sent as its last
        message (`last`, or one still waiting in its pipe) when it sent one."""
        if last is None:
            with contextlib.suppress(*_GONE, pickle.UnpicklingError):
                if entry.conn.poll(0):
                    last = entry.conn.recv()
        entry.process.join(1.0)
        if last is not None and last[0] == _FATAL:
            _, error_type, message, remote = last
            self._fail(
                WorkerCrashedError(
                    entry.rank, entry.process.exitcode, f"{error_type}: {message}", remote
                )
            )
        self._fail(WorkerCrashedError(entry.rank, entry.process.exitcode))

    def _gather(self, command: str, timeout: float) -> list[Any]:
        """Receive one answer from every rank; raise the lowest rank's error once all answered
        (a crash or a timeout at once: the pipes are out of step from then on)."""
        deadline = time.monotonic() + timeout
        answers: dict[int, Any] = {}
        raised: list[WorkerRaisedError] = []
        pending = {entry.rank: entry for entry in self._ranks}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(WorkerTimeoutError(min(pending), timeout, command))
            waitables: list[Any] = [e.conn for e in pending.values()]
            waitables += [e.process.sentinel for e in pending.values()]
            multiprocessing.connection.wait(waitables, timeout=left)
            for rank, entry in sorted(pending.items()):
                try:
                    if not entry.conn.poll():
                        if not entry.process.is_alive():
                            self._crashed(entry)
                        continue
                    reply = entry.conn.recv()
                except _GONE:
                    self._crashed(entry)
                del pending[rank]
                if reply[0] == _FATAL:
                    self._crashed(entry, reply)
                if reply[0] == _OK:
                    answers[rank] = reply[1]
                else:
                    _, error_type, message, remote = reply
                    raised.append(WorkerRaisedError(rank, error_type, message, remote))
        if raised:
            first = min(raised, key=lambda error: error.rank)
            if command == "start":
                self._broken = first
            raise first
        return [answers[entry.rank] for entry in self._ranks]


def report_all(session: OffloadSession, completions: Iterable[Completions]) -> CompletionReport:
    """Report every rank's results to `session` (its `world_size` must be the pool's); return
    one CompletionReport merging what completed — a job completes once every rank reported it.

    Reports are applied rank by rank; if one raises (a rank reported a job twice, say), the
    ranks before it stay recorded.
    """
    completed: list[int] = []
    failed: list[int] = []
    recompute: list[RecomputeRange] = []
    released: list[str] = []
    for part in completions:
        report = session.report(part.worker, part.results)
        completed.extend(report.completed)
        failed.extend(report.failed)
        recompute.extend(report.recompute)
        released.extend(report.released)
    return CompletionReport(
        completed=tuple(completed),
        failed=tuple(failed),
        recompute=tuple(recompute),
        released=tuple(released),
    )
