"""Preemption, in the order it happens: notice -> watcher -> signals -> deadline -> emergency wait -> exit guard.

- ``notice.py``     :class:`Notice` (source, deadline) and the exit code 143 of a preempted run
- ``watcher.py``    :class:`PreemptionWatcher`: every source -> the first notice (what happens on one)
- ``signals.py``    SIGTERM, SIGUSR1, Ctrl-C: async-signal-safe handlers that chain; the grace period
- ``polling.py``    the clouds' notices, polled in one daemon thread; ``clouds.py`` the table of them,
  ``poller.py`` what each is asked, ``aws.py``, ``gcp.py``, ``azure.py`` one cloud each,
  ``metadata.py`` the one HTTP client for metadata services
- ``emergency.py``  the agreed notice's deadline, the emergency wait and its log line
- ``exit_guard.py`` at interpreter exit: join busy workers until the deadline, then exit 143 cleanly
"""

from spot_callbacks.preemption.clouds import CLOUD_SOURCES
from spot_callbacks.preemption.notice import PREEMPTED_EXIT_CODE, Notice
from spot_callbacks.preemption.signals import (
    DEFAULT_SIGNAL_GRACE_S,
    GRACE_SIGNALS,
    SIGNAL_SOURCES,
    signal_grace_s,
)
from spot_callbacks.preemption.watcher import PreemptionWatcher, resolve_sources

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
