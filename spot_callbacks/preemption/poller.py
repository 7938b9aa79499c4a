"""What every cloud's metadata service is asked: does this machine run here, is it going away, in which region."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import spot_callbacks.settings as settings
from spot_callbacks.preemption.metadata import LINK_LOCAL, REQUEST_TIMEOUT_S, MetadataClient
from spot_callbacks.preemption.notice import Notice


@dataclass(frozen=True)
class Poll:
    """What one poll found: a notice (the machine is going away), a hint (checkpoint now), or neither.

    Example:
        >>> Poll(hint="AWS rebalance recommendation").notice is None
        True
    """

    notice: Notice | None = None
    hint: str | None = None


class CloudPoller(ABC):
    """One cloud's metadata service, a :class:`~spot_callbacks.preemption.sources.NoticeSource`.

    Subclasses know the endpoints and what their answers mean. ``name`` is the source's name in
    :data:`~spot_callbacks.preemption.sources.NOTICE_SOURCES` (its notices' ``source``). The
    endpoint is ``endpoint``, else the cloud's variable (``env_var``), else the link-local address.

    Example:
        >>> class Nowhere(CloudPoller):
        ...     env_var = "NOWHERE_METADATA"
        ...     detect = poll = region = lambda self, timeout_s: None
        >>> Nowhere("nowhere", "http://127.0.0.1:9").describe()
        'nowhere metadata at http://127.0.0.1:9'
    """

    env_var: ClassVar[str]
    default_endpoint: ClassVar[str] = f"http://{LINK_LOCAL}"

    def __init__(
        self, name: str, endpoint: str | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S
    ) -> None:
        self.name = name
        self.client = MetadataClient(
            endpoint or settings.environment_variable(self.env_var) or self.default_endpoint
        )
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

    @abstractmethod
    def region(self, timeout_s: float) -> str | None:
        """The region this instance runs in (as the cloud names it); None when the answer says nothing.

        Raises MetadataError when the service cannot be reached (``unreachable``) or fails.
        """

    def acknowledge(self) -> None:  # noqa: B027 - optional: only Azure has anything to acknowledge
        """Tell the cloud the emergency checkpoint is done (only Azure listens)."""

    def abort(self) -> None:
        self.client.abort()

    def describe(self) -> str:
        return f"{self.name} metadata at {self.client.base_url}"
