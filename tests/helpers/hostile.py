"""A hostile HTTP proxy on 127.0.0.1 in front of a real S3 server (moto): it lies about chosen objects.

Every request goes to the server behind it and its answer comes back, except the GET and HEAD
requests whose path contains ``target``: those are answered as ``lie`` says. The store talks to
the proxy as to its endpoint (``endpoint_url=proxy.url``), so the lie reaches every client the
store uses, and nothing is mocked:

- ``head``: a HEAD says the object is 10**12 bytes (GETs are true).
- ``html``: a GET is answered 200 with an HTML page (a captive portal, a misrouted load balancer).
- ``extra`` / ``short``: a GET's body has 1000 bytes more / fewer, its Content-Length agreeing.
- ``range``: a ranged GET says ``Content-Range`` of other bytes than asked, the right number of them
  (a whole GET is left alone).
- ``trickle``: a GET's headers are true, then its body comes one byte per ``trickle_s``.
- ``stall``: a GET's headers are true, then nothing.
- ``no-bulk-delete``: a bulk delete (``POST ?delete``) is answered 501 NotImplemented, as by an S3
  server without DeleteObjects (single DELETEs still work).
- ``wrong-region``: every request whose path contains ``target``, and a HEAD of the bucket, is answered 301 PermanentRedirect with ``x-amz-bucket-region:
  eu-west-3``, as AWS answers a client that asked the bucket in another region.
- ``reset-part``: the first upload of part 2 of an object (``PUT ...?partNumber=2``) is read whole and
  answered by closing the connection, as a dropped connection would (the client sends the part again).
- ``none``: no lie; the proxy only records what it was asked.

``answered`` counts the lies told by method; ``seen`` holds every request's method, path and headers.
"""

from __future__ import annotations

import http.client
import re
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LIES = (
    "head",
    "html",
    "extra",
    "short",
    "range",
    "trickle",
    "stall",
    "no-bulk-delete",
    "wrong-region",
    "reset-part",
    "none",
)
WRONG_REGION = "eu-west-3"
PERMANENT_REDIRECT = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PermanentRedirect</Code><Message>The bucket you '
    b"are attempting to access must be addressed using the specified endpoint. Please send all future "
    b"requests to this endpoint.</Message><Endpoint>s3.eu-west-3.amazonaws.com</Endpoint></Error>"
)
NOT_IMPLEMENTED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NotImplemented</Code>'
    b"<Message>A header you provided implies functionality that is not implemented</Message></Error>"
)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}
HTML_PAGE = b"<html><head><title>Sign in</title></head><body>Please sign in to continue.</body></html>\n"


class HostileProxy(ThreadingHTTPServer):
    """The proxy; use :func:`hostile_proxy` to start and stop it."""

    daemon_threads = True

    def __init__(self, target_port: int, target: str, lie: str, trickle_s: float = 1.0) -> None:
        assert lie in LIES, lie
        super().__init__(("127.0.0.1", 0), _Handler)
        self.target_port, self.target, self.lie, self.trickle_s = target_port, target, lie, trickle_s
        self.answered: Counter[str] = Counter()
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.closed = threading.Event()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@contextmanager
def hostile_proxy(target_port: int, target: str, lie: str, trickle_s: float = 1.0) -> Iterator[HostileProxy]:
    """A running :class:`HostileProxy` in front of ``127.0.0.1:target_port``, stopped on exit."""
    proxy = HostileProxy(target_port, target, lie, trickle_s)
    thread = threading.Thread(target=proxy.serve_forever, name="hostile-proxy", daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.closed.set()
        proxy.shutdown()
        proxy.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HostileProxy

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Quiet: the tests read the store's log, not the proxy's."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        self._forward()

    def do_HEAD(self) -> None:  # noqa: N802
        self._forward()

    def do_PUT(self) -> None:  # noqa: N802
        self._forward()

    def do_POST(self) -> None:  # noqa: N802
        self._forward()

    def do_DELETE(self) -> None:  # noqa: N802
        self._forward()

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
        if self.server.lie == "wrong-region" and (
            self.server.target in self.path or (self.command == "HEAD" and "/" not in self.path.strip("/"))
        ):
            self.server.answered[self.command] += 1
            self.send_response(301)
            self.send_header("Content-Type", "application/xml")
            self.send_header("x-amz-bucket-region", WRONG_REGION)
            self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(PERMANENT_REDIRECT)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(PERMANENT_REDIRECT)
            return
        if (
            self.server.lie == "reset-part"
            and self.command == "PUT"
            and self.server.target in self.path
            and "partNumber=2" in self.path.split("?", 1)[-1].split("&")
            and not self.server.answered[self.command]
        ):
            self.server.answered[self.command] += 1
            self.close_connection = True
            return
        if (
            self.server.lie == "no-bulk-delete"
            and self.command == "POST"
            and "delete" in self.path.split("?", 1)[-1]
        ):
            self.server.answered[self.command] += 1
            self.send_response(501)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(NOT_IMPLEMENTED)))
            self.end_headers()
            self.wfile.write(NOT_IMPLEMENTED)
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.target_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        upstream.request(self.command, self.path, body=body or None, headers=headers)
        answer = upstream.getresponse()
        payload = answer.read()
        upstream.close()
        status = answer.status
        out = [(k, v) for k, v in answer.getheaders() if k.lower() not in _HOP_BY_HOP]
        told_length = int(answer.getheader("Content-Length") or 0) if self.command == "HEAD" else len(payload)
        targeted = self.server.target in self.path and self.command in ("GET", "HEAD") and status < 300
        lie = self.server.lie if targeted else None
        if lie is not None and (lie == "head") != (self.command == "GET"):
            self.server.answered[self.command] += 1
            if lie == "head":
                told_length = 10**12
            elif lie == "html":
                status, payload, told_length = 200, HTML_PAGE, len(HTML_PAGE)
                out = [(k, v) for k, v in out if k.lower() not in ("content-type", "content-range")]
                out.append(("Content-Type", "text/html"))
            elif lie == "extra":
                payload += b"\0" * 1000
                told_length = (
                    int(answer.getheader("Content-Length") or 0) if self.command == "HEAD" else len(payload)
                )
            elif lie == "short":
                payload = payload[: max(0, len(payload) - 1000)]
                told_length = (
                    int(answer.getheader("Content-Length") or 0) if self.command == "HEAD" else len(payload)
                )
            elif lie == "range":
                out = [(k, _shifted(v) if k.lower() == "content-range" else v) for k, v in out]
        elif lie is not None:
            lie = None
        self.send_response(status)
        for key, value in out:
            self.send_header(key, value)
        self.send_header("Content-Length", str(told_length))
        self.end_headers()
        if self.command == "HEAD":
            return
        if lie == "stall":
            self.server.closed.wait()
            self.close_connection = True
            return
        if lie == "trickle":
            for index in range(len(payload)):
                if self.server.closed.wait(self.server.trickle_s):
                    break
                try:
                    self.wfile.write(payload[index : index + 1])
                    self.wfile.flush()
                except OSError:
                    break
            self.close_connection = True
            return
        self.wfile.write(payload)


def _shifted(content_range: str) -> str:
    """``bytes a-b/total`` as ``bytes a+1-b+1/total``: as many bytes, the wrong ones."""
    found = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range)
    if not found:
        return content_range
    start, end, total = int(found.group(1)), int(found.group(2)), found.group(3)
    return f"bytes {start + 1}-{end + 1}/{total}"
