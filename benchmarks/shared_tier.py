"""Shared tier: promotion throughput into CPU rows and lookup latency on a Valkey/Redis server,
each against a plain pipelined `GET` (or `EXISTS`) of the same keys by the same client.

Promotion is the backend's `get` into rows: one pipelined `GET` per chunk, each value's key,
layout fingerprint and checksum checked, its payload copied into its row, reported as a
completion. The plain run fetches the same stored values with the same connection and does
nothing with them. Both run in turns, in the same process; the bars ask kvferry's paths to
keep at least 0.9 of the plain rate (and of the plain latency's inverse). Without `--url`, a
local `redis-server` or `valkey-server` is started on 127.0.0.1 at a free port and stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvferry.adapters.shared_tier import BackendCompletion, SharedTierSettings
from kvferry.adapters.valkey_tier import ValkeyBackend
from kvferry.benchmarks.common import (
    EXIT_SKIPPED,
    add_common_options,
    bar_line,
    bar_result,
    measured_on,
    measured_on_line,
    output_paths,
    positive_int,
    pyplot,
    save_plot,
    write_json,
)
from kvferry.core.keys import OffloadKey

NAME = "shared-tier"
BAR = 0.9
"""kvferry's rate as a fraction of the plain client's, at least."""
FINGERPRINT = "benchmark0000000"


@contextlib.contextmanager
def local_server() -> Iterator[str | None]:
    """Start a server binary on 127.0.0.1 at a free port; yield its URL (None: no binary)."""
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", folder]
        args += ["--save", "", "--appendonly", "no", "--logfile", str(Path(folder) / "log")]
        process = subprocess.Popen(args)
        try:
            stop = time.monotonic() + 10
            while time.monotonic() < stop:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    break
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}"
        finally:
            process.terminate()
            process.wait(10)


def _wait(backend: ValkeyBackend, ticket: int) -> BackendCompletion:
    while True:
        for done in backend.poll():
            if done.ticket == ticket:
                return done
        backend.wait(0.001)


def measure(
    url: str, *, chunk_bytes: int, chunks: int, lookup_keys: int, rounds: int
) -> dict[str, Any]:
    """Return the rates and latencies measured on the server at `url`."""
    settings = SharedTierSettings(url=url, model="benchmark", timeout_s=60.0)
    backend = ValkeyBackend(settings, FINGERPRINT)
    client = backend.client  # the same client and connection for the plain runs
    keys = [OffloadKey(0, i.to_bytes(16, "big")) for i in range(chunks)]
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, size=chunks * chunk_bytes, dtype=np.uint8)
    rows = np.zeros_like(source)
    views = [rows.data[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(chunks)]
    put = backend.submit_put(
        keys, [source.data[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(chunks)],
        time.monotonic() + 60,
    )  # fmt: skip
    if not all(_wait(backend, put).ok):
        raise RuntimeError("the benchmark's values could not be written")
    names = [backend.name(key) for key in keys]
    total = chunks * chunk_bytes

    def promote() -> float:
        start = time.perf_counter()
        done = _wait(backend, backend.submit_get(keys, views, time.monotonic() + 60))
        elapsed = time.perf_counter() - start
        if not all(done.ok):
            raise RuntimeError("a promotion failed")
        return total / elapsed / 1e9

    def plain_get() -> float:
        start = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        pipe.execute()
        return total / (time.perf_counter() - start) / 1e9

    lookup = keys[:lookup_keys]
    lookup_names = names[:lookup_keys]

    def contains() -> float:
        start = time.perf_counter()
        _wait(backend, backend.submit_contains(lookup, time.monotonic() + 60))
        return (time.perf_counter() - start) * 1e6

    def plain_exists() -> float:
        start = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for name in lookup_names:
            pipe.exists(name)
        pipe.execute()
        return (time.perf_counter() - start) * 1e6

    promote(), plain_get(), contains(), plain_exists()  # warm every path
    ours, plain, ours_us, plain_us = [], [], [], []
    for _ in range(rounds):  # in turns: both see the same machine
        ours.append(promote())
        plain.append(plain_get())
    for _ in range(rounds * 4):  # lookups are short: more turns, apart from the bulk reads
        ours_us.append(contains())
        plain_us.append(plain_exists())
    if not np.array_equal(rows, source):
        raise RuntimeError("the promoted rows differ from the bytes written")
    backend.close()
    return {
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
        "lookup_keys": lookup_keys,
        "rounds": rounds,
        "promotion_gbps": statistics.median(ours),
        "plain_get_gbps": statistics.median(plain),
        "lookup_us": statistics.median(ours_us),
        "plain_exists_us": statistics.median(plain_us),
    }


def plot(result: dict[str, Any], png: Path, *, log: TextIO | None = None) -> Path | None:
    """Draw kvferry's rates beside the plain client's; return the PNG's path, or None (said
    on `log`) without matplotlib."""
    plt = pyplot(log)
    if plt is None:
        return None
    figure, (rate, latency) = plt.subplots(1, 2, figsize=(8, 3.5))
    rate.bar(["promotion\ninto rows", "plain\npipelined GET"],
             [result["promotion_gbps"], result["plain_get_gbps"]])  # fmt: skip
    rate.set_ylabel("GB/s")
    latency.bar([f"lookup\n({result['lookup_keys']} keys)", "plain\npipelined EXISTS"],
                [result["lookup_us"], result["plain_exists_us"]])  # fmt: skip
    latency.set_ylabel("microseconds (lower is better)")
    measured = result["measured_on"]
    return save_plot(
        plt,
        figure,
        png,
        f"kvferry shared tier, CPU {measured['cpu']}, {measured['date']}, {result['server']}",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Measure; print the table and the PASS/FAIL lines; write the JSON; return 0 (or
    EXIT_SKIPPED when no server is given and none can be started)."""
    parser = argparse.ArgumentParser(
        prog=f"kvferry bench {NAME}", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--url", help="a server to measure (default: start a local one)")
    parser.add_argument("--chunk-kib", type=positive_int, default=1024, help="default 1024")
    parser.add_argument("--chunks", type=positive_int, default=64, help="per batch (default 64)")
    parser.add_argument(
        "--lookup-keys",
        type=positive_int,
        default=64,
        help="keys per lookup (default 64: a 4096-token prompt in chunks of 64 tokens)",
    )
    parser.add_argument("--rounds", type=positive_int, default=None, help="default 15")
    add_common_options(parser, quick="a short run: 5 rounds of 16 chunks")
    args = parser.parse_args(argv)
    rounds = args.rounds or (5 if args.quick else 15)
    chunks = 16 if args.quick else args.chunks
    info = measured_on()
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(local_server())
        if url is None:
            print(
                f"kvferry bench {NAME}: skipped: no --url and no `redis-server` or "
                "`valkey-server` to start (apt-get install redis-server)",
                file=sys.stderr,
            )
            return EXIT_SKIPPED
        where = "a given server" if args.url else "a local server on 127.0.0.1 (loopback)"
        result = measure(
            url,
            chunk_bytes=args.chunk_kib * 1024,
            chunks=chunks,
            lookup_keys=min(args.lookup_keys, chunks),
            rounds=rounds,
        )
    print(measured_on_line(info) + f"; {where}")
    promotion = result["promotion_gbps"] / result["plain_get_gbps"]
    lookup = result["plain_exists_us"] / result["lookup_us"]
    print(
        f"promotion into rows  {result['promotion_gbps']:.3f} GB/s; plain pipelined GET "
        f"{result['plain_get_gbps']:.3f} GB/s ({chunks} chunks of {args.chunk_kib} KiB)"
    )
    print(
        f"lookup (contains)    {result['lookup_us']:.0f} us; plain pipelined EXISTS "
        f"{result['plain_exists_us']:.0f} us ({result['lookup_keys']} keys)"
    )
    bars = [
        (promotion >= BAR, f"promotion >= {BAR} x plain GET", f"{promotion:.2f} x"),
        (lookup >= BAR, f"lookup rate >= {BAR} x plain EXISTS", f"{lookup:.2f} x"),
    ]
    for passed, bar, measured in bars:
        print(bar_line(passed, bar, measured))
    json_path, png_path = output_paths(args.out, NAME)
    data = {"measured_on": info, "server": where, **result, "bars": [bar_result(*b) for b in bars]}
    write_json(json_path, data)
    print(f"wrote {json_path}")
    if plot(data, png_path) is not None:
        print(f"wrote {png_path}")
    return 0
