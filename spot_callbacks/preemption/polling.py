"""The polled notice sources (the clouds, the notice file), polled in one daemon thread.

A timeout, a 5xx, a body that is not what the cloud documents, a missing token or an unreadable
file is "no notice", logged once per source. With ``detect=True`` (``preemption="auto"``) the
thread first asks each cloud's service, with short timeouts and no logging, whether this machine
runs on that cloud, and ends when none answers and nothing else is polled.
``$SPOT_METADATA_POLL_S`` sets the poll interval (default 5 s).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import spot_callbacks.settings as settings
from spot_callbacks.errors import MetadataError
from spot_callbacks.preemption.clouds import ask_each
from spot_callbacks.preemption.metadata import DETECT_TIMEOUT_S
from spot_callbacks.preemption.notice import Notice
from spot_callbacks.preemption.poller import CloudPoller
from spot_callbacks.preemption.sources import NoticeSource

log = logging.getLogger("spot_callbacks")

DEFAULT_POLL_INTERVAL_S = settings.METADATA_POLL_S.default


def default_poll_interval_s() -> float:
    """Seconds between polls: ``$SPOT_METADATA_POLL_S``, else 5."""
    return settings.METADATA_POLL_S.value()


class NoticePollingThread:
    """Polls notice sources in one daemon thread and hands what they find to callbacks.

    Args:
        pollers: the sources to poll (the clouds, the notice file).
        on_notice: called (in the thread) with each new :class:`Notice`.
        on_hint: called (in the thread) with the description of each early hint.
        detect: first keep only the clouds this machine runs on (short timeouts, no log lines),
            and the sources that are no cloud; end at once when none is left.
        poll_interval_s: seconds between polls (default ``$SPOT_METADATA_POLL_S``, else 5).
        detect_timeout_s: timeout of one detection request.

    Example:
        >>> from spot_callbacks.preemption.aws import AwsPoller
        >>> thread = NoticePollingThread([AwsPoller("aws", "http://127.0.0.1:9")], print, print, detect=True)
        >>> thread.start(); thread.detected.wait(5), thread.watched  # nothing listens there
        (True, [])
        >>> thread.stop()
        True
    """

    def __init__(
        self,
        pollers: Sequence[NoticeSource],
        on_notice: Callable[[Notice], None],
        on_hint: Callable[[str], None],
        detect: bool = False,
        poll_interval_s: float | None = None,
        detect_timeout_s: float = DETECT_TIMEOUT_S,
    ) -> None:
        self.pollers = list(pollers)
        self.on_notice = on_notice
        self.on_hint = on_hint
        self.detect = detect
        self.poll_interval_s = poll_interval_s if poll_interval_s is not None else default_poll_interval_s()
        self.detect_timeout_s = detect_timeout_s
        self.watched: list[NoticeSource] = []
        self.detected = threading.Event()  # set once the sources to poll are known
        self._stop = threading.Event()
        self._failing: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="spot-notices", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop polling (a long poll in flight is aborted); True when the thread has ended."""
        self._stop.set()
        for poller in self.pollers:
            poller.abort()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self.watched = self._detect() if self.detect else list(self.pollers)
        finally:
            self.detected.set()
        if not self.watched:
            log.debug("spot_callbacks: no cloud metadata service answered; watching signals only")
            return
        log.info(
            "spot_callbacks: watching preemption notices from %s, every %gs",
            ", ".join(p.describe() for p in self.watched), self.poll_interval_s,
        )  # fmt: skip
        while not self._stop.is_set():
            started = time.monotonic()
            for poller in self.watched:
                if self._stop.is_set():
                    return
                self._poll_one(poller)
            # A long poll (GCP) already spent the interval waiting for a change.
            self._stop.wait(max(0.0, self.poll_interval_s - (time.monotonic() - started)))

    def _detect(self) -> list[NoticeSource]:
        clouds = (p for p in self.pollers if isinstance(p, CloudPoller) and not self._stop.is_set())
        here = {id(poller) for poller, runs_here in ask_each(clouds, self._runs_on) if runs_here}
        return [p for p in self.pollers if id(p) in here or not isinstance(p, CloudPoller)]

    def _runs_on(self, poller: CloudPoller) -> bool:
        try:
            return poller.detect(self.detect_timeout_s)
        except MetadataError:
            raise  # ask_each's: an unreachable address is not asked again
        except Exception as err:  # noqa: BLE001 - detection must never end the thread noisily
            log.debug("spot_callbacks: %s: detection failed: %s", poller.describe(), err)
            return False

    def _poll_one(self, poller: NoticeSource) -> None:
        try:
            result = poller.poll(self.poll_interval_s)
        except Exception as err:  # noqa: BLE001 - a poller must never end the thread or reach training
            if self._stop.is_set():
                return
            if poller.name not in self._failing:
                self._failing.add(poller.name)
                log.warning(
                    "spot_callbacks: %s gave no usable answer (%s); treating it as no notice and "
                    "polling on (further problems with it are not logged)", poller.describe(), err,
                )  # fmt: skip
            return
        if result.notice is not None:
            self.on_notice(result.notice)
        if result.hint is not None:
            self.on_hint(result.hint)
