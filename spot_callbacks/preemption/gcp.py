"""GCP: spot/preemptible VM notices and the instance's region, from the GCE metadata server.

``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``, long-polled with
``?wait_for_change=true`` (``TRUE`` leaves about 30 s); ``instance/zone`` names the zone, whose
region is the zone without its last part. Host: ``$GCE_METADATA_HOST``.
"""

from __future__ import annotations

import time
from typing import ClassVar
from urllib.parse import urlencode

from spot_callbacks.errors import MetadataError
from spot_callbacks.preemption.metadata import REQUEST_TIMEOUT_S
from spot_callbacks.preemption.notice import Notice
from spot_callbacks.preemption.poller import CloudPoller, Poll

# The warning GCP documents between "preempted" and the stop.
GCP_NOTICE_S = 30.0


def zone_to_region(zone: str) -> str:
    """``us-central1-a`` -> ``us-central1``.

    Example:
        >>> zone_to_region("europe-west4-b")
        'europe-west4'
    """
    return zone.rsplit("-", 1)[0] if zone.count("-") >= 2 else zone


class GcpPoller(CloudPoller):
    """GCE spot/preemptible VMs: ``instance/preempted`` turns ``TRUE`` about 30 s before the stop.

    Example:
        >>> GcpPoller("gcp", "127.0.0.1:9").describe()
        'gcp metadata at http://127.0.0.1:9'
    """

    env_var = "GCE_METADATA_HOST"
    PATH = "/computeMetadata/v1/instance/preempted"
    HEADERS: ClassVar[dict[str, str]] = {"Metadata-Flavor": "Google"}

    def __init__(
        self, name: str, endpoint: str | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S
    ) -> None:
        super().__init__(name, endpoint, request_timeout_s)
        self._etag: str | None = None
        self._reported = False

    def detect(self, timeout_s: float) -> bool:
        response = self.client.request("GET", "/computeMetadata/v1/", timeout_s, headers=self.HEADERS)
        # AWS and Azure answer on the same address; only Google's server names itself.
        return response.status == 200 and response.headers.get("Metadata-Flavor") == "Google"

    def region(self, timeout_s: float) -> str | None:
        """``instance/zone`` is ``projects/N/zones/us-central1-a``: the region is ``us-central1``."""
        response = self.client.request(
            "GET", "/computeMetadata/v1/instance/zone", timeout_s, headers=self.HEADERS
        )
        if response.status != 200 or response.headers.get("Metadata-Flavor") != "Google":
            return None
        return zone_to_region(response.text.rsplit("/", 1)[-1])

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
        return Poll(
            notice=Notice(self.name, now + GCP_NOTICE_S, "instance/preempted is TRUE", received_at=now)
        )
