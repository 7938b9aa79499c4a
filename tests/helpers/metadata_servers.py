"""Loopback stand-ins for the clouds' instance metadata services, as their documentation describes them.

- :class:`AwsImds`: IMDSv2 — ``PUT /latest/api/token`` (needs the TTL header), every ``GET`` needs
  the token (401 without it), ``spot/instance-action`` and ``events/recommendations/rebalance``
  are 404 until a test sets them; ``placement/region`` answers ``region``. ``POST /_test/announce``
  sets an interruption 2 minutes ahead (for a training subprocess that cannot reach the test's objects).
- :class:`GcpMetadata`: ``Metadata-Flavor: Google`` required (403 without), ``instance/preempted``
  with ETags and ``?wait_for_change=true&last_etag=...&timeout_sec=N`` long polling; ``instance/zone``
  answers ``zone``.
- :class:`AzureScheduledEvents`: ``Metadata: true`` required (400 without), the VM name and
  ``location``, the ``scheduledevents`` document, and ``StartRequests`` POSTs recorded in ``acknowledged``.

Each server's ``fault`` makes it misbehave: ``"500"``, ``"garbage"`` (a 200 with a body the cloud
never sends), ``"hang"`` (no answer until :meth:`MetadataServer.reset`), ``"no-token"`` (AWS: the
token PUT fails). Every request is recorded; :meth:`MetadataServer.wait_for_requests` waits (on a
condition, with a timeout) until enough have arrived.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

HANG_LIMIT_S = 30.0  # a hung request is released by reset() or, at the latest, after this


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    at: float


Reply = tuple[int, dict[str, str], bytes]


class _Handler(BaseHTTPRequestHandler):
    server: Any

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        parts = urlsplit(self.path)
        request = Request(
            self.command, parts.path, parse_qs(parts.query), {k.lower(): v for k, v in self.headers.items()},
            body, time.time(),
        )  # fmt: skip
        status, headers, payload = self.server.app.handle(request)
        try:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:  # the client gave up (a timeout): nothing to answer
            pass

    do_GET = do_PUT = do_POST = do_HEAD = _serve  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class MetadataServer:
    """A threaded HTTP server on 127.0.0.1 whose answers a test scripts; see the module docstring."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.requests: list[Request] = []
        self.fault: str | None = None
        self._release = threading.Event()
        self.reset()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False
        self._httpd.app = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-metadata", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        """Forget requests and state, release hung requests."""
        with self._cond:
            self._release.set()
            self._release = threading.Event()
            self.requests = []
            self.fault = None
            self._reset_state()
            self._cond.notify_all()

    def _reset_state(self) -> None:
        pass

    def close(self) -> None:
        self._release.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def wait_for_requests(self, count: int, path: str = "", timeout: float = 10.0) -> bool:
        """Wait until ``count`` requests whose path contains ``path`` have arrived."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.matching(path)) >= count, timeout)

    def matching(self, path: str) -> list[Request]:
        return [r for r in self.requests if path in r.path]

    def handle(self, request: Request) -> Reply:
        with self._cond:
            self.requests.append(request)
            self._cond.notify_all()
            release = self._release
        if request.path.startswith("/_test/"):
            return self.control(request)
        if self.fault == "hang":
            release.wait(HANG_LIMIT_S)
            return 200, {}, b"too late"
        if self.fault == "500":
            return 500, {}, b"Internal Server Error"
        with self._cond:
            return self.respond(request)

    def control(self, request: Request) -> Reply:
        return 404, {}, b""

    def respond(self, request: Request) -> Reply:
        raise NotImplementedError


