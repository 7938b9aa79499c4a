"""Notices during start-up: a SIGTERM while the run waits for its lock or pulls its checkpoint ends the
process at once, cleanly.

Before training runs there is nothing to save: the preemption watcher (which turns a notice into an
emergency checkpoint at the next step boundary) would only act after a long lock wait or pull, when
the machine may be gone. While :func:`exit_on_notice` is active, the configured grace signals raise
``SystemExit(143)`` in the main thread; the exception unwinds
through the caller's ``finally`` blocks, which release the run lock if it was taken. Nothing is
half-written to the store: a pull writes only local files, into a hidden folder renamed when whole.

Example:
    >>> with exit_on_notice(["SIGTERM"], "waiting for the run lock"):
    ...     pass  # a SIGTERM here would exit with 143 and one line
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import spot_callbacks.preemption.exit_guard as exit_guard
from spot_callbacks.preemption.notice import PREEMPTED_EXIT_CODE
from spot_callbacks.preemption.signals import signal_grace_s
from spot_callbacks.preemption.sources import GRACE_SIGNALS

log = logging.getLogger("spot_callbacks")


@contextlib.contextmanager
def exit_on_notice(sources: Iterable[str], doing: str) -> Iterator[None]:
    """While the block runs (``doing``: what it does, in the exit line), a grace signal among
    ``sources`` exits with 143; the previous handlers are back afterwards. A no-op off the main thread."""
    names = [name for name in sources if name in GRACE_SIGNALS and hasattr(signal, name)]
    if not names or threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        log.warning(
            "spot_callbacks: %s while %s, before training began: exiting with %d; nothing was written to "
            "the store. Run the same command again: it resumes from the newest committed checkpoint",
            name, doing, PREEMPTED_EXIT_CODE,
        )  # fmt: skip
        exit_guard.arm(time.time() + signal_grace_s(), PREEMPTED_EXIT_CODE)  # and prompt (exit_guard)
        raise SystemExit(PREEMPTED_EXIT_CODE)  # unwinds through the callers' finally blocks

    previous = {name: signal.signal(getattr(signal, name), interrupted) for name in names}
    try:
        yield
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)
