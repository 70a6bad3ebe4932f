"""The compact binary form of a jobs message: bound plans to workers as numpy buffers.

A message a scheduler sends every step should cost microseconds, not the milliseconds of
pretty JSON: a 2048-block load plan in three groups is ~6 000 keys and block ids, which JSON
writes and parses one number at a time. Here every column of a plan travels as its raw
little-endian bytes, read back by `np.frombuffer` without a Python step per number or key: the
keys' groups as an i64 array, their hashes back to back (one length for all, or one length per
hash when they differ), and the worker gets them as a `KeyColumn` again, which makes an
`OffloadKey` only when something reads one (a worker never does). JSON
(`kvferry.adapters.messages.encode_jobs`) stays the readable form: golden files, `kvferry plan`,
and debugging.

Numpy only: the worker side's import chain needs nothing more than the executors do.

Layout (little-endian): the magic `MAGIC`, a u16 format version, a u32 job count, then per job
a fixed header (`_JOB`) followed by the request id and layout fingerprint (UTF-8), the group
sizes and block indices (i64 each), the key groups (i64), then either (hash width > 0) the
hashes back to back, or (width 0) the hash lengths (u32) and the hashes, then the GPU block
ids and the CPU rows (i64). Decoding is strict: every length is checked against the bytes
left, and a plan is validated like any other; bad input raises InvalidInputError naming the
field.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from kvferry.core.bound import BoundPlan
from kvferry.core.errors import InvalidInputError
from kvferry.core.keys import KeyColumn
from kvferry.core.plan import Direction, TransferPlan

MAGIC = b"KVFJ"
"""The first bytes of a binary jobs message (never the `{` a JSON message starts with)."""
WIRE_VERSION = 2
"""Bumped whenever the layout changes."""

_HEAD = struct.Struct("<4sHI")
_JOB = struct.Struct("<qBIIIIIIiI")
"""job id, direction (0 load, 1 store), blocks per chunk, groups, keys, GPU ids, CPU rows,
request id bytes, fingerprint bytes (-1: none), hash width (0: one length per hash)."""
_DIRECTIONS = (Direction.LOAD, Direction.STORE)
_I64 = np.dtype("<i8")
_U32 = np.dtype("<u4")


def is_binary(data: bytes | bytearray | memoryview) -> bool:
    """Return True when `data` starts like a binary jobs message."""
    return bytes(data[: len(MAGIC)]) == MAGIC


def encode_jobs_binary(jobs: Sequence[BoundPlan]) -> bytes:
    """Return the binary message carrying `jobs` to the workers (`decode_jobs_binary` reads it)."""
    parts: list[bytes] = [_HEAD.pack(MAGIC, WIRE_VERSION, len(jobs))]
    for job in jobs:
        plan = job.plan
        rid = plan.request_id.encode("utf-8")
        fingerprint = None if job.layout_fingerprint is None else job.layout_fingerprint.encode()
        keys = plan.keys
        blob, width = keys.hash_blob()
        if width > 0:
            hash_parts = [blob]
        else:
            hashes = keys.hashes()
            lengths = np.fromiter(map(len, hashes), dtype=_U32, count=len(hashes))
            hash_parts = [lengths.tobytes(), b"".join(hashes)]
        parts += [
            _JOB.pack(
                job.job_id,
                _DIRECTIONS.index(plan.direction),
                plan.blocks_per_chunk,
                plan.num_groups,
                len(keys),
                len(plan.gpu_block_ids),
                len(job.cpu_rows),
                len(rid),
                -1 if fingerprint is None else len(fingerprint),
                max(width, 0),
            ),
            rid,
            fingerprint or b"",
            np.asarray(plan.group_sizes, dtype=_I64).tobytes(),
            np.asarray(plan.block_indices, dtype=_I64).tobytes(),
            keys.groups.astype(_I64, copy=False).tobytes(),
            *hash_parts,
            np.asarray(plan.gpu_block_ids, dtype=_I64).tobytes(),
            np.asarray(job.cpu_rows, dtype=_I64).tobytes(),
        ]
    return b"".join(parts)


class _Reader:
    """Reads a message front to back, refusing any read past its end."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, size: int, field: str) -> bytes:
        if size < 0 or self.at + size > len(self.data):
            raise InvalidInputError(
                field=field,
                expected=f"{size} bytes",
                got=f"{len(self.data) - self.at} bytes left",
            )
        chunk = self.data[self.at : self.at + size]
        self.at += size
        return chunk

    def array(self, count: int, dtype: np.dtype[np.generic], field: str) -> np.ndarray:
        size = count * dtype.itemsize
        if size < 0 or self.at + size > len(self.data):
            self.take(size, field)  # raises, naming the field
        array = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.at)
        self.at += size
        return array

    def text(self, size: int, field: str) -> str:
        try:
            return self.take(size, field).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInputError(field=field, expected="UTF-8 text", got=str(exc)) from exc


def decode_jobs_binary(data: bytes | bytearray | memoryview) -> tuple[BoundPlan, ...]:
    """Return the bound plans of an `encode_jobs_binary` message (validated like any plan)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidInputError(field="message", expected="bytes", got=type(data).__name__)
    reader = _Reader(bytes(data))
    magic, version, count = _HEAD.unpack(reader.take(_HEAD.size, "message"))
    if magic != MAGIC:
        raise InvalidInputError(field="message", expected=f"the magic {MAGIC!r}", got=magic)
    if version != WIRE_VERSION:
        raise InvalidInputError(field="wire_version", expected=str(WIRE_VERSION), got=version)
    jobs = []
    for _ in range(count):
        (
            job_id,
            direction,
            per_chunk,
            groups,
            num_keys,
            num_ids,
            num_rows,
            rid_len,
            fp_len,
            width,
        ) = _JOB.unpack(reader.take(_JOB.size, "jobs[]"))
        if direction >= len(_DIRECTIONS):
            raise InvalidInputError(
                field="direction", expected="0 (load) or 1 (store)", got=direction
            )
        request_id = reader.text(rid_len, "request_id")
        fingerprint = None if fp_len == -1 else reader.text(fp_len, "layout_fingerprint")
        group_sizes = reader.array(groups, _I64, "group_sizes").tolist()
        block_indices = reader.array(groups, _I64, "block_indices").tolist()
        key_groups = reader.array(num_keys, _I64, "keys")
        if width:
            keys = KeyColumn.of_blob(key_groups, reader.take(num_keys * width, "keys"), width)
        else:
            lengths = reader.array(num_keys, _U32, "keys")
            blob = reader.take(int(lengths.sum()), "keys")
            ends = np.cumsum(lengths).tolist()
            hashes = [blob[s:e] for s, e in zip([0, *ends[:-1]], ends, strict=True)]
            keys = KeyColumn.of_hashes(key_groups, hashes)
        plan = TransferPlan(
            request_id=request_id,
            direction=_DIRECTIONS[direction],
            blocks_per_chunk=per_chunk,
            keys=keys,
            gpu_block_ids=reader.array(num_ids, _I64, "gpu_block_ids"),
            group_sizes=group_sizes,
            block_indices=block_indices,
        )
        jobs.append(
            BoundPlan(
                job_id=job_id,
                plan=plan,
                cpu_rows=reader.array(num_rows, _I64, "cpu_rows"),
                layout_fingerprint=fingerprint,
            )
        )
    if reader.at != len(reader.data):
        raise InvalidInputError(
            field="message",
            expected="no bytes after the last job",
            got=len(reader.data) - reader.at,
        )
    return tuple(jobs)
