"""A TCP proxy on 127.0.0.1 in front of a real server, every byte through it at a bounded rate.

For the tests that read what a wait prints while a transfer is slow: the store and its fast clients
talk HTTP to the proxy as they would to a far-away bucket, and the server behind it is the real
one (moto). The rate is shared by all connections and both directions, so parallel ranges or
parts do not multiply it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

BLOCK_BYTES = 16 * 1024
SOCKET_BUFFER_BYTES = 64 * 1024


class _Bucket:
    """A token bucket of ``bytes_per_s``, shared by every pump."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._next_free = time.monotonic()

    def take(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + nbytes / self.bytes_per_s
            pause = start - now
        if pause > 0:
            time.sleep(pause)  # the rate limit itself, not a synchronisation


class ThrottledProxy:
    """Forwards connections on :attr:`url` to ``target_port`` at ``bytes_per_s`` in all.

    Example:
        with ThrottledProxy(server.port, 2_000_000) as proxy:
            storage_options = {..., "endpoint_url": proxy.url}
    """

    def __init__(self, target_port: int, bytes_per_s: float) -> None:
        self.target_port = target_port
        self._bucket = _Bucket(bytes_per_s)
        # Small kernel buffers: a client counts bytes as sent once its socket took them, and loopback's
        # default buffers would take megabytes at once, far ahead of the rate.
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="throttle-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                block = source.recv(BLOCK_BYTES)
                if not block:
                    break
                self._bucket.take(len(block))
                sink.sendall(block)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def __enter__(self) -> ThrottledProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def throttled(target_port: int, bytes_per_s: float) -> Iterator[ThrottledProxy]:
    proxy = ThrottledProxy(target_port, bytes_per_s)
    try:
        yield proxy
    finally:
        proxy.close()
