"""AWS: EC2 spot interruption notices, rebalance recommendations and the instance's region, through IMDSv2.

Every request carries an IMDSv2 token (``PUT /latest/api/token``), requested once and renewed
before it expires. ``GET /latest/meta-data/spot/instance-action`` -> ``{"action", "time"}`` (404:
no notice; about 2 minutes of warning). ``/latest/meta-data/events/recommendations/rebalance`` is
an early *hint*: a normal checkpoint now, not a stop. ``placement/region`` names the region.
Endpoint: ``$AWS_EC2_METADATA_SERVICE_ENDPOINT``.
"""

from __future__ import annotations

import time

from spot_callbacks.errors import MetadataError
from spot_callbacks.preemption.metadata import REQUEST_TIMEOUT_S, json_object, parse_time
from spot_callbacks.preemption.notice import Notice
from spot_callbacks.preemption.poller import CloudPoller, Poll

# The warning AWS documents; used when a notice carries no usable time of its own.
AWS_NOTICE_S = 120.0


class AwsPoller(CloudPoller):
    """EC2 spot interruption notices and rebalance recommendations through IMDSv2.

    Example:
        >>> poller = AwsPoller("aws", "http://127.0.0.1:9")
        >>> notice = poller.parse_instance_action(b'{"action": "terminate", "time": "2030-01-01T00:00:00Z"}')
        >>> notice.source, notice.deadline
        ('aws', 1893456000.0)
    """

    env_var = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
    TOKEN_TTL_S = 21600

    def __init__(
        self, name: str, endpoint: str | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S
    ) -> None:
        super().__init__(name, endpoint, request_timeout_s)
        self._token: str | None = None
        self._token_renew_at = 0.0
        self._seen_actions: set[str] = set()
        self._seen_rebalances: set[str] = set()

    def detect(self, timeout_s: float) -> bool:
        self._fetch_token(timeout_s)
        return True

    def region(self, timeout_s: float) -> str | None:
        body = self._get("/latest/meta-data/placement/region", timeout_s)
        return body.decode("utf-8", "replace").strip() if body is not None else None

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

    def _get(self, path: str, timeout_s: float) -> bytes | None:
        """The body at ``path``; None for a 404 (nothing posted there)."""
        token = self._fetch_token(timeout_s)
        response = self.client.request("GET", path, timeout_s, headers={"X-aws-ec2-metadata-token": token})
        if response.status == 404:
            return None
        if response.status == 401:
            self._token = None  # expired or revoked: a new one next time
            raise MetadataError(f"IMDSv2 refused the token for {path} (HTTP 401)")
        if response.status != 200:
            raise MetadataError(f"GET {path}: HTTP {response.status}")
        return response.body

    def parse_instance_action(self, body: bytes, now: float | None = None) -> Notice:
        """The notice in a ``spot/instance-action`` body; MetadataError when it is not the documented JSON."""
        doc = json_object(body, "spot/instance-action")
        action = doc.get("action")
        if not isinstance(action, str):
            raise MetadataError(f"spot/instance-action has no action: {body[:80]!r}")
        received = time.time() if now is None else now
        deadline = parse_time(str(doc.get("time", "")))
        return Notice(
            self.name,
            deadline if deadline is not None else received + AWS_NOTICE_S,
            f"spot instance-action {action} at {doc.get('time', '?')}",
            received_at=received,
        )

    def poll(self, wait_s: float) -> Poll:
        body = self._get("/latest/meta-data/spot/instance-action", self.request_timeout_s)
        if body is not None:
            notice = self.parse_instance_action(body)
            if notice.detail not in self._seen_actions:
                self._seen_actions.add(notice.detail)
                return Poll(notice=notice)
            return Poll()
        body = self._get("/latest/meta-data/events/recommendations/rebalance", self.request_timeout_s)
        if body is not None:
            notice_time = str(json_object(body, "rebalance recommendation").get("noticeTime", ""))
            if notice_time not in self._seen_rebalances:
                self._seen_rebalances.add(notice_time)
                return Poll(hint=f"AWS rebalance recommendation (noticeTime {notice_time or '?'})")
        return Poll()