def _json(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
    return status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(doc).encode()


def iso_utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class AwsImds(MetadataServer):
    TOKEN_PREFIX = "AQAEAtest-token-"

    def _reset_state(self) -> None:
        self.instance_action: dict[str, str] | None = None
        self.rebalance: dict[str, str] | None = None
        self.tokens_issued = 0
        self.region = "us-east-1"  # placement/region

    def announce(self, seconds_ahead: float = 120.0, action: str = "terminate") -> float:
        """Post a spot interruption; returns its time (whole seconds, as AWS gives it)."""
        at = float(int(time.time() + seconds_ahead))
        with self._cond:
            self.instance_action = {"action": action, "time": iso_utc(at)}
        return at

    def control(self, request: Request) -> Reply:
        if request.path == "/_test/announce":
            return 200, {}, str(self.announce()).encode()
        return 404, {}, b""

    def respond(self, request: Request) -> Reply:
        if request.method == "PUT" and request.path == "/latest/api/token":
            if "x-aws-ec2-metadata-token-ttl-seconds" not in request.headers:
                return 400, {}, b"Missing TTL header"
            if self.fault == "no-token":
                return 403, {}, b"Forbidden"
            self.tokens_issued += 1
            return 200, {}, f"{self.TOKEN_PREFIX}{self.tokens_issued}".encode()
        token = request.headers.get("x-aws-ec2-metadata-token", "")
        if not token.startswith(self.TOKEN_PREFIX):
            return 401, {}, b"Unauthorized"
        if request.path == "/latest/meta-data/spot/instance-action":
            if self.fault == "garbage":
                return 200, {"Content-Type": "text/html"}, b"<html><body>captive portal</body></html>"
            return _json(self.instance_action) if self.instance_action else (404, {}, b"Not Found")
        if request.path == "/latest/meta-data/events/recommendations/rebalance":
            return _json(self.rebalance) if self.rebalance else (404, {}, b"Not Found")
        if request.path == "/latest/meta-data/placement/region":
            return 200, {"Content-Type": "text/plain"}, self.region.encode()
        return 404, {}, b"Not Found"


class GcpMetadata(MetadataServer):
    PREEMPTED = "/computeMetadata/v1/instance/preempted"

    def _reset_state(self) -> None:
        self.preempted = False
        self.version = 0
        self.zone = "projects/123456789/zones/us-central1-a"  # instance/zone

    @property
    def etag(self) -> str:
        return f"etag-{self.version}"

    def set_preempted(self, value: bool = True) -> None:
        with self._cond:
            self.preempted = value
            self.version += 1
            self._cond.notify_all()

    def respond(self, request: Request) -> Reply:
        if request.headers.get("metadata-flavor") != "Google":
            return 403, {}, b"Missing Metadata-Flavor:Google header."
        google = {"Metadata-Flavor": "Google"}
        if request.path == "/computeMetadata/v1/":
            return 200, google, b"instance/\nproject/\n"
        if request.path == "/computeMetadata/v1/instance/zone":
            return 200, google, self.zone.encode()
        if request.path != self.PREEMPTED:
            return 404, google, b"Not Found"
        if request.query.get("wait_for_change") == ["true"]:
            last_etag = request.query.get("last_etag", [self.etag])[0]
            timeout_s = float(request.query.get("timeout_sec", ["60"])[0])
            self._cond.wait_for(lambda: self.etag != last_etag, timeout_s)
        if self.fault == "garbage":
            return 200, google, b'{"preempted": maybe}'
        return 200, {**google, "ETag": self.etag}, b"TRUE" if self.preempted else b"FALSE"


class AzureScheduledEvents(MetadataServer):
    EVENTS = "/metadata/scheduledevents"
    VM_NAME = "vm-spot-test"

    def _reset_state(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.incarnation = 1
        self.acknowledged: list[dict[str, Any]] = []
        self.on_acknowledge: Callable[[], Any] | None = None
        self.seen_at_acknowledge: list[Any] = []
        self.location = "eastus"  # compute/location

    def add_event(
        self, event_type: str = "Preempt", not_before_s: float = 60.0, resources: list[str] | None = None
    ) -> tuple[str, float]:
        """Schedule an event; returns its EventId and NotBefore (whole seconds)."""
        not_before = float(int(time.time() + not_before_s))
        event_id = str(uuid.uuid4()).upper()
        with self._cond:
            self.events.append(
                {
                    "EventId": event_id, "EventType": event_type, "ResourceType": "VirtualMachine",
                    "Resources": resources if resources is not None else [self.VM_NAME], "EventStatus": "Scheduled",
                    "NotBefore": format_datetime(datetime.fromtimestamp(not_before, tz=timezone.utc), usegmt=True),
                    "Description": "", "EventSource": "Platform", "DurationInSeconds": -1,
                }
            )  # fmt: skip
            self.incarnation += 1
        return event_id, not_before

    def respond(self, request: Request) -> Reply:
        if request.headers.get("metadata") != "true":
            return 400, {}, b'{"error": "Bad request. Required metadata header not specified"}'
        if request.path == "/metadata/instance/compute/name":
            return 200, {"Content-Type": "text/plain"}, self.VM_NAME.encode()
        if request.path == "/metadata/instance/compute/location" and "api-version" in request.query:
            return 200, {"Content-Type": "text/plain"}, self.location.encode()
        if request.path != self.EVENTS or request.query.get("api-version") != ["2020-07-01"]:
            return 404, {}, b""
        if request.method == "POST":
            doc = json.loads(request.body)
            self.acknowledged.append(doc)
            if self.on_acknowledge is not None:
                self.seen_at_acknowledge.append(self.on_acknowledge())
            started = {item["EventId"] for item in doc.get("StartRequests", [])}
            self.events = [e for e in self.events if e["EventId"] not in started]
            self.incarnation += 1
            return 200, {}, b""
        if self.fault == "garbage":
            return 200, {}, b"Events: none"
        return _json({"DocumentIncarnation": self.incarnation, "Events": self.events})
