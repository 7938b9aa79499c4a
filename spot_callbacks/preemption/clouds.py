"""The clouds: each cloud notice source's metadata service, and how they are asked in turn.

:data:`CLOUDS` is read off :data:`~spot_callbacks.preemption.sources.NOTICE_SOURCES`: each cloud's
poller (which also looks up the region), made with its name; the in-region check asks it for the region.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from spot_callbacks.errors import MetadataError
from spot_callbacks.preemption.poller import CloudPoller
from spot_callbacks.preemption.sources import CLOUD_SOURCES, NOTICE_SOURCES

Answer = TypeVar("Answer")

# name -> (endpoint=None, request_timeout_s=...) -> that cloud's poller
CLOUDS: dict[str, Callable[..., CloudPoller]] = {
    name: functools.partial(kind.cloud, name)
    for name, kind in NOTICE_SOURCES.items()
    if kind.cloud is not None
}
__all__ = ["CLOUDS", "CLOUD_SOURCES", "ask_each"]


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
