"""The shared tier on Valkey or Redis: a `SharedBackend` over the `redis` Python client.

One background thread owns one connection and runs each request as one pipeline (`EXISTS`,
`GET` or `SET` per key, binary keys and values); callers only queue requests and take
completions, so an engine's step never waits on the network. Keys live in the namespace of
the model and the layout fingerprint (`namespace_of`); a value read back is loaded only when
it carries its key, that fingerprint, the expected length and a matching checksum.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import attrs

from kvferry.adapters.session import OffloadSession
from kvferry.adapters.shared_tier import (
    BackendCompletion,
    Op,
    SharedTier,
    SharedTierError,
    SharedTierSettings,
    ValueRefused,
    decode_value,
    encode_value,
    host_rows,
    key_name,
    namespace_of,
)
from kvferry.core.keys import OffloadKey
from kvferry.executors.base import Executor


def connect(settings: SharedTierSettings) -> Any:
    """Return a `redis.Redis` client for `settings` (not yet connected), or with `cluster` a
    `RedisCluster` (which asks the node for the cluster's layout at once): the URL's host, port
    and database, its ACL user and password, TLS options, and `timeout_s` on every socket
    operation, and one retry after a lost connection only (a connection the server dropped
    when it restarted), never after a timeout. Raise SharedTierError when `redis` is not
    installed."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as error:
        raise SharedTierError(
            "the shared tier needs the redis client: pip install 'kvferry[shared-tier]'"
        ) from error
    parts = urlsplit(settings.url)
    db = parts.path.strip("/")
    user, password = settings.credentials()
    options: dict[str, Any] = {}
    if settings.tls:
        options.update(
            ssl=True,
            ssl_ca_certs=settings.tls_ca_file,
            ssl_certfile=settings.tls_cert_file,
            ssl_keyfile=settings.tls_key_file,
        )
    retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
    common: dict[str, Any] = {
        "host": parts.hostname or "127.0.0.1",
        "port": parts.port or 6379,
        "username": user,
        "password": password,
        "socket_timeout": settings.timeout_s,
        "socket_connect_timeout": settings.timeout_s,
        "retry": retry,
        **options,
    }
    if settings.cluster:
        from redis.cluster import RedisCluster

        return RedisCluster(**common)
    return redis.Redis(db=int(db) if db else 0, health_check_interval=0, **common)


@attrs.define(eq=False)
class _Ticket:
    ticket: int
    op: Op
    keys: tuple[OffloadKey, ...]
    deadline: float
    rows: Sequence[memoryview] = ()
    payloads: Sequence[bytes] = ()
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    cancelled: bool = False
    committed: bool = False
    """Its outcome is decided: it may write its rows and will complete (cancel fails)."""


_STOP = None


class ValkeyBackend:
    """A `SharedBackend` on one Valkey/Redis server (or a cluster's proxy endpoint)."""

    def __init__(
        self, settings: SharedTierSettings, fingerprint: str, *, client: Any = None
    ) -> None:
        self._settings = settings
        self._fingerprint = fingerprint
        self._namespace = namespace_of(settings.model, fingerprint)
        self._client: Any = client
        if client is None and not settings.cluster:  # a cluster client connects when made:
            self._client = connect(settings)  # the backend's thread makes that one
        self._queue: queue.SimpleQueue[_Ticket | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[BackendCompletion] = queue.SimpleQueue()
        self._arrived = threading.Event()
        self._tickets: dict[int, _Ticket] = {}
        self._guard = threading.Lock()
        self._next = 1
        self._thread = threading.Thread(target=self._serve, name="kvferry-shared-tier", daemon=True)
        self._thread.start()

    @property
    def client(self) -> Any:
        """Return the client (its connection serves this backend's thread), made now if the
        backend's thread has not made it yet."""
        return self._connected()

    def _connected(self) -> Any:
        if self._client is None:
            self._client = connect(self._settings)
        return self._client

    @property
    def namespace(self) -> bytes:
        """Return the key prefix of this model and layout."""
        return self._namespace

    def name(self, key: OffloadKey) -> bytes:
        """Return the server's key of `key`."""
        return key_name(self._namespace, key)

    # -- SharedBackend ------------------------------------------------------------------------

    def submit_contains(self, keys: Sequence[OffloadKey], deadline: float) -> int:
        """Queue an `EXISTS` per key; return the ticket."""
        return self._submit(_Ticket(0, Op.CONTAINS, tuple(keys), deadline))

    def submit_get(
        self, keys: Sequence[OffloadKey], rows: Sequence[memoryview], deadline: float
    ) -> int:
        """Queue a `GET` per key into `rows`; return the ticket."""
        return self._submit(_Ticket(0, Op.GET, tuple(keys), deadline, rows=tuple(rows)))

    def submit_put(
        self, keys: Sequence[OffloadKey], rows: Sequence[memoryview], deadline: float
    ) -> int:
        """Copy `rows` now and queue a `SET` per key; return the ticket."""
        payloads = [bytes(row) for row in rows]
        return self._submit(_Ticket(0, Op.PUT, tuple(keys), deadline, payloads=payloads))

    def poll(self) -> list[BackendCompletion]:
        """Return the completions that arrived (never waits)."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self._arrived.clear()
        if not self._done.empty():
            self._arrived.set()
        return out

    def wait(self, timeout_s: float) -> None:
        """Wait until a completion arrived, at most `timeout_s` seconds."""
        self._arrived.wait(timeout_s)

    def cancel(self, ticket: int) -> bool:
        """Give up `ticket`; return True unless its outcome is already decided."""
        with self._guard:
            found = self._tickets.get(ticket)
        if found is None:
            return False
        with found.lock:
            if found.committed:
                return False
            found.cancelled = True
        with self._guard:
            self._tickets.pop(ticket, None)
        return True

    def close(self) -> None:
        """Cancel everything queued, stop the thread (waiting at most `timeout_s`) and close
        the connection."""
        with self._guard:
            tickets = list(self._tickets)
        for ticket in tickets:
            self.cancel(ticket)
        self._queue.put(_STOP)
        self._thread.join(self._settings.timeout_s + 1.0)
        with contextlib.suppress(Exception):
            self._client.close()

    # -- the thread ---------------------------------------------------------------------------

    def _submit(self, ticket: _Ticket) -> int:
        with self._guard:
            ticket.ticket = self._next
            self._next += 1
            self._tickets[ticket.ticket] = ticket
        self._queue.put(ticket)
        return ticket.ticket

    def _serve(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is _STOP:
                return
            if ticket.cancelled:
                continue
            if time.monotonic() >= ticket.deadline:
                self._complete(ticket, [False] * len(ticket.keys), error="deadline passed")
                continue
            try:
                self._run(ticket)
            except Exception as error:
                self._complete(ticket, [False] * len(ticket.keys), error=_describe(error))

    def _run(self, ticket: _Ticket) -> None:
        names = [self.name(key) for key in ticket.keys]
        if ticket.op is Op.CONTAINS:
            answers = self._pipelined([("EXISTS", name) for name in names])
            self._complete(ticket, [answer == 1 for answer in answers])
        elif ticket.op is Op.GET:
            self._load(ticket, names, self._pipelined([("GET", name) for name in names]))
        else:
            values = [
                encode_value(name, self._fingerprint, payload)
                for name, payload in zip(names, ticket.payloads, strict=True)
            ]
            answers = self._pipelined(
                [("SET", name, value) for name, value in zip(names, values, strict=True)]
            )
            ok = [answer is True or answer == b"OK" for answer in answers]
            nbytes = sum(len(p) for p, good in zip(ticket.payloads, ok, strict=True) if good)
            self._complete(ticket, ok, nbytes=nbytes)

    def _pipelined(self, commands: list[tuple[str | bytes, ...]]) -> list[Any]:
        """Send `commands` in one write and read one reply each (an error reply, such as a
        full server's, stands in its place); retry once on a connection the server closed
        (every command here is idempotent). Raise on a timeout or a second lost connection."""
        import redis

        if self._settings.cluster:  # the cluster client splits the batch by hash slot
            pipe = self._connected().pipeline()
            for command in commands:
                pipe.execute_command(*command)
            return list(pipe.execute(raise_on_error=False))
        pool = self._client.connection_pool
        attempt = 0
        while True:
            connection = pool.get_connection()
            try:
                connection.send_packed_command(connection.pack_commands(commands))
                replies: list[Any] = []
                for _ in commands:
                    try:
                        replies.append(connection.read_response())
                    except redis.ResponseError as error:
                        replies.append(error)
                return replies
            except redis.ConnectionError:
                connection.disconnect()
                attempt += 1
                if attempt > 1:
                    raise
            except BaseException:
                connection.disconnect()  # replies may be left unread: never reuse it
                raise
            finally:
                pool.release(connection)

    def _load(self, ticket: _Ticket, names: list[bytes], values: list[Any]) -> None:
        payloads: list[memoryview | None] = []
        refused: list[ValueRefused] = []
        for name, value, row in zip(names, values, ticket.rows, strict=True):
            if not isinstance(value, bytes):  # absent, or an error reply
                payloads.append(None)
                continue
            got = decode_value(value, name, self._fingerprint, len(row))
            if isinstance(got, ValueRefused):
                refused.append(got)
                payloads.append(None)
            else:
                payloads.append(got)
        with ticket.lock:
            if ticket.cancelled:
                return
            ticket.committed = True
        nbytes = 0
        for row, payload in zip(ticket.rows, payloads, strict=True):
            if payload is not None:
                row[:] = payload
                nbytes += len(payload)
        ok = [payload is not None for payload in payloads]
        self._complete(ticket, ok, nbytes=nbytes, refused=tuple(refused))

    def _complete(
        self,
        ticket: _Ticket,
        ok: list[bool],
        *,
        error: str | None = None,
        nbytes: int = 0,
        refused: tuple[ValueRefused, ...] = (),
    ) -> None:
        with ticket.lock:
            if ticket.cancelled:
                return
            ticket.committed = True
        with self._guard:
            self._tickets.pop(ticket.ticket, None)
        self._done.put(
            BackendCompletion(
                ticket=ticket.ticket,
                op=ticket.op,
                keys=ticket.keys,
                ok=tuple(ok),
                error=error,
                nbytes=nbytes,
                refused=refused,
            )
        )
        self._arrived.set()


def _describe(error: Exception) -> str:
    """Return a one-line description of a client error (the client never puts the password in
    its messages; the URL is not part of them)."""
    return f"{type(error).__name__}: {error}"


def open_shared_tier(
    session: OffloadSession, executor: Executor, settings: SharedTierSettings
) -> SharedTier:
    """Return a `SharedTier` on a Valkey/Redis server below `session`'s CPU tier, whose rows
    are `executor`'s host tier, attached to the session (`attach_lower_tier`). Nothing is sent
    to the server until the first lookup asks."""
    layout = executor.layout
    rows = host_rows(executor.host_tier.array, executor.host_tier.tier)
    backend = ValkeyBackend(settings, layout.fingerprint)
    tier = SharedTier(backend, session.catalog, rows, settings)
    session.attach_lower_tier(tier)
    return tier
