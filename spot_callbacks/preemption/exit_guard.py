"""The process exit while a persister's worker is still busy: bounded, and never inside ``torch.save``.

Python stops daemon threads where they stand when the interpreter finalises; a writer thread
inside ``torch.save`` (C++) then aborts the process (SIGABRT/SIGSEGV, exit 134/139) instead of
the 143 a preempted run exits with. At exit, the busy workers of every open persister are given
until the armed deadline to park; one still busy then ends the process at once, with the armed
exit code, logs flushed, before finalisation can reach it.

Other daemon threads that run torch ops (the staging buffers' preparation) are stopped at exit the
same way, before finalisation: :func:`stop_at_exit`.

A stopped run's exit skips the interpreter's last garbage collections (:func:`gc.freeze`): with
torch and a framework loaded they walk millions of objects, a second or more between the last
commit and the process's end, all of it billed; objects still alive at exit are not promised their
``__del__`` by Python in any case.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any

from spot_callbacks.preemption.notice import PREEMPTED_EXIT_CODE

log = logging.getLogger("spot_callbacks")

# How long an exit that nobody armed waits for busy workers (a plain end of the script).
UNARMED_EXIT_WAIT_S = 10.0
# Kept back from an armed deadline for the exit itself (flushing the logs, the process going away).
EXIT_SLACK_S = 1.0
# Waited without a word: a worker finishing the bookkeeping after its commit is not worth a warning.
QUIET_WAIT_S = 1.0

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: the second Ctrl-C

_open: weakref.WeakSet[Any] = weakref.WeakSet()
_stopped: weakref.WeakSet[Any] = weakref.WeakSet()  # owners of daemon threads in torch ops: stop_for_exit()
_armed: dict[str, Any] = {}  # "deadline" (epoch seconds), "code": set by arm()
_last_line: dict[str, str] = {}  # "text": what happens next, said again if the exit cuts a worker off
_registered = threading.Lock()
_installed = False


def guard(persister: Any) -> None:
    """Watch ``persister`` (its ``idle`` and ``worker_threads()``) at the exit of this process."""
    _install()
    _open.add(persister)


def stop_at_exit(owner: Any) -> None:
    """Call ``owner.stop_for_exit()`` at the exit of this process, before the interpreter finalises.

    Python stops a daemon thread where it next returns from C once finalisation has begun; one inside
    a torch op then unwinds through a ``noexcept`` C++ frame, and the process aborts ("terminate called
    without an active exception", SIGABRT) instead of exiting with its code. ``stop_for_exit`` ends the
    owner's thread at its next safe point and waits for it.
    """
    _install()
    _stopped.add(owner)


def _install() -> None:
    global _installed
    with _registered:
        if not _installed:
            atexit.register(park_workers_at_exit)
            _installed = True


def arm(deadline: float | None, exit_code: int) -> None:
    """The process is to exit with ``exit_code`` by ``deadline`` (epoch seconds; None: no limit but
    :data:`UNARMED_EXIT_WAIT_S`), a busy worker or not."""
    _install()
    _armed.update(deadline=deadline, code=exit_code)


def arm_for(notice: Any, stops: bool, stop_now: bool) -> None:
    """Arm the exit of a run that stops: by the deadline of a ``notice`` that ``stops`` it, with 143,
    or at once with 130 after a second Ctrl-C (``stop_now``)."""
    if stop_now:
        arm(time.time(), INTERRUPTED_EXIT_CODE)
    elif notice is not None and stops:
        arm(notice.deadline, PREEMPTED_EXIT_CODE)


def say_at_exit(line: str) -> None:
    """``line`` (what happens next: the resume point, the rerun) is the last thing an exit that has to
    cut a busy worker off says, so the truth stays the last line."""
    _last_line["text"] = line


def busy_workers() -> list[threading.Thread]:
    """The live worker threads of the persisters that still have work."""
    return [
        thread
        for persister in list(_open)
        if not persister.idle
        for thread in persister.worker_threads()
        if thread.is_alive()
    ]


def park_workers_at_exit() -> None:
    """At interpreter exit: wait (bounded) for busy workers; if one is still busy, ``os._exit`` now.
    An armed exit (a stopped run) then leaves the objects alive to the process's end, uncollected.

    Example:
        >>> park_workers_at_exit()  # nothing busy, nothing armed: returns at once
    """
    for owner in list(_stopped):
        try:
            owner.stop_for_exit()
        except Exception as err:  # noqa: BLE001 - the exit goes on; the abort it guards against is no worse
            log.debug("spot_callbacks: stopping %r at exit failed: %r", owner, err)
    _park_busy_workers()
    if "code" in _armed:
        # What is left is memory the process's end frees at once; the collections would take seconds.
        gc.freeze()


def _park_busy_workers() -> None:
    busy = busy_workers()
    if not busy:
        return
    armed = _armed.get("deadline")
    deadline = armed - EXIT_SLACK_S if armed is not None else time.time() + UNARMED_EXIT_WAIT_S
    quiet_until = min(deadline, time.time() + QUIET_WAIT_S)
    for thread in busy:
        thread.join(max(quiet_until - time.time(), 0.0))
    busy = busy_workers()
    if not busy:
        return
    names = ", ".join(sorted({thread.name for thread in busy}))
    log.warning(
        "spot_callbacks: exiting while %s still works; waiting at most %.1fs for it to finish",
        names, max(deadline - time.time(), 0.0),
    )  # fmt: skip
    for thread in busy:
        thread.join(max(deadline - time.time(), 0.0))
    if not any(thread.is_alive() for thread in busy) or "code" not in _armed:
        return
    log.error(
        "spot_callbacks: %s did not finish in time; exiting with %d now: %s",
        names, _armed["code"], _last_line.get("text", "the newest committed checkpoint stays the resume point"),
    )  # fmt: skip
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_armed["code"])
