"""Real S3 over HTTP on 127.0.0.1 for the tests: a moto server, and a fault-injecting proxy.

``S3Server`` serves moto's S3 application (through waitress) on a free loopback port, and can record the
requests it answers (``recording()``: method, key, query, start and end time), so a test counts
what a client really sends over HTTP; ``latency`` adds a delay to every answer, as a distant
object store has (and so requests sent concurrently surely overlap). ``S3ServerProcess`` is
the same server in a child process, controlled over its own port (benchmarks: moto's work then
takes no time from the measured process). ``FaultProxy``
sits between a client and that server and, for a share of requests (and/or every N-th), answers 503 SlowDown,
resets or drops the connection, cuts a response short, or stalls until the client times out;
rules can make a fault persistent (every request to one object) or refuse writes (a read-only
credential). It is bounded (at most ``max_faults`` random faults) and stops itself after
``lifetime`` seconds. All traffic stays on the loopback interface.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import selectors
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import unquote

# A distinctive fake credential: tests grep every output for it.
FAKE_KEY_ID = "AKIAMMCACHEFAKEKEY01"
FAKE_SECRET = "mmcacheFAKEsecretKEY0123456789abcdefXYZ"

_503 = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
_503_BODY = b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
_403_BODY = b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"


@dataclass(frozen=True)
class Request:
    """One request the server answered: ``key`` is the path after the bucket (empty for a
    bucket-level request such as a listing, whose ``query`` says what it listed)."""

    method: str
    bucket: str
    key: str
    query: str
    start: float
    end: float
    if_none_match: str | None  # the header of a conditional PUT (create only if absent)
    nbytes: int | None = None  # the answer's body length (its Content-Length; 0 for a HEAD)


def rounds(requests: list[Request]) -> int:
    """How many round trips deep ``requests`` were: the number of stretches of time in which
    some request was in flight (requests sent concurrently overlap and count once)."""
    depth, busy_until = 0, float("-inf")
    for req in sorted(requests, key=lambda r: r.start):
        if req.start > busy_until:
            depth += 1
        busy_until = max(busy_until, req.end)
    return depth


class S3Server:
    def __init__(self) -> None:
        import waitress
        from moto.server import create_backend_app

        # moto's S3 application itself, not its all-services dispatcher: that one looks up the
        # service of every request under one global lock, listing moto's package directory
        # (~180 stat calls a request, half of the server's time). Served by waitress, which
        # keeps connections open between requests as S3 does (moto's own werkzeug server
        # closes every connection after one answer, so each request paid a TCP handshake and a
        # new thread). Both costs belong to the test server, not to the client being measured.
        app = create_backend_app("s3")
        self._records: list[list[Request]] = []
        self._remote: dict[int, list[Request]] = {}  # recordings an S3ServerProcess started
        self._lock = threading.Lock()
        self.latency = 0.0  # seconds added before every answer

        # Every request passes through this wrapper of moto's WSGI app on its way in and out.
        def recorded(environ, start_response):
            if environ.get("PATH_INFO", "").startswith(_CONTROL):
                return self._control(environ, start_response)
            start = time.perf_counter()
            if self.latency:
                time.sleep(self.latency)
            sent: list[int] = []

            def answer(status, headers, exc_info=None):
                sent[:] = [int(v) for k, v in headers if k.lower() == "content-length"]
                return start_response(status, headers, exc_info)

            try:
                return app(environ, answer)
            finally:
                if self._records:
                    bucket, _, key = unquote(environ.get("PATH_INFO", "")).lstrip("/").partition("/")
                    method = environ["REQUEST_METHOD"]
                    req = Request(method, bucket, key, unquote(environ.get("QUERY_STRING", "")), start, time.perf_counter(),
                                  environ.get("HTTP_IF_NONE_MATCH"), 0 if method == "HEAD" else (sent[0] if sent else None))
                    with self._lock:
                        for record in self._records:
                            record.append(req)

        logging.getLogger("waitress.queue").setLevel(logging.ERROR)  # no "task queue depth" lines
        # Threads enough that requests sent at once are answered at once (``latency`` relies on
        # it); poll(), not select(), so descriptors past 1024 work in a long test process.
        self._server = waitress.create_server(recorded, host="127.0.0.1", port=0, threads=64, connection_limit=1000,
                                              asyncore_use_poll=True, ident="mmcache-tests-s3")
        self.host, self.port = "127.0.0.1", self._server.effective_port
        self.endpoint = f"http://{self.host}:{self.port}"
        self._thread = threading.Thread(target=self._server.run, name="s3-server", daemon=True)
        self._thread.start()

    @contextmanager
    def slowed(self, latency: float) -> Iterator[None]:
        """Every answer ``latency`` seconds late while the block runs."""
        self.latency = latency
        try:
            yield
        finally:
            self.latency = 0.0

    @contextmanager
    def recording(self) -> Iterator[list[Request]]:
        """The requests answered while the block runs (from this and every other process)."""
        record: list[Request] = []
        with self._lock:
            self._records.append(record)
        try:
            yield record
        finally:
            with self._lock:
                self._records.remove(record)

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The standard AWS variables a user would set (no flags needed with them)."""
        return {
            "AWS_ACCESS_KEY_ID": FAKE_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": "/nonexistent/mmcache-test-aws-config",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/mmcache-test-aws-credentials",
        }

    def make_bucket(self, prefix: str = "t") -> str:
        import s3fs

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        fs = s3fs.S3FileSystem(key=FAKE_KEY_ID, secret=FAKE_SECRET, endpoint_url=self.endpoint, skip_instance_cache=True)
        fs.mkdir(name)
        return f"s3://{name}"

    def stop(self) -> None:
        from waitress import wasyncore

        self._server.task_dispatcher.shutdown()
        wasyncore.close_all(self._server._map)  # the serving loop ends once its map is empty
        self._thread.join(10)

    def _control(self, environ, start_response):
        """``S3ServerProcess``'s requests: start or collect a recording, set the latency.
        (No S3 bucket can be named like the control path: underscores are not allowed.)"""
        command = environ["PATH_INFO"][len(_CONTROL):]
        query = dict(p.partition("=")[::2] for p in environ.get("QUERY_STRING", "").split("&") if p)
        body: object = None
        if command == "record":
            with self._lock:
                self._records.append([])
                self._remote[id(self._records[-1])] = self._records[-1]
                body = id(self._records[-1])
        elif command == "collect":
            with self._lock:
                record = self._remote.pop(int(query["id"]))
                self._records.remove(record)
            body = [dataclasses.asdict(r) for r in record]
        elif command == "latency":
            self.latency = float(query["seconds"])
        else:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"unknown control command"]
        data = json.dumps(body).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]


