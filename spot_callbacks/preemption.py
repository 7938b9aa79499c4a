"""Preemption notices: every source (signals today; cloud metadata pollers later) -> one `Notice`."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

log = logging.getLogger("spot_callbacks")

# Kubernetes' default terminationGracePeriodSeconds; SLURM and clouds give as much or more.
DEFAULT_SIGNAL_GRACE_S = 30.0
SIGNAL_SOURCES = ("SIGTERM", "SIGUSR1")


@dataclass(frozen=True)
class Notice:
    """The machine is going away: where the news came from and when it must be done (epoch seconds)."""

    source: str
    deadline: float | None
    detail: str = ""
    received_at: float = field(default_factory=time.time)

    def seconds_left(self, now: float | None = None) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)


def signal_grace_s() -> float:
    """Seconds between a termination signal and SIGKILL: ``$SPOT_SIGNAL_GRACE_S``, else 30 (Kubernetes)."""
    raw = os.environ.get("SPOT_SIGNAL_GRACE_S")
    try:
        return float(raw) if raw else DEFAULT_SIGNAL_GRACE_S
    except ValueError:
        log.warning(
            "spot_callbacks: SPOT_SIGNAL_GRACE_S=%r is not a number; using %.0fs", raw, DEFAULT_SIGNAL_GRACE_S
        )
        return DEFAULT_SIGNAL_GRACE_S


def resolve_sources(preemption: str | list[str]) -> list[str]:
    """The concrete notice sources of a ``SpotConfig.preemption`` value."""
    if preemption == "auto":
        return ["SIGTERM"]  # cloud detection is added with the metadata pollers
    return list(preemption)


class PreemptionWatcher:
    """Installs the configured notice sources and keeps the first notice seen.

    Signal handlers chain to the handler that was installed before (a framework's own), and
    are restored by :meth:`stop`.

    Example:
        >>> watcher = PreemptionWatcher(["SIGUSR1"]); watcher.start()
        >>> os.kill(os.getpid(), signal.SIGUSR1)
        >>> watcher.notice.source
        'SIGUSR1'
        >>> watcher.stop()
    """

    def __init__(self, sources: list[str]) -> None:
        self.sources = list(sources)
        self._notice: Notice | None = None
        self._lock = threading.Lock()
        self._previous: dict[int, Any] = {}
        self._handlers: dict[int, Any] = {}

    @property
    def notice(self) -> Notice | None:
        return self._notice

    def clear(self) -> None:
        with self._lock:
            self._notice = None

    def report(self, notice: Notice) -> None:
        """Record a notice (first one wins until :meth:`clear`)."""
        with self._lock:
            if self._notice is None:
                self._notice = notice
                log.warning(
                    "spot_callbacks: preemption notice from %s%s", notice.source,
                    f", {notice.seconds_left():.0f}s left" if notice.deadline else "",
                )  # fmt: skip

    def start(self) -> None:
        for name in self.sources:
            if name in SIGNAL_SOURCES:
                self._install_signal(getattr(signal, name))

    def reassert(self) -> None:
        """Put our handlers back in front after a framework replaced them with its own.

        They still chain to whatever was installed before :meth:`start`.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)

    def stop(self) -> None:
        for signum, previous in self._previous.items():
            with contextlib.suppress(ValueError, OSError):  # not the main thread any more
                signal.signal(signum, previous)
        self._previous.clear()
        self._handlers.clear()

    def _install_signal(self, signum: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.info("spot_callbacks: not on the main thread; %s is not watched", signal.Signals(signum).name)
            return
        previous = signal.getsignal(signum)
        self._previous[signum] = previous

        def handler(received: int, frame: FrameType | None) -> None:
            self.report(Notice(signal.Signals(received).name, time.time() + signal_grace_s(), "signal"))
            if callable(previous):
                previous(received, frame)

        self._handlers[signum] = handler
        signal.signal(signum, handler)
