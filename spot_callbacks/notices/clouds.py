"""Cloud preemption notices: AWS IMDSv2, GCP metadata and Azure Scheduled Events, polled in one thread.

Each cloud announces a reclaim on its instance metadata service, a link-local HTTP endpoint:

- **AWS** (``aws``): IMDSv2 token (``PUT /latest/api/token``), then
  ``GET /latest/meta-data/spot/instance-action`` -> ``{"action", "time"}`` (404: no notice; about
  2 minutes of warning). ``/latest/meta-data/events/recommendations/rebalance`` is an early
  *hint*: a normal checkpoint now, not a stop. Endpoint: ``$AWS_EC2_METADATA_SERVICE_ENDPOINT``.
- **GCP** (``gcp``): ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``,
  long-polled with ``?wait_for_change=true`` (``TRUE`` leaves about 30 s). Host:
  ``$GCE_METADATA_HOST``.
- **Azure** (``azure``): ``GET /metadata/scheduledevents?api-version=2020-07-01`` with
  ``Metadata: true``; a ``Preempt`` (or ``Terminate``) event for this VM, deadline ``NotBefore``;
  :meth:`AzurePoller.acknowledge` POSTs ``StartRequests`` once the emergency checkpoint has
  committed, so the VM is released without waiting for ``NotBefore``. Endpoint:
  ``$SPOT_AZURE_METADATA_ENDPOINT``.

A :class:`CloudNoticeThread` runs the pollers in one daemon thread: a timeout, a 5xx, a body that
is not what the cloud documents or a missing token is "no notice", logged once per poller. With
``detect=True`` (``preemption="auto"``) it first asks each service, with short timeouts and no
logging, whether this machine runs on that cloud, and ends when none answers.
``$SPOT_METADATA_POLL_S`` sets the poll interval (default 5 s).
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import json
import logging
import os
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from email.message import Message
from typing import Any, ClassVar
from urllib.parse import urlencode, urlsplit

from spot_callbacks.errors import MetadataError
from spot_callbacks.notices import Notice

log = logging.getLogger("spot_callbacks")

DEFAULT_POLL_INTERVAL_S = 5.0
REQUEST_TIMEOUT_S = 2.0
DETECT_TIMEOUT_S = 0.3
# The warning each cloud documents; used when a notice carries no usable time of its own.
AWS_NOTICE_S = 120.0
GCP_NOTICE_S = 30.0
AZURE_NOTICE_S = 30.0
# Azure enables Scheduled Events on the first request, which may then take up to two minutes.
AZURE_FIRST_REQUEST_TIMEOUT_S = 120.0
MAX_BODY_BYTES = 1 << 16
# All three clouds answer on this link-local address; an IP, so that no DNS lookup delays detection.
LINK_LOCAL = "169.254.169.254"


def default_poll_interval_s() -> float:
    """Seconds between polls: ``$SPOT_METADATA_POLL_S``, else 5."""
    raw = os.environ.get("SPOT_METADATA_POLL_S")
    try:
        value = float(raw) if raw else DEFAULT_POLL_INTERVAL_S
    except ValueError:
        value = -1.0
    if value <= 0:
        log.warning(
            "spot_callbacks: SPOT_METADATA_POLL_S=%r is not a positive number; polling every %.0fs",
            raw, DEFAULT_POLL_INTERVAL_S,
        )  # fmt: skip
        return DEFAULT_POLL_INTERVAL_S
    return value


@dataclass(frozen=True)
class Response:
    status: int
    headers: Message
    body: bytes


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

    Uses ``http.client`` directly: ``urllib`` would route the request through ``$HTTP_PROXY``,
    and a metadata service is only reachable from the machine itself.

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


@dataclass(frozen=True)
class Poll:
    """What one poll found: a notice (the machine is going away), a hint (checkpoint now), or neither."""

    notice: Notice | None = None
    hint: str | None = None


class CloudPoller(ABC):
    """One cloud's metadata service. Subclasses know the endpoints and what their answers mean."""

    name: ClassVar[str]
    env_var: ClassVar[str]
    default_endpoint: ClassVar[str] = f"http://{LINK_LOCAL}"

    def __init__(self, endpoint: str | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.client = MetadataClient(endpoint or os.environ.get(self.env_var) or self.default_endpoint)
        self.request_timeout_s = request_timeout_s

    @property
    def address(self) -> tuple[str, int]:
        return self.client.address

    @abstractmethod
    def detect(self, timeout_s: float) -> bool:
        """Whether this machine runs on this cloud (one cheap request).

        Raises MetadataError when the service cannot be reached (``unreachable``) or fails.
        """

    @abstractmethod
    def poll(self, wait_s: float) -> Poll:
        """Ask once. ``wait_s``: how long a long poll may hold the request. Raises MetadataError."""

    def acknowledge(self) -> None:  # noqa: B027 - optional: only Azure has anything to acknowledge
        """Tell the cloud the emergency checkpoint is done (only Azure listens)."""

    def abort(self) -> None:
        self.client.abort()

    def describe(self) -> str:
        return f"{self.name} metadata at {self.client.base_url}"


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


def _json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        raise MetadataError(f"{what} is not JSON: {body[:80]!r}") from None
    if not isinstance(doc, dict):
        raise MetadataError(f"{what} is not a JSON object: {body[:80]!r}")
    return doc


class AwsPoller(CloudPoller):
    """EC2 spot interruption notices and rebalance recommendations through IMDSv2.

    Example:
        >>> notice = AwsPoller.parse_instance_action(b'{"action": "terminate", "time": "2030-01-01T00:00:00Z"}')
        >>> notice.source, notice.deadline
        ('aws', 1893456000.0)
    """

    name = "aws"
    env_var = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
    TOKEN_TTL_S = 21600

    def __init__(self, endpoint: str | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        super().__init__(endpoint, request_timeout_s)
        self._token: str | None = None
        self._token_renew_at = 0.0
        self._seen_actions: set[str] = set()
        self._seen_rebalances: set[str] = set()

    def detect(self, timeout_s: float) -> bool:
        self._fetch_token(timeout_s)
        return True

    def _fetch_token(self, timeout_s: float) -> str:
        if self._token is not None and time.monotonic() < self._token_renew_at:
            return self._token
        response = self.client.request(
            "PUT", "/latest/api/token", timeout_s,
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL_S)},
        )  # fmt: skip
        token = response.body.decode("ascii", "replace").strip()
        if response.status != 200 or not token:
            raise MetadataError(f"no IMDSv2 token from {self.client.base_url} (HTTP {response.status})")
        self._token = token
        self._token_renew_at = time.monotonic() + self.TOKEN_TTL_S * 0.8
        return token

    def _get(self, path: str) -> bytes | None:
        token = self._fetch_token(self.request_timeout_s)
        response = self.client.request(
            "GET", path, self.request_timeout_s, headers={"X-aws-ec2-metadata-token": token}
        )
        if response.status == 404:
            return None
        if response.status == 401:
            self._token = None  # expired or revoked: a new one next time
            raise MetadataError(f"IMDSv2 refused the token for {path} (HTTP 401)")
        if response.status != 200:
            raise MetadataError(f"GET {path}: HTTP {response.status}")
        return response.body

    @staticmethod
    def parse_instance_action(body: bytes, now: float | None = None) -> Notice:
        """The notice in a ``spot/instance-action`` body; MetadataError when it is not the documented JSON."""
        doc = _json_object(body, "spot/instance-action")
        action = doc.get("action")
        if not isinstance(action, str):
            raise MetadataError(f"spot/instance-action has no action: {body[:80]!r}")
        received = time.time() if now is None else now
        deadline = parse_time(str(doc.get("time", "")))
        return Notice(
            "aws",
            deadline if deadline is not None else received + AWS_NOTICE_S,
            f"spot instance-action {action} at {doc.get('time', '?')}",
            received_at=received,
        )

    def poll(self, wait_s: float) -> Poll:
        body = self._get("/latest/meta-data/spot/instance-action")
        if body is not None:
            notice = self.parse_instance_action(body)
            if notice.detail not in self._seen_actions:
                self._seen_actions.add(notice.detail)
                return Poll(notice=notice)
            return Poll()
        body = self._get("/latest/meta-data/events/recommendations/rebalance")
        if body is not None:
            notice_time = str(_json_object(body, "rebalance recommendation").get("noticeTime", ""))
            if notice_time not in self._seen_rebalances:
                self._seen_rebalances.add(notice_time)
                return Poll(hint=f"AWS rebalance recommendation (noticeTime {notice_time or '?'})")
        return Poll()