_CONTROL = "/_mmcache_control/"


class S3ServerProcess:
    """An ``S3Server`` in a child process, with the same interface: the server's own work (moto
    answers every request in Python) then takes no time from this process's threads, as a real
    object store's would not. Benchmarks use it; the tests share one in-process server. The child
    exits when this process does (it watches its stdin)."""

    def __init__(self) -> None:
        import subprocess
        import sys
        from pathlib import Path

        self._proc = subprocess.Popen([sys.executable, "-m", "tests.s3_server"], cwd=Path(__file__).resolve().parents[1],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self._proc.stdout.readline() if self._proc.stdout else ""
        if not line.startswith("http://"):
            self._proc.kill()
            raise RuntimeError(f"the S3 server process did not start (it said {line!r})")
        self.endpoint = line.strip()
        host, _, port = self.endpoint.removeprefix("http://").rpartition(":")
        self.host, self.port = host, int(port)

    def _ask(self, command: str, **query: object) -> object:
        import urllib.request

        url = f"{self.endpoint}{_CONTROL}{command}" + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")
        with urllib.request.urlopen(url, timeout=30) as answer:
            return json.loads(answer.read())

    @contextmanager
    def slowed(self, latency: float) -> Iterator[None]:
        self._ask("latency", seconds=latency)
        try:
            yield
        finally:
            self._ask("latency", seconds=0.0)

    @contextmanager
    def recording(self) -> Iterator[list[Request]]:
        """The requests answered while the block runs; the list fills when the block ends."""
        handle = self._ask("record")
        record: list[Request] = []
        try:
            yield record
        finally:
            record.extend(Request(**r) for r in self._ask("collect", id=handle))  # type: ignore[union-attr]

    env = S3Server.env
    make_bucket = S3Server.make_bucket

    def cpu_seconds(self) -> float:
        """CPU time the server process has used so far (user + system)."""
        import os

        fields = open(f"/proc/{self._proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self._proc.stdin:
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except Exception:
            self._proc.kill()
            raise


def _serve() -> None:
    """``python -m tests.s3_server``: serve until stdin closes (the parent went away)."""
    import sys

    server = S3Server()
    print(server.endpoint, flush=True)
    sys.stdin.read()
    server.stop()


class FaultProxy:
    """A loopback HTTP proxy that injects faults into a share of the requests passing through."""

    KINDS = ("503", "reset", "drop", "cut")

    def __init__(self, upstream: tuple[str, int], *, share: float = 0.0, kinds: tuple[str, ...] = KINDS,
                 max_faults: int = 60, seed: int = 0, lifetime: float = 300.0, stall_s: float = 2.0,
                 every: int = 0) -> None:
        self.upstream = upstream
        self.share, self.kinds, self.max_faults, self.stall_s = share, kinds, max_faults, stall_s
        self.every = every  # also fault every N-th request (cycling through the kinds): at least some, for sure
        self.rules: list[Callable[[str, str], str | None]] = []  # (method, path) -> fault kind
        self.deny_writes = False
        self.counts: Counter[str] = Counter()
        self.requests = 0
        self.bytes_down = 0  # bytes the upstream answered (HTTP heads and bodies) forwarded to clients
        self.methods: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()
        self._timer = threading.Timer(lifetime, self.stop)  # stops itself, whatever happens
        self._timer.daemon = True
        self._timer.start()

    @property
    def faults(self) -> int:
        return sum(v for k, v in self.counts.items() if k != "passed")

    def stop(self) -> None:
        self._stopped.set()
        self._timer.cancel()
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- plumbing -----------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _decide(self, method: str, path: str) -> str | None:
        with self._lock:
            self.requests += 1
            self.methods[method] += 1
            for rule in self.rules:
                kind = rule(method, path)
                if kind:
                    self.counts[kind] += 1
                    return kind
            if self.deny_writes and method in ("PUT", "POST", "DELETE"):
                self.counts["403"] += 1
                return "403"
            if self.faults < self.max_faults and self.every and self.requests % self.every == 0:
                kind = self.kinds[(self.requests // self.every) % len(self.kinds)]
                self.counts[kind] += 1
                return kind
            if self.faults < self.max_faults and self._rng.random() < self.share:
                kind = self._rng.choice(self.kinds)
                self.counts[kind] += 1
                return kind
            self.counts["passed"] += 1
            return None

    def _count_down(self, nbytes: int) -> None:
        # Counted before the bytes go out: a client that has its answer finds them counted, even
        # while the server has yet to close the connection (when the pump ends).
        with self._lock:
            self.bytes_down += nbytes

    def _handle(self, client: socket.socket) -> None:
        upstream = None
        try:
            client.settimeout(30)
            head, rest = _read_head(client)
            if head is None:
                return
            lines = head.split(b"\r\n")
            method, path = (lines[0].split(b" ") + [b"", b""])[:2]
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:] if line)}
            kind = self._decide(method.decode(), path.decode())
            if kind in ("503", "403"):
                body = _503_BODY if kind == "503" else _403_BODY
                status = b"503 Slow Down" if kind == "503" else b"403 Forbidden"
                if b"100-continue" not in headers.get(b"expect", b"").lower():
                    _drain(client, int(headers.get(b"content-length", b"0") or 0) - len(rest))
                client.sendall((_503.replace(b"503 Slow Down", status)) % (len(body), body))
                return
            if kind == "reset":
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            if kind == "drop":
                return
            if kind == "stall":
                time.sleep(self.stall_s)
                return
            upstream = socket.create_connection(self.upstream, timeout=30)
            upstream.sendall(_force_close(head) + rest)
            _pump(client, upstream, cut=kind == "cut", count=self._count_down)
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    try:
                        sock.close()
                    except OSError:
                        pass


def _read_head(sock: socket.socket) -> tuple[bytes | None, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
        if len(data) > 1 << 20:
            return None, b""
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _force_close(head: bytes) -> bytes:
    # One request per connection, so every request gets its own fault decision.
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n"


def _drain(sock: socket.socket, nbytes: int) -> None:
    while nbytes > 0:
        chunk = sock.recv(min(nbytes, 1 << 20))
        if not chunk:
            return
        nbytes -= len(chunk)


def _pump(client: socket.socket, upstream: socket.socket, cut: bool, count: Callable[[int], None]) -> None:
    """Copy bytes both ways until the server closes, passing ``count`` the size of each part of
    the answer before forwarding it to the client. ``cut``: forward only part of the answer, then
    reset the connection (a response cut short mid-body)."""
    # A selector, not select.select: select() refuses descriptors >= 1024 (FD_SETSIZE), which a
    # long test process reaches, and the proxy then closed every connection it was handed.
    with selectors.DefaultSelector() as selector:
        selector.register(client, selectors.EVENT_READ)
        selector.register(upstream, selectors.EVENT_READ)
        while True:
            events = selector.select(30)
            if not events:
                return
            for key, _ in events:
                sock = key.fileobj
                chunk = sock.recv(1 << 16)
                if sock is upstream:
                    if not chunk:
                        return
                    if cut:
                        count(max(1, len(chunk) // 2))
                        client.sendall(chunk[: max(1, len(chunk) // 2)])
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        return
                    count(len(chunk))
                    client.sendall(chunk)
                else:
                    if not chunk:
                        selector.unregister(client)  # the client finished sending; wait for the answer
                        continue
                    upstream.sendall(chunk)


if __name__ == "__main__":
    _serve()
