"""The Valkey/Redis backend against a real server: batch contains, get into rows, put from
rows, namespacing by model and layout, and refusal of values that do not match."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from valkey_server import Server, needs_server, server_in

from kvferry.adapters.shared_tier import (
    BackendCompletion,
    Op,
    SharedTierSettings,
    ValueRefused,
    decode_value,
    encode_value,
)
from kvferry.adapters.valkey_tier import ValkeyBackend, connect
from kvferry.core.keys import OffloadKey

pytestmark = needs_server()
FP = "0123456789abcdef"
KEYS = tuple(OffloadKey(g, bytes([i, 0, 255, 10, 13])) for g in (0, 1) for i in range(3))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    yield from server_in(tmp_path)


def backend(url: str, *, model: str = "m", fingerprint: str = FP) -> ValkeyBackend:
    return ValkeyBackend(SharedTierSettings(url=url, model=model, timeout_s=2.0), fingerprint)


def payload(key: OffloadKey, size: int = 1000) -> bytearray:
    seed = key.group * 7 + key.block_hash[0]
    return bytearray((seed + i * 31) % 256 for i in range(size))


def complete(b: ValkeyBackend, ticket: int) -> BackendCompletion:
    stop = time.monotonic() + 5
    while time.monotonic() < stop:
        for done in b.poll():
            if done.ticket == ticket:
                return done
        b.wait(0.05)
    raise AssertionError(f"ticket {ticket} did not complete")


def put(b: ValkeyBackend, keys: tuple[OffloadKey, ...]) -> BackendCompletion:
    rows = [memoryview(payload(key)) for key in keys]
    return complete(b, b.submit_put(keys, rows, time.monotonic() + 5))


def get(
    b: ValkeyBackend, keys: tuple[OffloadKey, ...]
) -> tuple[BackendCompletion, list[bytearray]]:
    rows = [bytearray(1000) for _ in keys]
    done = complete(b, b.submit_get(keys, [memoryview(r) for r in rows], time.monotonic() + 5))
    return done, rows


def test_put_then_contains_and_get_bring_the_same_bytes(server: Server) -> None:
    b = backend(server.url)
    assert put(b, KEYS[:4]).ok == (True,) * 4
    contains = complete(b, b.submit_contains(KEYS, time.monotonic() + 5))
    assert contains.op is Op.CONTAINS
    assert contains.ok == (True,) * 4 + (False,) * 2
    done, rows = get(b, KEYS)
    assert done.ok == (True,) * 4 + (False,) * 2
    assert done.nbytes == 4000
    assert [bytes(r) for r in rows[:4]] == [bytes(payload(k)) for k in KEYS[:4]]
    assert rows[4] == bytearray(1000)  # a key the tier lacks leaves its row untouched
    b.close()


def test_put_copies_the_rows_before_returning(server: Server) -> None:
    b = backend(server.url)
    row = payload(KEYS[0])
    ticket = b.submit_put(KEYS[:1], [memoryview(row)], time.monotonic() + 5)
    row[:] = bytes(1000)  # the row is reused at once
    assert complete(b, ticket).ok == (True,)
    _, rows = get(b, KEYS[:1])
    assert bytes(rows[0]) == bytes(payload(KEYS[0]))
    b.close()


def test_keys_and_values_are_binary_and_namespaced(server: Server) -> None:
    b = backend(server.url, model="model-a")
    put(b, KEYS[:1])
    names = connect(SharedTierSettings(url=server.url, model="x")).keys("*")
    assert names == [b"kvferry/model-a/" + FP.encode() + b"/0/" + KEYS[0].block_hash]
    b.close()


def test_another_model_never_sees_the_keys(server: Server) -> None:
    a, other = backend(server.url, model="a"), backend(server.url, model="b")
    put(a, KEYS)
    assert complete(other, other.submit_contains(KEYS, time.monotonic() + 5)).ok == (False,) * 6
    a.close()
    other.close()


def test_another_layout_never_sees_the_keys(server: Server) -> None:
    a, other = backend(server.url), backend(server.url, fingerprint="fedcba9876543210")
    put(a, KEYS)
    done, rows = get(other, KEYS)
    assert done.ok == (False,) * 6
    assert rows == [bytearray(1000)] * 6
    a.close()
    other.close()


def test_a_value_with_a_bad_checksum_is_refused_and_counted(server: Server) -> None:
    b = backend(server.url)
    put(b, KEYS[:2])
    client = connect(SharedTierSettings(url=server.url, model="m"))
    name = b.name(KEYS[0])
    value = bytearray(client.get(name))
    value[-1] ^= 0xFF  # one payload byte flipped on the server
    client.set(name, bytes(value))
    done, rows = get(b, KEYS[:2])
    assert done.ok == (False, True)
    assert done.refused == (ValueRefused.CHECKSUM,)
    assert rows[0] == bytearray(1000)  # never loaded
    b.close()


def test_a_value_stored_under_another_key_is_refused(server: Server) -> None:
    b = backend(server.url)
    put(b, KEYS[:2])
    client = connect(SharedTierSettings(url=server.url, model="m"))
    client.set(b.name(KEYS[0]), client.get(b.name(KEYS[1])))
    done, _ = get(b, KEYS[:1])
    assert done.ok == (False,)
    assert done.refused == (ValueRefused.KEY,)
    b.close()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("fingerprint", ValueRefused.FINGERPRINT),
        ("length", ValueRefused.LENGTH),
        ("magic", ValueRefused.FORMAT),
    ],
)
def test_decode_refuses_a_value_that_does_not_match(change: str, reason: ValueRefused) -> None:
    name = b"kvferry/m/fp/0/x"
    value = encode_value(name, FP, b"payload!")
    if change == "fingerprint":
        assert decode_value(value, name, "another", 8) is reason
    elif change == "length":
        assert decode_value(value, name, FP, 9) is reason
    else:
        assert decode_value(b"XXXX" + value[4:], name, FP, 8) is reason


def test_decode_returns_the_payload_of_a_matching_value() -> None:
    name = b"kvferry/m/fp/0/x"
    got = decode_value(encode_value(name, FP, b"payload!"), name, FP, 8)
    assert isinstance(got, memoryview)
    assert bytes(got) == b"payload!"


def test_a_cancelled_get_never_completes(server: Server) -> None:
    b = backend(server.url)
    b.close()  # the thread is gone: the request stays queued
    rows = [bytearray(1000)]
    ticket = b.submit_get(KEYS[:1], [memoryview(r) for r in rows], time.monotonic() + 5)
    assert b.cancel(ticket)
    time.sleep(0.1)
    assert b.poll() == []
