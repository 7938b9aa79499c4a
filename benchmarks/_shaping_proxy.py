"""A cloud-shaped link for the transfer benchmark: a TCP proxy on loopback in front of the local S3 server.

Cloud object stores differ from a loopback server in two ways that decide how a client should
pull: one connection tops out around 100 MB/s, and every answer's first byte comes tens of
milliseconds after the request. The proxy puts both on the link, and a cap for the whole link:

* every connection moves at most ``--conn-mbps`` MB/s each way (a token bucket per connection and
  direction);
* all connections together move at most ``--total-mbps`` MB/s each way (one bucket per direction);
* the first byte of each answer leaves at least ``--latency-ms`` after the last byte of the request
  that came before it on the same connection (a GET, a part's PUT, a listing each pay it once).

It runs as its own process (``python benchmarks/_shaping_proxy.py --target-port N``, which prints
``port P`` once listening) so that its CPU is its own: :class:`ShapingProxy` starts it and reads
that CPU from ``/proc``. The bytes move by ``os.splice`` (socket to pipe to socket, 1 MiB at a
time, never copied into Python) where the platform has it, else by ``recv_into`` one reused 1 MiB
buffer; the buckets are a lock and a timestamp, so the Python work is per MiB, not per byte.
Shaping follows the same idea as the tests' throttling proxy, built again here (benchmarks do not
import from tests/).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

BLOCK_BYTES = 1 << 20
# A pause shorter than this is not slept now: the bucket keeps the debt and the next block sleeps it
# (sleeping every 64 KiB read would cost more CPU than the bytes).
MIN_SLEEP_S = 0.002
F_SETPIPE_SZ = 1031  # fcntl's Linux constant (Python exposes it from 3.10 on some builds only)


class Bucket:
    """A token bucket of ``bytes_per_s`` (0: no limit): :meth:`reserve` says when ``nbytes`` may leave."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._next_free = time.monotonic()

    def reserve(self, nbytes: int, now: float) -> float:
        """Take ``nbytes``; the monotonic time before which they must not leave."""
        if not self.bytes_per_s:
            return now
        with self._lock:
            start = max(now, self._next_free)
            self._next_free = start + nbytes / self.bytes_per_s
            return start


class _Connection:
    """One client connection's state shared by its two pumps: when its last request byte went up."""

    def __init__(self, conn_bytes_per_s: float) -> None:
        self.up, self.down = Bucket(conn_bytes_per_s), Bucket(conn_bytes_per_s)
        self.request_at: float | None = None


class Shaper:
    """Accepts on ``listener`` and forwards each connection to ``target_port``, shaped."""

    def __init__(
        self,
        listener: socket.socket,
        target_port: int,
        conn_mbps: float,
        total_mbps: float,
        latency_ms: float,
    ) -> None:
        self.listener, self.target_port = listener, target_port
        self.conn_bytes_per_s = conn_mbps * 1e6
        self.total_up, self.total_down = Bucket(total_mbps * 1e6), Bucket(total_mbps * 1e6)
        self.latency_s = latency_ms / 1000
        self.splice = hasattr(os, "splice")

    def serve(self) -> None:
        while True:
            client, _ = self.listener.accept()
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle wait on headers
            state = _Connection(self.conn_bytes_per_s)
            for source, sink, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(source, sink, state, up), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, state: _Connection, up: bool) -> None:
        try:
            if self.splice:
                self._pump_splice(source, sink, state, up)
            else:
                self._pump_copy(source, sink, state, up)
        except OSError:
            with contextlib.suppress(OSError):
                source.close()
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _wait(self, nbytes: int, state: _Connection, up: bool) -> None:
        """Sleep until ``nbytes`` may leave in this direction (latency first, then both buckets)."""
        now = time.monotonic()
        latency_due = False
        if up:
            state.request_at = now  # refreshed by every request byte: the answer waits from the last one
            ready = max(state.up.reserve(nbytes, now), self.total_up.reserve(nbytes, now))
        else:
            if state.request_at is not None:
                first_byte = state.request_at + self.latency_s
                latency_due, now = first_byte > now, max(now, first_byte)
                state.request_at = None
            ready = max(state.down.reserve(nbytes, now), self.total_down.reserve(nbytes, now))
        pause = ready - time.monotonic()
        if pause > 0 and (latency_due or pause >= MIN_SLEEP_S):
            time.sleep(pause)  # the shaping itself, not a synchronisation

    def _pump_splice(self, source: socket.socket, sink: socket.socket, state: _Connection, up: bool) -> None:
        import fcntl

        read_end, write_end = os.pipe()
        try:
            with contextlib.suppress(OSError):
                fcntl.fcntl(write_end, F_SETPIPE_SZ, BLOCK_BYTES)
            src, dst = source.fileno(), sink.fileno()
            while True:
                got = os.splice(src, write_end, BLOCK_BYTES)
                if not got:
                    return
                self._wait(got, state, up)
                while got:
                    got -= os.splice(read_end, dst, got)
        finally:
            os.close(read_end)
            os.close(write_end)

    def _pump_copy(self, source: socket.socket, sink: socket.socket, state: _Connection, up: bool) -> None:
        buffer = bytearray(BLOCK_BYTES)
        view = memoryview(buffer)
        while True:
            got = source.recv_into(buffer)
            if not got:
                return
            self._wait(got, state, up)
            sink.sendall(view[:got])


# ---------------------------------------------------------------------------------- the process
class ShapingProxy:
    """The proxy as a child process in front of ``127.0.0.1:target_port``; :attr:`url` is its endpoint.

    Example:
        with ShapingProxy(server_port, conn_mbps=100, total_mbps=400, latency_ms=25) as proxy:
            before = proxy.cpu_s(); ...; print(proxy.cpu_s() - before)
    """

    def __init__(self, target_port: int, conn_mbps: float, total_mbps: float, latency_ms: float) -> None:
        argv = [sys.executable, str(Path(__file__)), "--target-port", str(target_port),
                "--conn-mbps", str(conn_mbps), "--total-mbps", str(total_mbps), "--latency-ms", str(latency_ms)]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if line[:1] != ["port"]:
            self.proc.kill()
            raise SystemExit(f"the shaping proxy did not start (said {line!r})")
        self.port = int(line[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.shape = (
            f"{conn_mbps:g} MB/s per connection, {total_mbps:g} MB/s in all, {latency_ms:g} ms first byte"
        )

    def cpu_s(self) -> float:
        """The proxy's CPU seconds so far (user + system, all its threads), from ``/proc``."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)

    def __enter__(self) -> ShapingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def shaping_proxy(
    target_port: int, conn_mbps: float, total_mbps: float, latency_ms: float
) -> Iterator[ShapingProxy]:
    with ShapingProxy(target_port, conn_mbps, total_mbps, latency_ms) as proxy:
        yield proxy


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target-port", type=int, required=True, help="the server's port on 127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="where to listen (0: a free port, printed)")
    parser.add_argument(
        "--conn-mbps", type=float, default=100.0, help="MB/s per connection and direction (0: none)"
    )
    parser.add_argument(
        "--total-mbps", type=float, default=400.0, help="MB/s per direction, all connections (0: none)"
    )
    parser.add_argument(
        "--latency-ms", type=float, default=25.0, help="added before each answer's first byte"
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", args.port))
    listener.listen(256)
    print(f"port {listener.getsockname()[1]}", flush=True)
    Shaper(listener, args.target_port, args.conn_mbps, args.total_mbps, args.latency_ms).serve()


if __name__ == "__main__":
    main()
