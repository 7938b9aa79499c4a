"""Preemption notices: every source (signals, cloud metadata services) -> one :class:`Notice`.

Where to look: :mod:`~spot_callbacks.notices.watcher` (what happens on a notice), ``signals``
(SIGTERM, SIGUSR1, Ctrl-C, the grace period), ``polling`` (the clouds' thread), ``aws``, ``gcp``,
``azure`` (one file per cloud: its notices and its region), ``clouds`` (the table of them),
``metadata`` (the HTTP client they share).
"""

from spot_callbacks.notices.clouds import CLOUD_SOURCES
from spot_callbacks.notices.notice import PREEMPTED_EXIT_CODE, Notice
from spot_callbacks.notices.signals import (
    DEFAULT_SIGNAL_GRACE_S,
    GRACE_SIGNALS,
    SIGNAL_SOURCES,
    signal_grace_s,
)
from spot_callbacks.notices.watcher import PreemptionWatcher, resolve_sources

__all__ = [
    "CLOUD_SOURCES",
    "DEFAULT_SIGNAL_GRACE_S",
    "GRACE_SIGNALS",
    "PREEMPTED_EXIT_CODE",
    "SIGNAL_SOURCES",
    "Notice",
    "PreemptionWatcher",
    "resolve_sources",
    "signal_grace_s",
]
