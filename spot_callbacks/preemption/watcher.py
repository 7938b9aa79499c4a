"""What happens on a preemption notice: every source (signals, the clouds, a file) -> the first :class:`Notice`.

:class:`PreemptionWatcher` makes each source it watches from the table of them
(:data:`~spot_callbacks.preemption.sources.NOTICE_SOURCES`): a signal's installs its handler
(:mod:`~spot_callbacks.preemption.signals`), the others are polled in one thread
(:mod:`~spot_callbacks.preemption.polling`). The first notice is kept for the engine, an early
hint (AWS rebalance) apart from it, and once the emergency checkpoint has committed, the sources
that ask for it (Azure) are told. ``"auto"`` watches what the table says (SIGTERM, SIGUSR1 too
inside a SLURM job, SIGINT, the cloud this machine runs on, the notice file when one is set).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from spot_callbacks.preemption.metadata import REQUEST_TIMEOUT_S
from spot_callbacks.preemption.notice import Notice
from spot_callbacks.preemption.polling import NoticePollingThread
from spot_callbacks.preemption.signals import ChainedSignalHandlers
from spot_callbacks.preemption.sources import NOTICE_SOURCES, NoticeSource, SourceContext, auto_sources

log = logging.getLogger("spot_callbacks")


def resolve_sources(preemption: str | list[str]) -> list[str]:
    """The notice sources a ``SpotConfig.preemption`` value may watch.

    With ``"auto"``, the table's (:func:`~spot_callbacks.preemption.sources.auto_sources`); the
    clouds are candidates there: only the one this machine runs on is polled.

    Example:
        >>> resolve_sources(["SIGUSR1", "gcp"])
        ['SIGUSR1', 'gcp']
    """
    if preemption == "auto":
        return auto_sources()
    return list(preemption)


class PreemptionWatcher:
    """Watches the configured notice sources and keeps the first notice seen.

    Signal handlers chain to the handler that was installed before (a framework's own), and
    are restored by :meth:`stop`. Cloud sources are polled in one daemon thread that
    :meth:`stop` ends; an early hint (AWS rebalance recommendation) is kept apart from notices,
    for :meth:`take_hint`.

    Args:
        sources: names in :data:`~spot_callbacks.preemption.sources.NOTICE_SOURCES` (see
            :func:`resolve_sources`); a ``ValueError`` lists them when one is not among them.
        detect_cloud: poll only the cloud this machine runs on, found with short timeouts in the
            polling thread (``preemption="auto"``); off-cloud that thread ends after the probes.
        poll_interval_s: seconds between polls (default ``$SPOT_METADATA_POLL_S``, else 5).
        request_timeout_s: timeout of one metadata request.

    Example:
        >>> import os, signal
        >>> watcher = PreemptionWatcher(["SIGUSR1"]); watcher.start()
        >>> os.kill(os.getpid(), signal.SIGUSR1)
        >>> watcher.wait(timeout=5).source
        'SIGUSR1'
        >>> watcher.stop()
    """

    def __init__(
        self,
        sources: list[str],
        detect_cloud: bool = False,
        poll_interval_s: float | None = None,
        request_timeout_s: float | None = None,
    ) -> None:
        unknown = [name for name in sources if name not in NOTICE_SOURCES]
        if unknown:
            raise ValueError(f"unknown notice source(s) {unknown}; known: {list(NOTICE_SOURCES)}")
        self.sources = list(sources)
        self.detect_cloud = detect_cloud
        self.poll_interval_s = poll_interval_s
        self.request_timeout_s = request_timeout_s
        self._notice: Notice | None = None
        self._noticed = threading.Event()
        self._hint: str | None = None
        self._lock = threading.Lock()
        self._signals = ChainedSignalHandlers(on_notice=self.report)
        self._polled: NoticePollingThread | None = None  # while started

    @classmethod
    def from_setting(cls, preemption: str | list[str], **kwargs: Any) -> PreemptionWatcher:
        """The watcher of a ``SpotConfig.preemption`` value (``"auto"`` detects the cloud)."""
        return cls(resolve_sources(preemption), detect_cloud=preemption == "auto", **kwargs)

    # ----------------------------------------------------------- notices
    @property
    def notice(self) -> Notice | None:
        """The first notice since :meth:`clear`, signals received until now included."""
        if self._notice is None:
            self._signals.deliver()
        return self._notice

    def clear(self) -> None:
        with self._lock:
            self._notice = None
            self._noticed.clear()
        self._signals.reset_interrupts()

    @property
    def interrupted_twice(self) -> bool:
        """Ctrl-C was pressed a second time: stop now, wait for nothing."""
        return self._signals.interrupts >= 2

    def report(self, notice: Notice) -> None:
        """Record a notice (first one wins until :meth:`clear`)."""
        with self._lock:
            if self._notice is None:
                self._notice = notice
                self._noticed.set()
                log.warning(
                    "spot_callbacks: preemption notice from %s%s", notice.source,
                    f" ({notice.detail}), {notice.seconds_left():.0f}s left" if notice.deadline else "",
                    # A signal from the launcher reaches every rank alike: rank 0 says it for the run.
                    extra={"run_level": notice.source.startswith("SIG")},
                )  # fmt: skip

    def wait(self, timeout: float | None = None) -> Notice | None:
        """Block until a notice arrives (or ``timeout`` runs out); the notice, or None."""
        if self.notice is None:
            self._noticed.wait(timeout)
        return self._notice

    def report_hint(self, detail: str) -> None:
        """An early hint (not a notice): the next step boundary takes a normal checkpoint."""
        with self._lock:
            self._hint = detail
        log.info("spot_callbacks: %s: a checkpoint is taken at the next step boundary", detail)

    def take_hint(self) -> str | None:
        """The pending hint, if any; it is consumed."""
        with self._lock:
            hint, self._hint = self._hint, None
        return hint

    def acknowledge(self) -> None:
        """Tell the sources that asked (Azure) that the emergency checkpoint is done."""
        polled = self._polled
        if polled is not None:
            for source in polled.pollers:
                source.acknowledge()

    # --------------------------------------------------------- lifecycle
    @property
    def clouds(self) -> list[str]:
        """The polled sources being polled: the clouds (after detection; see :meth:`detected`), the file."""
        polled = self._polled
        return [p.name for p in polled.watched] if polled is not None else []

    @property
    def polling(self) -> bool:
        """Whether the polling thread runs."""
        polled = self._polled
        return polled is not None and polled.alive

    def detected(self, timeout: float | None = None) -> list[str]:
        """Wait until the sources to poll are known (cloud detection is quick); their names."""
        polled = self._polled
        if polled is not None:
            polled.detected.wait(timeout)
        return self.clouds

    def start(self) -> None:
        """Install the signal handlers and start polling; returns at once."""
        context = SourceContext(self.request_timeout_s or REQUEST_TIMEOUT_S, self._signals)
        polling = self.polling
        polled: list[NoticeSource] = []
        for name in self.sources:
            kind = NOTICE_SOURCES[name]
            if polling and not kind.signal:
                continue
            try:
                source = kind.make(name, context)
            except ValueError as err:  # a malformed endpoint variable must not stop training
                log.warning("spot_callbacks: %s notices are not watched: %s", name, err)
                continue
            if not kind.signal:
                polled.append(source)
        if polled:
            self._polled = NoticePollingThread(
                polled,
                on_notice=self.report,
                on_hint=self.report_hint,
                detect=self.detect_cloud,
                poll_interval_s=self.poll_interval_s,
            )
            self._polled.start()

    def reassert(self) -> None:
        """Put our handlers back in front after a framework replaced them with its own.

        They still chain to whatever was installed before :meth:`start`.
        """
        self._signals.reassert()

    def stop(self) -> None:
        """Restore the previous signal handlers and end the polling thread."""
        self._signals.restore()
        polled = self._polled
        if polled is not None and not polled.stop():
            log.warning("spot_callbacks: the preemption notice thread did not end within 5s")
