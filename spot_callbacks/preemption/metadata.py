"""The one HTTP client for the clouds' instance metadata services, and how their answers are read.

All three clouds answer on a link-local address. Requests go through ``http.client`` directly:
``urllib`` would route them through ``$HTTP_PROXY``, and a metadata service is only reachable from
the machine itself. Any failure to get a complete answer is a :class:`~spot_callbacks.errors.MetadataError`.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import json
import socket
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from email.message import Message
from typing import Any
from urllib.parse import urlsplit

from spot_callbacks.errors import MetadataError

REQUEST_TIMEOUT_S = 2.0
# "Does this machine run on that cloud?": a metadata service answers within milliseconds, or not at all.
DETECT_TIMEOUT_S = 0.3
MAX_BODY_BYTES = 1 << 16
# All three clouds answer on this link-local address; an IP, so that no DNS lookup delays detection.
LINK_LOCAL = "169.254.169.254"


@dataclass(frozen=True)
class Response:
    """One answer of a metadata service.

    Example:
        >>> Response(200, Message(), b" eu-west-1\\n").text
        'eu-west-1'
    """

    status: int
    headers: Message
    body: bytes

    @property
    def text(self) -> str:
        """The body as text, without surrounding whitespace."""
        return self.body.decode("utf-8", "replace").strip()


class _Connection(http.client.HTTPConnection):
    """A connection with a short connect timeout and a separate (possibly long-poll) read timeout."""

    def __init__(self, host: str, port: int, connect_timeout_s: float, read_timeout_s: float) -> None:
        super().__init__(host, port, timeout=connect_timeout_s)
        self.read_timeout_s = read_timeout_s

    def connect(self) -> None:
        super().connect()
        self.sock.settimeout(self.read_timeout_s)


class MetadataClient:
    """Plain HTTP to one metadata service; :meth:`abort` ends a request in flight (a long poll) at once.

    Example:
        >>> MetadataClient("http://169.254.169.254/").address
        ('169.254.169.254', 80)
    """

    def __init__(self, base_url: str) -> None:
        if "://" not in base_url:
            base_url = f"http://{base_url}"
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"metadata endpoint {base_url!r} is not an http:// URL")
        self.base_url = base_url.rstrip("/")
        self.prefix = parts.path.rstrip("/")
        self.address = (parts.hostname, parts.port or 80)
        self._lock = threading.Lock()
        self._open: set[_Connection] = set()
        self._aborted = False

    def request(
        self,
        method: str,
        path: str,
        timeout_s: float,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
    ) -> Response:
        """One request; any failure to get a complete response raises :class:`MetadataError`."""
        conn = _Connection(*self.address, min(timeout_s, REQUEST_TIMEOUT_S), timeout_s)
        with self._lock:
            if self._aborted:
                raise MetadataError("stopped")
            self._open.add(conn)
        try:
            try:
                conn.connect()
            except OSError as err:
                raise MetadataError(f"cannot connect to {self.base_url}: {err}", unreachable=True) from err
            conn.request(method, self.prefix + path, body=body, headers=headers or {})
            response = conn.getresponse()
            data = response.read(MAX_BODY_BYTES)
            return Response(response.status, response.headers, data)
        except (OSError, http.client.HTTPException) as err:
            raise MetadataError(f"{method} {self.base_url}{path}: {type(err).__name__}: {err}") from err
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def abort(self) -> None:
        """Fail the request in flight and every later one (the poller is stopping)."""
        with self._lock:
            self._aborted = True
            for conn in self._open:
                if conn.sock is not None:
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)


def parse_time(text: str) -> float | None:
    """Epoch seconds of an ISO 8601 (AWS) or RFC 1123 (Azure) time; None when it is neither.

    Example:
        >>> parse_time("2030-01-01T00:00:00Z"), parse_time("Tue, 01 Jan 2030 00:00:00 GMT")
        (1893456000.0, 1893456000.0)
    """
    text = text.strip()
    if not text:
        return None
    try:
        parsed = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    except ValueError:
        try:
            parsed = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


def json_object(body: bytes, what: str) -> dict[str, Any]:
    """The JSON object in ``body``; :class:`MetadataError` naming ``what`` when it is none.

    Example:
        >>> json_object(b'{"action": "stop"}', "spot/instance-action")
        {'action': 'stop'}
    """
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        raise MetadataError(f"{what} is not JSON: {body[:80]!r}") from None
    if not isinstance(doc, dict):
        raise MetadataError(f"{what} is not a JSON object: {body[:80]!r}")
    return doc
