"""Termination signals as notices: handlers that chain to the ones installed before, and the grace period.

``SIGTERM`` comes from Kubernetes, SLURM's preemption and a cloud's shutdown; ``SIGUSR1`` from
SLURM's ``--signal`` before a time limit. Either leaves :func:`signal_grace_s` before SIGKILL.
``SIGINT`` (Ctrl-C) is a notice without a deadline the first time: the last completed step is
checkpointed and committed, then training stops; the second time it is what it was before
(``KeyboardInterrupt``): stop now.

A handler does nothing that can block or re-enter: Python runs it on the main thread between two
bytecodes, possibly while that thread holds a lock the handler would need (the watcher's, a
logging stream's) or while an earlier handler runs. It only puts the notice on a
``queue.SimpleQueue`` (whose ``put`` is reentrant, written in C for this); a relay thread, and
whoever reads the watcher first, turns it into the logged notice outside the handler.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import spot_callbacks.settings as settings
from spot_callbacks.preemption.notice import Notice
from spot_callbacks.preemption.poller import Poll

log = logging.getLogger("spot_callbacks")

# Kubernetes' default terminationGracePeriodSeconds; SLURM and clouds give as much or more.
DEFAULT_SIGNAL_GRACE_S = settings.SIGNAL_GRACE_S.default


def signal_grace_s() -> float:
    """Seconds between a termination signal and SIGKILL: ``$SPOT_SIGNAL_GRACE_S``, else 30 (Kubernetes)."""
    return settings.SIGNAL_GRACE_S.value()


class ChainedSignalHandlers:
    """Signal handlers that report a :class:`Notice`, then call the handler that was installed before.

    Signal handlers can only be set on the main thread; elsewhere a signal is not watched (logged).
    The handlers themselves take no lock and write nothing: a received signal is queued, and
    ``on_notice`` runs later in a relay thread or in :meth:`deliver` (see the module docstring).

    Args:
        on_notice: called (outside the handler) with the notice of each signal received.

    Example:
        >>> import os
        >>> notices, before = [], signal.getsignal(signal.SIGUSR1)
        >>> handlers = ChainedSignalHandlers(notices.append); handlers.install(signal.SIGUSR1)
        >>> os.kill(os.getpid(), signal.SIGUSR1); handlers.deliver()
        >>> notices[0].source, notices[0].detail
        ('SIGUSR1', 'signal')
        >>> handlers.restore(); signal.getsignal(signal.SIGUSR1) is before
        True
    """

    def __init__(self, on_notice: Callable[[Notice], None]) -> None:
        self.on_notice = on_notice
        self.interrupts = 0  # Ctrl-C presses since the last reset_interrupts()
        self._previous: dict[int, Any] = {}
        self._handlers: dict[int, Any] = {}
        # Notices and log lines from handlers; SimpleQueue.put is reentrant (safe in a handler).
        self._received: queue.SimpleQueue[Notice | str | None] = queue.SimpleQueue()
        self._relay: threading.Thread | None = None
        self._delivering = threading.Lock()  # never taken in a handler

    def install(self, signum: int) -> None:
        """Put our handler for ``signum`` in front of the current one."""
        if threading.current_thread() is not threading.main_thread():
            log.info("spot_callbacks: not on the main thread; %s is not watched", signal.Signals(signum).name)
            return
        if signum in self._previous:  # installed twice: keep chaining to the original handler
            return
        previous = signal.getsignal(signum)
        if signum == signal.SIGINT and previous is signal.SIG_IGN:
            return  # Ctrl-C is ignored in this process (a launcher's choice): keep it so
        self._previous[signum] = previous
        grace_s = signal_grace_s()  # read now: the handler must not parse or log
        name = signal.Signals(signum).name

        def handler(received: int, frame: FrameType | None) -> None:
            self._received.put(Notice(name, time.time() + grace_s, "signal"))
            if callable(previous):
                previous(received, frame)

        self._handlers[signum] = self._on_interrupt(previous, name) if signum == signal.SIGINT else handler
        self._start_relay()
        signal.signal(signum, self._handlers[signum])

    def _on_interrupt(self, previous: Any, name: str) -> Callable[[int, FrameType | None], None]:
        """The Ctrl-C handler: the first is a notice without deadline, the second stops now (as before)."""

        def handler(received: int, frame: FrameType | None) -> None:
            self.interrupts += 1
            if self.interrupts == 1:
                self._received.put(
                    "spot_callbacks: Ctrl-C: checkpointing the last completed step, then stopping once it "
                    "is committed (as long as the upload takes); press Ctrl-C again to stop at once"
                )
                self._received.put(Notice(name, None, "Ctrl-C"))
                return
            self._received.put(
                "spot_callbacks: second Ctrl-C: stopping at once, not waiting for uploads; a restart resumes "
                "from the newest committed checkpoint, if any (spot-callbacks ls DIRPATH lists them)"
            )
            if callable(previous):
                previous(received, frame)
            raise KeyboardInterrupt

        return handler

    # ------------------------------------------------ outside the handlers
    def _start_relay(self) -> None:
        if self._relay is None or not self._relay.is_alive():
            self._relay = threading.Thread(target=self._relay_forever, name="spot-signals", daemon=True)
            self._relay.start()

    def _relay_forever(self) -> None:
        while True:
            item = self._received.get()
            if item is None:
                return
            self._deliver_one(item)

    def _deliver_one(self, item: Notice | str) -> None:
        with self._delivering:  # one at a time, in the order received
            if isinstance(item, str):
                log.warning("%s", item)
            else:
                self.on_notice(item)

    def deliver(self) -> None:
        """Hand every signal received so far to ``on_notice`` now (the relay thread does it too).

        Called where the notice is read (a step boundary), so a signal that arrived just before
        counts there, whether or not the relay thread has run yet.
        """
        while True:
            try:
                item = self._received.get_nowait()
            except queue.Empty:
                return
            if item is None:  # the relay's stop: leave it for the relay
                self._received.put(None)
                return
            self._deliver_one(item)

    def reset_interrupts(self) -> None:
        self.interrupts = 0

    def reassert(self) -> None:
        """Put our handlers back in front after a framework replaced them with its own.

        They still chain to whatever was installed before :meth:`install`.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for signum, previous in self._previous.items():
            with contextlib.suppress(ValueError, OSError):  # not the main thread any more
                signal.signal(signum, previous)
        self._previous.clear()
        self._handlers.clear()
        self.deliver()
        relay, self._relay = self._relay, None
        if relay is not None and relay.is_alive():
            self._received.put(None)  # the relay ends after what is queued before it


class SignalSource:
    """One signal as a notice source: making it installs its handler in the watcher's ``handlers``.

    The handler pushes the notice as the signal arrives (see the module docstring), so there is
    nothing to ask: :meth:`poll` hands over what has arrived and finds nothing of its own.
    ``handlers.restore()`` takes the handler out again.

    Example:
        >>> import os
        >>> notices = []; handlers = ChainedSignalHandlers(notices.append)
        >>> source = SignalSource("SIGUSR1", handlers); os.kill(os.getpid(), signal.SIGUSR1)
        >>> source.poll(0.0).notice, [n.source for n in notices]
        (None, ['SIGUSR1'])
        >>> handlers.restore()
    """

    def __init__(self, name: str, handlers: ChainedSignalHandlers) -> None:
        self.name = name
        self.handlers = handlers
        handlers.install(signal.Signals[name])

    def poll(self, wait_s: float) -> Poll:
        self.handlers.deliver()
        return Poll()

    def acknowledge(self) -> None:
        """Nothing listens for it."""

    def abort(self) -> None:
        """Nothing in flight; the watcher restores the handlers."""

    def describe(self) -> str:
        return f"the {self.name} signal"
