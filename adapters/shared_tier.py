"""A shared tier below the CPU tier: a store that several engine instances read and write.

Three parts. `SharedBackend` is what a store implements (`kvferry.adapters.valkey_tier` for
Valkey/Redis): batch `contains`, `get` into given CPU rows and `put` from given rows, each
submitted without waiting and reported later as a `BackendCompletion`. `SharedTier` puts a
backend below an `OffloadSession`'s CPU tier: lookups see a chunk that only the shared tier holds
as pending while it is promoted into CPU rows (reserved by the catalog's rules), then as a hit;
stores are written behind to the shared tier. The value format (`encode_value`,
`decode_value`) carries the key, the layout fingerprint and a checksum, so that a value that
does not match is refused, never loaded.

The engine's step never waits on the network: `SharedTier.poll` only takes completions that
have arrived, and a request that is not answered within `timeout_s` counts as failed.
"""

from __future__ import annotations

import contextlib
import enum
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Protocol
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import attrs
import numpy as np

from kvferry.core.arrays import IdArray
from kvferry.core.catalog import Catalog
from kvferry.core.errors import InvalidInputError, KvferryError, PlanInvariantError
from kvferry.core.keys import KeyStatus, KeyStatusView, OffloadKey
from kvferry.core.layout import TierLayout

_ABSENT_PRUNE = 1 << 16
"""Absent answers kept before the expired ones are dropped."""
_SCHEMES = {"redis": False, "valkey": False, "rediss": True, "valkeys": True}


class WriteBehind(enum.Enum):
    """When chunks stored in the CPU tier are written to the shared tier."""

    ON_STORE = "on-store"
    """As soon as their store into the CPU tier succeeds (other replicas see them soonest)."""
    ON_EVICTION = "on-eviction"
    """When the CPU tier evicts them (less network traffic; others see them later)."""
    OFF = "off"
    """Never: this engine only reads the shared tier."""


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidInputError(field=attribute.name, expected="a number > 0", got=value)


