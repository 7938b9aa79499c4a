"""Azure: Scheduled Events (``Preempt``, ``Terminate``) for this VM, their acknowledgement, and its location.

``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``; the deadline is
the event's ``NotBefore``. :meth:`AzurePoller.acknowledge` POSTs ``StartRequests`` once the
emergency checkpoint has committed, so the VM is released without waiting for ``NotBefore``.
IMDS ``compute/location`` names the region (``eastus``). Endpoint: ``$SPOT_AZURE_METADATA_ENDPOINT``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from typing import Any, ClassVar

from spot_callbacks.errors import MetadataError
from spot_callbacks.preemption.metadata import REQUEST_TIMEOUT_S, MetadataClient, json_object, parse_time
from spot_callbacks.preemption.notice import Notice
from spot_callbacks.preemption.poller import CloudPoller, Poll

log = logging.getLogger("spot_callbacks")

# Used when an event carries no usable NotBefore: Azure's documented minimum for a Preempt event.
AZURE_NOTICE_S = 30.0
# Azure enables Scheduled Events on the first request, which may then take up to two minutes.
AZURE_FIRST_REQUEST_TIMEOUT_S = 120.0


class AzurePoller(CloudPoller):
    """Azure Scheduled Events: ``Preempt`` (spot eviction) and ``Terminate`` events for this VM.

    Example:
        >>> AzurePoller.concerns({"Resources": ["_scaleset_3"]}, "scaleset_3"), AzurePoller.concerns(
        ...     {"Resources": ["other-vm"]}, "this-vm")
        (True, False)
    """

    env_var = "SPOT_AZURE_METADATA_ENDPOINT"
    EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
    VM_NAME = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
    LOCATION = "/metadata/instance/compute/location?api-version=2021-02-01&format=text"
    HEADERS: ClassVar[dict[str, str]] = {"Metadata": "true"}
    GOING_AWAY = ("Preempt", "Terminate")

    def __init__(
        self, name: str, endpoint: str | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S
    ) -> None:
        super().__init__(name, endpoint, request_timeout_s)
        self._vm_name: str | None = None
        self._asked_name = False
        self._first_request = True
        self._reported: set[str] = set()
        self._to_acknowledge: list[str] = []
        self._lock = threading.Lock()

    def detect(self, timeout_s: float) -> bool:
        response = self.client.request("GET", self.VM_NAME, timeout_s, headers=self.HEADERS)
        self._asked_name = True
        if response.status == 200 and response.text:
            self._vm_name = response.text
            return True
        return False

    def region(self, timeout_s: float) -> str | None:
        response = self.client.request("GET", self.LOCATION, timeout_s, headers=self.HEADERS)
        return response.text if response.status == 200 else None

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
        events = json_object(response.body, "scheduledevents").get("Events")
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
                    self.name,
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
