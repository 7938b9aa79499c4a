"""The clouds: each notice source's metadata service, and how they are asked in turn.

One table, :data:`CLOUDS`, names the class that knows each cloud (its poller and its region
lookup); the preemption watcher polls from it and the in-region check asks it for the region.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from spot_callbacks.errors import MetadataError
from spot_callbacks.preemption.aws import AwsPoller
from spot_callbacks.preemption.azure import AzurePoller
from spot_callbacks.preemption.gcp import GcpPoller
from spot_callbacks.preemption.poller import CloudPoller

Answer = TypeVar("Answer")

CLOUDS: dict[str, type[CloudPoller]] = {"aws": AwsPoller, "gcp": GcpPoller, "azure": AzurePoller}
CLOUD_SOURCES = tuple(CLOUDS)


def ask_each(
    services: Iterable[CloudPoller], question: Callable[[CloudPoller], Answer]
) -> Iterator[tuple[CloudPoller, Answer]]:
    """``(service, answer)`` for each service that answered ``question``; one that failed is skipped.

    The three clouds share one link-local address: when nothing listens there, it is asked only once.
    ``services`` is consumed lazily, so a service is made only once the ones before it were asked.

    Example:
        >>> asked, closed = [], [cls("http://127.0.0.1:9") for cls in CLOUDS.values()]  # nothing listens
        >>> list(ask_each(closed, lambda service: asked.append(service.name) or service.region(0.3))), asked
        ([], ['aws'])
    """
    unreachable: set[tuple[str, int]] = set()
    for service in services:
        if service.address in unreachable:
            continue
        try:
            answer = question(service)
        except MetadataError as err:
            if err.unreachable:
                unreachable.add(service.address)
            continue
        yield service, answer