def _check_url(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or urlsplit(value).scheme not in _SCHEMES:
        raise InvalidInputError(
            field="url",
            expected="redis://, rediss://, valkey:// or valkeys://HOST:PORT",
            got=redact_url(value) if isinstance(value, str) else value,
        )
    if not urlsplit(value).hostname:
        raise InvalidInputError(field="url", expected="a URL with a host", got=redact_url(value))


def redact_url(url: str) -> str:
    """Return `url` with any password replaced by `***` (for messages and reports)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = quote(parts.username or "", safe="")
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@attrs.frozen(kw_only=True)
class SharedTierSettings:
    """Where the shared tier is and how an engine uses it (docs/configuration.md)."""

    url: str = attrs.field(validator=_check_url, repr=redact_url)
    """`redis://` or `valkey://HOST:PORT[/DB]`; `rediss://`/`valkeys://` for TLS. A password in
    the URL (`redis://USER:PASSWORD@HOST:PORT`) is used, and never printed."""
    model: str = attrs.field(validator=attrs.validators.instance_of(str))
    """The model's name: with the layout fingerprint, the namespace of every key."""
    timeout_s: float = attrs.field(default=0.5, validator=_positive)
    """How long a request to the server may take before it counts as failed (its chunks are
    then recomputed)."""
    retry_after_s: float = attrs.field(default=2.0, validator=_positive)
    """After a failed or late request, how long lookups skip the shared tier."""
    absent_ttl_s: float = attrs.field(default=1.0, validator=_positive)
    """How long an answer "not in the shared tier" is trusted before the key is asked again."""
    write_behind: WriteBehind = attrs.field(
        default=WriteBehind.ON_STORE, validator=attrs.validators.instance_of(WriteBehind)
    )
    """When stores are written to the shared tier."""
    username: str | None = None
    """ACL user (`AUTH user password`); None: the URL's, or the default user."""
    password: str | None = attrs.field(default=None, repr=False)
    """The password (overrides the URL's); never printed or logged."""
    cluster: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """The URL names one node of a Valkey/Redis Cluster: the others are discovered, and each
    batch is split by hash slot over them."""
    tls_ca_file: str | None = None
    """CA bundle that verifies the server's certificate (TLS)."""
    tls_cert_file: str | None = None
    """Client certificate (TLS with client authentication)."""
    tls_key_file: str | None = None
    """Client certificate's key."""

    @property
    def tls(self) -> bool:
        """Return True when the URL asks for TLS (`rediss://` or `valkeys://`)."""
        return _SCHEMES[urlsplit(self.url).scheme]

    @property
    def safe_url(self) -> str:
        """Return the URL with its password hidden."""
        return redact_url(self.url)

    def credentials(self) -> tuple[str | None, str | None]:
        """Return (user, password): the settings' own, else the URL's."""
        parts = urlsplit(self.url)
        user = self.username or (unquote(parts.username) if parts.username else None)
        password = self.password
        if password is None and parts.password is not None:
            password = unquote(parts.password)
        return user, password


# -- the value format -----------------------------------------------------------------------

_MAGIC = b"KVF1"
_HEAD = struct.Struct("<4sHH16sIQ")
"""magic, key length, reserved, layout fingerprint (16 ASCII bytes), CRC-32, payload length."""


class ValueRefused(enum.Enum):
    """Why a value read from the shared tier was not loaded."""

    FORMAT = "not a kvferry value"
    KEY = "another key's value"
    FINGERPRINT = "another layout's value"
    LENGTH = "a payload of another length"
    CHECKSUM = "a checksum that does not match"


def _fingerprint_bytes(fingerprint: str) -> bytes:
    raw = fingerprint.encode("ascii")
    if len(raw) > 16:
        raise InvalidInputError(field="fingerprint", expected="at most 16 characters", got=raw)
    return raw.ljust(16, b"\0")


def encode_value(name: bytes, fingerprint: str, payload: bytes | memoryview) -> bytes:
    """Return the stored value of `payload` under key `name`: a header (key, layout
    fingerprint, CRC-32 and length of the payload) followed by the payload."""
    head = _HEAD.pack(
        _MAGIC,
        len(name),
        0,
        _fingerprint_bytes(fingerprint),
        zlib.crc32(payload),
        len(payload),
    )
    return b"".join((head, name, payload))


def decode_value(
    value: bytes, name: bytes, fingerprint: str, length: int
) -> memoryview | ValueRefused:
    """Return the payload of `value` read under key `name`, or why it is refused: it must carry
    that key, the `fingerprint`, a payload of `length` bytes and a matching CRC-32."""
    if len(value) < _HEAD.size:
        return ValueRefused.FORMAT
    magic, name_len, _, value_fp, crc, size = _HEAD.unpack_from(value)
    if magic != _MAGIC:
        return ValueRefused.FORMAT
    view = memoryview(value)
    start = _HEAD.size + name_len
    if view[_HEAD.size : start] != name:
        return ValueRefused.KEY
    if value_fp != _fingerprint_bytes(fingerprint):
        return ValueRefused.FINGERPRINT
    if size != length or len(value) - start != length:
        return ValueRefused.LENGTH
    payload = view[start:]
    if zlib.crc32(payload) != crc:
        return ValueRefused.CHECKSUM
    return payload


def key_name(namespace: bytes, key: OffloadKey) -> bytes:
    """Return the store's name of `key` inside `namespace` (see `namespace_of`)."""
    return b"%s%d/%s" % (namespace, key.group, key.block_hash)


def namespace_of(model: str, fingerprint: str) -> bytes:
    """Return the key prefix of a model and layout: two models or layouts never share a key."""
    return b"kvferry/%s/%s/" % (model.encode().replace(b"/", b"%2F"), fingerprint.encode())


# -- the backend interface --------------------------------------------------------------------


class Op(enum.Enum):
    """What a backend request does."""

    CONTAINS = "contains"
    GET = "get"
    PUT = "put"


@attrs.frozen(kw_only=True)
class BackendCompletion:
    """The outcome of one backend request."""

    ticket: int
    """The id `submit_*` returned."""
    op: Op
    """Contains, get or put."""
    keys: tuple[OffloadKey, ...]
    """The keys of the request, in the order submitted."""
    ok: tuple[bool, ...]
    """Per key: present (contains), loaded into its row (get), or written (put)."""
    error: str | None = None
    """Why the whole request failed (then every `ok` is False); None when it ran."""
    nbytes: int = 0
    """Payload bytes moved."""
    refused: tuple[ValueRefused, ...] = ()
    """Values a get read and refused (not loaded), one reason each."""


class RowAccess(Protocol):
    """The CPU tier's bytes: a writable view of the part of a row a group's chunk uses."""

    def __call__(self, group: int, row: int) -> memoryview:
        """Return the bytes of `row` used by a chunk of `group` (writable, no copy)."""
        ...


class SharedBackend(Protocol):
    """A shared store: requests are submitted without waiting and complete later."""

    def submit_contains(self, keys: Sequence[OffloadKey], deadline: float) -> int:
        """Ask which of `keys` the store holds; return the request's ticket."""
        ...

    def submit_get(
        self, keys: Sequence[OffloadKey], rows: Sequence[memoryview], deadline: float
    ) -> int:
        """Read `keys` into `rows` (one writable view each, exactly a chunk long); return the
        ticket. A row is written only with a value that passed every check; the rows stay the
        backend's until the ticket completes or `cancel` succeeds."""
        ...

    def submit_put(
        self, keys: Sequence[OffloadKey], rows: Sequence[memoryview], deadline: float
    ) -> int:
        """Write `keys` with the bytes of `rows`, copied before the call returns (the rows may
        be reused at once); return the ticket."""
        ...

    def poll(self) -> list[BackendCompletion]:
        """Return the completions that arrived since the last call (never waits)."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Wait until a completion has arrived, at most `timeout_s` seconds."""
        ...

    def cancel(self, ticket: int) -> bool:
        """Give up `ticket`: return True when it will never touch its rows again (and will
        not complete), False when its completion is already on its way."""
        ...

    def close(self) -> None:
        """Stop the backend: requests still queued are dropped (bounded by `timeout_s`)."""
        ...


# -- the coordinator --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SharedTierCounters:
    """Running totals of one engine's use of the shared tier."""

    probes: int
    """Keys asked about (contains)."""
    found: int
    """Of them, keys the shared tier held."""
    promoted: int
    """Chunks copied from the shared tier into CPU rows (then readable there)."""
    promoted_bytes: int
    """Their bytes."""
    promotion_failures: int
    """Chunks whose promotion failed (gone, refused, late or an error): recomputed."""
    no_room: int
    """Chunks found but not promoted: the CPU tier had no row the catalog could give."""
    written: int
    """Chunks written behind to the shared tier."""
    written_bytes: int
    """Their bytes."""
    write_failures: int
    """Chunks whose write failed (server full, down or late)."""
    refused: int
    """Values read and refused: another key, layout or length, or a bad checksum."""
    timeouts: int
    """Requests given up after `timeout_s`."""
    errors: int
    """Requests that failed (connection refused or lost, server errors)."""
    loaded_from_shared: int
    """Chunks loaded to the GPU that a promotion had brought (hits of the shared tier)."""


@attrs.define
class _Pending:
    op: Op
    keys: tuple[OffloadKey, ...]
    deadline: float
    rows: IdArray | None = None


class SharedTier:
    """Puts a `SharedBackend` below an `OffloadSession`'s CPU tier (`attach_lower_tier`).

    Lookups read `view(...)`: a key the CPU tier lacks is asked of the shared tier (pending
    meanwhile); a key found there is promoted into CPU rows the catalog reserves (pending, as
    any key being written), then a hit. A key the shared tier lacks, or any failure, answers
    a miss: the engine computes the tokens. `poll()` (once per engine step) takes the
    completions that arrived; it never waits on the network.
    """

    def __init__(
        self,
        backend: SharedBackend,
        catalog: Catalog,
        rows: RowAccess,
        settings: SharedTierSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend = backend
        self._catalog = catalog
        self._rows = rows
        self._settings = settings
        self._clock = clock
        lock = catalog.lock
        if lock is None:
            lock = threading.RLock()
            catalog.use_lock(lock)
        # the catalog's (the session's) lock: the session's hooks and `poll` take the same one
        self._lock = lock
        self._absent: dict[OffloadKey, float] = {}
        """Keys the shared tier lacked (or could not give), until when that is trusted."""
        self._probing: set[OffloadKey] = set()
        self._pending: dict[int, _Pending] = {}
        self._promoted: set[OffloadKey] = set()
        """Keys in CPU rows because a promotion brought them (until loaded)."""
        self._down_until = -1.0
        self._to_probe: list[OffloadKey] = []
        self._counts = dict.fromkeys(
            (f.name for f in attrs.fields(SharedTierCounters)),
            0,
        )

    @property
    def settings(self) -> SharedTierSettings:
        """Return the settings."""
        return self._settings

    @property
    def busy(self) -> bool:
        """Return True while a request to the shared tier is queued or in flight."""
        with self._lock:
            return bool(self._pending or self._to_probe)

    def counters(self) -> SharedTierCounters:
        """Return the running totals."""
        with self._lock:
            return SharedTierCounters(**self._counts)

    # -- the session's hooks (LowerTier) ------------------------------------------------------

    def view(self, above: KeyStatusView) -> KeyStatusView:
        """Return the view lookups read: `above`'s statuses, with the shared tier's keys."""
        return _LayeredView(above, self)

    def stored(self, keys: Sequence[OffloadKey]) -> None:
        """Write `keys` (just stored in the CPU tier) behind, when the setting says so."""
        if self._settings.write_behind is not WriteBehind.ON_STORE or not keys:
            return
        rows = [self._catalog_row(key) for key in keys]
        self._put(
            [k for k, r in zip(keys, rows, strict=True) if r >= 0], [r for r in rows if r >= 0]
        )

    def evicting(self, keys: Sequence[OffloadKey], rows: IdArray) -> None:
        """Write `keys` (being evicted from `rows`) behind, when the setting says so."""
        if self._settings.write_behind is not WriteBehind.ON_EVICTION or not keys:
            return
        self._put(list(keys), [int(row) for row in rows])

    def count_loaded(self, keys: Sequence[OffloadKey]) -> int:
        """Count, among `keys` a load job reads, those a promotion brought; return how many."""
        with self._lock:
            brought = [key for key in keys if key in self._promoted]
            self._promoted.difference_update(brought)
            self._counts["loaded_from_shared"] += len(brought)
            return len(brought)

    # -- the engine's calls -------------------------------------------------------------------

    def statuses(self, keys: Sequence[OffloadKey], above: Sequence[KeyStatus]) -> list[KeyStatus]:
        """Return `above` (the CPU tier's statuses of `keys`) with each miss the shared tier
        may hold answered pending, and queue the question (asked by the next `poll`)."""
        now = self._clock()
        out = list(above)
        with self._lock:
            if now < self._down_until:
                return out
            for i, (key, status) in enumerate(zip(keys, above, strict=True)):
                if status is not KeyStatus.MISS:
                    continue
                until = self._absent.get(key)
                if until is not None:
                    if now < until:
                        continue
                    del self._absent[key]
                if key not in self._probing:
                    self._probing.add(key)
                    self._to_probe.append(key)
                out[i] = KeyStatus.PENDING
        return out

    def poll(self) -> None:
        """Send the questions lookups queued, take the completions that arrived, and give up
        requests past their deadline; never waits."""
        with self._lock:
            now = self._clock()
            self._send_probes(now)
            for done in self._backend.poll():
                self._take(done, now)
            for ticket, pending in list(self._pending.items()):
                if now >= pending.deadline and self._backend.cancel(ticket):
                    del self._pending[ticket]
                    self._counts["timeouts"] += 1
                    self._failed(pending, now)

    def wait(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for a completion; for an engine with nothing else to do."""
        self._backend.wait(timeout_s)

    def flush(self, timeout_s: float | None = None) -> None:
        """Poll until nothing is in flight or `timeout_s` (default: the setting) has passed."""
        stop = self._clock() + (self._settings.timeout_s if timeout_s is None else timeout_s)
        self.poll()
        while self.busy and self._clock() < stop:
            self._backend.wait(min(0.01, max(0.0, stop - self._clock())))
            self.poll()

    def close(self) -> None:
        """Give up every request in flight and stop the backend."""
        with self._lock:
            now = self._clock()
            for ticket, pending in list(self._pending.items()):
                if self._backend.cancel(ticket):
                    del self._pending[ticket]
                    self._failed(pending, now)
            for done in self._backend.poll():
                self._take(done, now)
            self._backend.close()

    # -- private ------------------------------------------------------------------------------

    def _catalog_row(self, key: OffloadKey) -> int:
        entry = self._catalog.entry(key)
        return -1 if entry is None else entry.row

    def _deadline(self, now: float) -> float:
        return now + self._settings.timeout_s

    def _put(self, keys: list[OffloadKey], rows: list[int]) -> None:
        if not keys:
            return
        with self._lock:
            now = self._clock()
            if now < self._down_until:
                self._counts["write_failures"] += len(keys)
                return
            views = [self._rows(key.group, row) for key, row in zip(keys, rows, strict=True)]
            ticket = self._backend.submit_put(keys, views, self._deadline(now))
            self._pending[ticket] = _Pending(Op.PUT, tuple(keys), self._deadline(now))

    def _send_probes(self, now: float) -> None:
        if not self._to_probe:
            return
        keys, self._to_probe = tuple(self._to_probe), []
        if now < self._down_until:
            self._probing.difference_update(keys)
            return
        self._counts["probes"] += len(keys)
        ticket = self._backend.submit_contains(keys, self._deadline(now))
        self._pending[ticket] = _Pending(Op.CONTAINS, keys, self._deadline(now))

    def _take(self, done: BackendCompletion, now: float) -> None:
        pending = self._pending.pop(done.ticket, None)
        if pending is None:  # given up already
            return
        if done.error is not None:
            self._counts["errors"] += 1
            self._failed(pending, now)
            return
        if done.op is Op.CONTAINS:
            self._probing.difference_update(done.keys)
            found = [key for key, ok in zip(done.keys, done.ok, strict=True) if ok]
            self._mark_absent(
                [key for key, ok in zip(done.keys, done.ok, strict=True) if not ok], now
            )
            self._counts["found"] += len(found)
            self._promote(found, now)
        elif done.op is Op.GET:
            self._counts["refused"] += len(done.refused)
            good = [key for key, ok in zip(done.keys, done.ok, strict=True) if ok]
            bad = [key for key, ok in zip(done.keys, done.ok, strict=True) if not ok]
            self._finish_promotion(good, success=True)
            self._finish_promotion(bad, success=False)
            self._mark_absent(bad, now)
            if len(self._promoted) > _ABSENT_PRUNE:  # promoted keys evicted before a load
                self._promoted = {key for key in self._promoted if self._catalog_row(key) >= 0}
            self._promoted.update(good)
            self._counts["promoted"] += len(good)
            self._counts["promoted_bytes"] += done.nbytes
            self._counts["promotion_failures"] += len(bad)
        else:
            written = sum(done.ok)
            self._counts["written"] += written
            self._counts["written_bytes"] += done.nbytes
            self._counts["write_failures"] += len(done.ok) - written

    def _failed(self, pending: _Pending, now: float) -> None:
        self._down_until = now + self._settings.retry_after_s
        if pending.op is Op.CONTAINS:
            self._probing.difference_update(pending.keys)
            self._mark_absent(list(pending.keys), now)
        elif pending.op is Op.GET:
            self._finish_promotion(list(pending.keys), success=False)
            self._mark_absent(list(pending.keys), now)
            self._counts["promotion_failures"] += len(pending.keys)
        else:
            self._counts["write_failures"] += len(pending.keys)

    def _mark_absent(self, keys: Sequence[OffloadKey], now: float) -> None:
        if len(self._absent) > _ABSENT_PRUNE:
            self._absent = {key: t for key, t in self._absent.items() if t > now}
        until = now + self._settings.absent_ttl_s
        for key in keys:
            self._absent[key] = until

    def _promote(self, keys: list[OffloadKey], now: float) -> None:
        if not keys:
            return
        reservation = self._catalog.reserve(keys)
        if reservation is None:
            self._counts["no_room"] += len(keys)
            self._mark_absent(keys, now)
            return
        if reservation.evicted:
            self.evicting(reservation.evicted, reservation.evicted_rows)
        if not reservation.keys:
            return
        views = [
            self._rows(key.group, int(row))
            for key, row in zip(reservation.keys, reservation.rows, strict=True)
        ]
        ticket = self._backend.submit_get(reservation.keys, views, self._deadline(now))
        self._pending[ticket] = _Pending(
            Op.GET, reservation.keys, self._deadline(now), rows=reservation.rows
        )

    def _finish_promotion(self, keys: list[OffloadKey], *, success: bool) -> None:
        if not keys:
            return
        # PlanInvariantError: the catalog was reset meanwhile, nothing to finish
        with contextlib.suppress(PlanInvariantError):
            self._catalog.complete_store(keys, success=success)


class _LayeredView:
    """The CPU tier's view with the shared tier's answers for its misses."""

    def __init__(self, above: KeyStatusView, tier: SharedTier) -> None:
        self._above = above
        self._tier = tier

    def statuses(self, keys: Sequence[OffloadKey]) -> list[KeyStatus]:
        """Return the CPU tier's statuses, a miss the shared tier may hold as pending."""
        return self._tier.statuses(keys, list(self._above.statuses(keys)))


def host_rows(array: np.ndarray, tier: TierLayout) -> RowAccess:
    """Return the `RowAccess` of a CPU tier held as one uint8 `array` laid out by `tier` (an
    executor's `host_tier.array` and `host_tier.tier`): row r of group g is `tier.pitch[g]`
    bytes at `tier.row_offset(g, r)`."""
    if array.dtype != np.uint8 or array.ndim != 1:
        raise InvalidInputError(field="array", expected="a 1-D uint8 array", got=array.dtype)
    flat = array.data.cast("B")

    def access(group: int, row: int) -> memoryview:
        start = tier.row_offset(group, row)
        return flat[start : start + tier.pitch[group]]

    return access


class SharedTierError(KvferryError):
    """The shared tier cannot be used as configured (e.g. its client is not installed)."""