class GcpPoller(CloudPoller):
    """GCE spot/preemptible VMs: ``instance/preempted`` turns ``TRUE`` about 30 s before the stop."""

    name = "gcp"
    env_var = "GCE_METADATA_HOST"
    PATH = "/computeMetadata/v1/instance/preempted"
    HEADERS: ClassVar[dict[str, str]] = {"Metadata-Flavor": "Google"}

    def __init__(self, endpoint: str | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        super().__init__(endpoint, request_timeout_s)
        self._etag: str | None = None
        self._reported = False

    def detect(self, timeout_s: float) -> bool:
        response = self.client.request("GET", "/computeMetadata/v1/", timeout_s, headers=self.HEADERS)
        # AWS and Azure answer on the same address; only Google's server names itself.
        return response.status == 200 and response.headers.get("Metadata-Flavor") == "Google"

    def poll(self, wait_s: float) -> Poll:
        if self._etag is None:  # a first plain read: the VM may be preempted already
            found = self._read(self.PATH, self.request_timeout_s)
            if found.notice is not None or self._etag is None:
                return found
        # Waits until the value differs from the one last seen, so a change between two polls is
        # not missed and the notice arrives as soon as it is posted.
        wait = max(1, round(wait_s))
        query = urlencode({"wait_for_change": "true", "last_etag": self._etag, "timeout_sec": wait})
        return self._read(f"{self.PATH}?{query}", self.request_timeout_s + wait)

    def _read(self, path: str, timeout_s: float) -> Poll:
        response = self.client.request("GET", path, timeout_s, headers=self.HEADERS)
        if response.status != 200:
            raise MetadataError(f"GET {self.PATH}: HTTP {response.status}")
        value = response.body.decode("ascii", "replace").strip().upper()
        if value not in ("TRUE", "FALSE"):
            raise MetadataError(f"{self.PATH} is neither TRUE nor FALSE: {response.body[:80]!r}")
        self._etag = response.headers.get("ETag") or None
        if value == "FALSE":
            self._reported = False
            return Poll()
        if self._reported:
            return Poll()
        self._reported = True
        now = time.time()
        return Poll(notice=Notice("gcp", now + GCP_NOTICE_S, "instance/preempted is TRUE", received_at=now))


class AzurePoller(CloudPoller):
    """Azure Scheduled Events: ``Preempt`` (spot eviction) and ``Terminate`` events for this VM.

    Example:
        >>> AzurePoller.concerns({"Resources": ["_scaleset_3"]}, "scaleset_3"), AzurePoller.concerns(
        ...     {"Resources": ["other-vm"]}, "this-vm")
        (True, False)
    """

    name = "azure"
    env_var = "SPOT_AZURE_METADATA_ENDPOINT"
    EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
    VM_NAME = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
    HEADERS: ClassVar[dict[str, str]] = {"Metadata": "true"}
    GOING_AWAY = ("Preempt", "Terminate")

    def __init__(self, endpoint: str | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        super().__init__(endpoint, request_timeout_s)
        self._vm_name: str | None = None
        self._asked_name = False
        self._first_request = True
        self._reported: set[str] = set()
        self._to_acknowledge: list[str] = []
        self._lock = threading.Lock()

    def detect(self, timeout_s: float) -> bool:
        response = self.client.request("GET", self.VM_NAME, timeout_s, headers=self.HEADERS)
        self._asked_name = True
        if response.status == 200 and response.body.strip():
            self._vm_name = response.body.decode("utf-8", "replace").strip()
            return True
        return False

    @staticmethod
    def concerns(event: dict[str, Any], vm_name: str | None) -> bool:
        """Whether an event concerns this VM. Events list every VM of an availability or scale set;
        scale-set instances appear as ``_<name>``. Unknown name or resources: assume it does."""
        resources = event.get("Resources")
        if vm_name is None or not isinstance(resources, list) or not resources:
            return True
        return any(str(r) == vm_name or str(r).lstrip("_") == vm_name.lstrip("_") for r in resources)

    def poll(self, wait_s: float) -> Poll:
        if not self._asked_name:
            self._asked_name = True
            with contextlib.suppress(MetadataError):
                self.detect(self.request_timeout_s)
        timeout_s = AZURE_FIRST_REQUEST_TIMEOUT_S if self._first_request else self.request_timeout_s
        response = self.client.request("GET", self.EVENTS, timeout_s, headers=self.HEADERS)
        self._first_request = False
        if response.status != 200:
            raise MetadataError(f"GET {self.EVENTS}: HTTP {response.status}")
        events = _json_object(response.body, "scheduledevents").get("Events")
        if not isinstance(events, list):
            raise MetadataError(f"scheduledevents has no Events list: {response.body[:80]!r}")
        for event in events:
            if not isinstance(event, dict) or event.get("EventType") not in self.GOING_AWAY:
                continue
            event_id = str(event.get("EventId", ""))
            if not event_id or event_id in self._reported or not self.concerns(event, self._vm_name):
                continue
            self._reported.add(event_id)
            with self._lock:
                self._to_acknowledge.append(event_id)
            now = time.time()
            deadline = parse_time(str(event.get("NotBefore") or ""))
            return Poll(
                notice=Notice(
                    "azure",
                    deadline if deadline is not None else now + AZURE_NOTICE_S,
                    f"{event['EventType']} event {event_id} (NotBefore {event.get('NotBefore') or '?'})",
                    received_at=now,
                )
            )
        return Poll()

    def acknowledge(self) -> None:
        """POST ``StartRequests`` for the events reported so far: Azure may proceed right away."""
        with self._lock:
            event_ids, self._to_acknowledge = self._to_acknowledge, []
        if not event_ids:
            return
        body = json.dumps({"StartRequests": [{"EventId": event_id} for event_id in event_ids]}).encode()
        # A fresh client: the polling one may be aborted already, and this runs on the training thread.
        client = MetadataClient(self.client.base_url)
        try:
            response = client.request(
                "POST", self.EVENTS, self.request_timeout_s, body=body,
                headers={**self.HEADERS, "Content-Type": "application/json"},
            )  # fmt: skip
        except MetadataError as err:
            log.warning("spot_callbacks: could not acknowledge Azure event %s: %s", ", ".join(event_ids), err)
            return
        if response.status >= 300:
            log.warning(
                "spot_callbacks: Azure refused the acknowledgement of %s (HTTP %d)",
                ", ".join(event_ids), response.status,
            )  # fmt: skip
        else:
            log.info(
                "spot_callbacks: acknowledged Azure event %s; the VM may now be released",
                ", ".join(event_ids),
            )


POLLERS: dict[str, type[CloudPoller]] = {"aws": AwsPoller, "gcp": GcpPoller, "azure": AzurePoller}


class CloudNoticeThread:
    """Runs cloud pollers in one daemon thread and hands what they find to callbacks.

    Args:
        pollers: the clouds to watch.
        on_notice: called (in the thread) with each new :class:`Notice`.
        on_hint: called (in the thread) with the description of each early hint.
        detect: first keep only the clouds this machine runs on (short timeouts, no log lines);
            end at once when there is none.
        poll_interval_s: seconds between polls (default ``$SPOT_METADATA_POLL_S``, else 5).
    """

    def __init__(
        self,
        pollers: Sequence[CloudPoller],
        on_notice: Callable[[Notice], None],
        on_hint: Callable[[str], None],
        detect: bool = False,
        poll_interval_s: float | None = None,
        detect_timeout_s: float = DETECT_TIMEOUT_S,
    ) -> None:
        self.pollers = list(pollers)
        self.on_notice = on_notice
        self.on_hint = on_hint
        self.detect = detect
        self.poll_interval_s = poll_interval_s if poll_interval_s is not None else default_poll_interval_s()
        self.detect_timeout_s = detect_timeout_s
        self.watched: list[CloudPoller] = []
        self.detected = threading.Event()  # set once the clouds to watch are known
        self._stop = threading.Event()
        self._failing: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="spot-notices", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop polling (a long poll in flight is aborted); True when the thread has ended."""
        self._stop.set()
        for poller in self.pollers:
            poller.abort()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self.watched = self._detect() if self.detect else list(self.pollers)
        finally:
            self.detected.set()
        if not self.watched:
            log.debug("spot_callbacks: no cloud metadata service answered; watching signals only")
            return
        log.info(
            "spot_callbacks: watching preemption notices from %s, every %gs",
            ", ".join(p.describe() for p in self.watched), self.poll_interval_s,
        )  # fmt: skip
        while not self._stop.is_set():
            started = time.monotonic()
            for poller in self.watched:
                if self._stop.is_set():
                    return
                self._poll_one(poller)
            # A long poll (GCP) already spent the interval waiting for a change.
            self._stop.wait(max(0.0, self.poll_interval_s - (time.monotonic() - started)))

    def _detect(self) -> list[CloudPoller]:
        found, unreachable = [], set()
        for poller in self.pollers:
            if self._stop.is_set():
                break
            # The three clouds share one address: when nothing listens there, ask only once.
            if poller.address in unreachable:
                continue
            try:
                if poller.detect(self.detect_timeout_s):
                    found.append(poller)
            except MetadataError as err:
                if err.unreachable:
                    unreachable.add(poller.address)
            except Exception as err:  # noqa: BLE001 - detection must never end the thread noisily
                log.debug("spot_callbacks: %s: detection failed: %s", poller.describe(), err)
        return found

    def _poll_one(self, poller: CloudPoller) -> None:
        try:
            result = poller.poll(self.poll_interval_s)
        except Exception as err:  # noqa: BLE001 - a poller must never end the thread or reach training
            if self._stop.is_set():
                return
            if poller.name not in self._failing:
                self._failing.add(poller.name)
                log.warning(
                    "spot_callbacks: %s gave no usable answer (%s); treating it as no notice and "
                    "polling on (further problems with it are not logged)", poller.describe(), err,
                )  # fmt: skip
            return
        if result.notice is not None:
            self.on_notice(result.notice)
        if result.hint is not None:
            self.on_hint(result.hint)
