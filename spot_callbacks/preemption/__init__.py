"""Preemption, in the order it happens: notice -> watcher -> signals -> deadline -> emergency wait -> exit guard.

- ``notice.py``     :class:`Notice` (source, deadline) and the exit code 143 of a preempted run
- ``watcher.py``    :class:`PreemptionWatcher`: every source -> the first notice (what happens on one)
- ``signals.py``    SIGTERM, SIGUSR1, Ctrl-C: async-signal-safe handlers that chain; the grace period
- ``sources.py``    :data:`NOTICE_SOURCES`: every source's name -> how it is made (the one table of names)
  and :class:`NoticeSource`, what a source is
- ``polling.py``    the polled sources, in one daemon thread: ``clouds.py`` the clouds and how they
  are asked in turn, ``poller.py`` what each is asked, ``aws.py``, ``gcp.py``, ``azure.py`` one
  cloud each, ``metadata.py`` the one HTTP client for metadata services; ``notice_file.py`` a file
  whose appearance is the notice
- ``emergency.py``  the agreed notice's deadline, the emergency wait and its log line
- ``exit_guard.py`` at interpreter exit: join busy workers until the deadline, then exit 143 cleanly
"""

from spot_callbacks.preemption.notice import PREEMPTED_EXIT_CODE, Notice
from spot_callbacks.preemption.signals import DEFAULT_SIGNAL_GRACE_S, signal_grace_s
from spot_callbacks.preemption.sources import (
    CLOUD_SOURCES,
    GRACE_SIGNALS,
    INTERRUPT,
    NOTICE_SOURCES,
    SIGNAL_SOURCES,
    TERMINATION,
    NoticeSource,
)
from spot_callbacks.preemption.watcher import PreemptionWatcher, resolve_sources

__all__ = [
    "CLOUD_SOURCES",
    "DEFAULT_SIGNAL_GRACE_S",
    "GRACE_SIGNALS",
    "INTERRUPT",
    "NOTICE_SOURCES",
    "PREEMPTED_EXIT_CODE",
    "SIGNAL_SOURCES",
    "TERMINATION",
    "Notice",
    "NoticeSource",
    "PreemptionWatcher",
    "resolve_sources",
    "signal_grace_s",
]
