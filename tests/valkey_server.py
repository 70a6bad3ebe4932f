"""Test support: a real `redis-server` (or `valkey-server`) on 127.0.0.1 at a free port in a
temporary directory, stopped at the end, and a TCP proxy that delays what it forwards."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

SERVER_BINARIES = ("valkey-server", "redis-server")


def server_binary() -> str | None:
    """Return the path of an installed server binary, or None."""
    for name in SERVER_BINARIES:
        found = shutil.which(name)
        if found:
            return found
    return None


def needs_server() -> pytest.MarkDecorator:
    """Return a mark skipping a test, with the reason, when no server binary is installed."""
    return pytest.mark.skipif(
        server_binary() is None,
        reason="needs the `redis-server` or `valkey-server` binary (apt-get install redis-server)",
    )


def free_port() -> int:
    """Return a TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Server:
    """One server process; `start`, `stop`, `restart` (empty: it saves nothing)."""

    def __init__(
        self,
        directory: Path,
        extra: Sequence[str] = (),
        *,
        tls: bool = False,
        port: int | None = None,
    ) -> None:
        binary = server_binary()
        if binary is None:
            pytest.skip("needs the `redis-server` or `valkey-server` binary")
        self.binary = binary
        self.directory = directory
        self.extra = list(extra)
        self.port = free_port() if port is None else port
        self.tls = tls
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [
            self.binary,
            *(("--port", "0", "--tls-port") if self.tls else ("--port",)),
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            str(self.directory / "server.log"),
            *self.extra,
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stop = time.monotonic() + 10
        while time.monotonic() < stop:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    if self.tls:  # listening is all a plain socket can tell
                        return
                    conn.sendall(b"PING\r\n")
                    answer = conn.recv(64)
                    if answer.startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            if self.process.poll() is not None:
                break
            time.sleep(0.02)
        log = (self.directory / "server.log").read_text(errors="replace")
        raise RuntimeError(f"the server did not start on port {self.port}: {log[-2000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


def server_in(directory: Path, extra: Sequence[str] = (), *, tls: bool = False) -> Iterator[Server]:
    """Yield a started server; stop it afterwards."""
    server = Server(directory, extra, tls=tls)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """Make a CA and a server certificate for 127.0.0.1 with `openssl`; return the CA's
    certificate, the server's certificate and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the `openssl` command to make test certificates")
    ca_key, ca, key, csr, cert = (
        directory / name for name in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt")
    )
    ext = directory / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
            "/CN=kvferry test CA", "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", str(key), "-out", str(csr))  # fmt: skip
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    return ca, cert, key


class DelayProxy:
    """Forwards 127.0.0.1:`port` to `target`, holding each piece of data `delay_s` seconds."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.delay_s = delay_s
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closing = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(1 << 16)
                if not data:
                    break
                time.sleep(self.delay_s)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closing = True
        self._listener.close()
        for sock in self._sockets:
            sock.close()


def cluster_in(directory: Path, nodes: int = 3) -> Iterator[list[Server]]:
    """Yield the started nodes of a cluster (every slot assigned, no replicas); stop them
    afterwards. Skips without the `redis-cli` or `valkey-cli` that creates it."""
    cli = shutil.which("valkey-cli") or shutil.which("redis-cli")
    if cli is None:
        pytest.skip("needs `redis-cli` or `valkey-cli` to create a cluster")
    servers = []
    try:
        for index in range(nodes):
            folder = directory / f"node{index}"
            folder.mkdir()
            port = free_port()
            while port > 55535:  # a node's bus listens on its port + 10000
                port = free_port()
            flags = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            server = Server(folder, flags, port=port)
            server.start()
            servers.append(server)
        addresses = [f"127.0.0.1:{server.port}" for server in servers]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        stop = time.monotonic() + 30
        while time.monotonic() < stop:
            states = [
                subprocess.run(
                    [cli, "-p", str(server.port), "cluster", "info"],
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout
                for server in servers
            ]
            if all("cluster_state:ok" in state for state in states):
                break
            time.sleep(0.1)
        yield servers
    finally:
        for server in servers:
            server.stop()
