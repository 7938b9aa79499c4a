"""Every preemption notice source in one table: its name -> how it is made and when ``"auto"`` watches it.

:data:`NOTICE_SOURCES` is the one place the sources' names are spelled. ``SpotConfig.preemption``
accepts its names (and lists them when one is not known); the watcher makes each source it
watches from it; :data:`GRACE_SIGNALS`, :data:`SIGNAL_SOURCES` and :data:`CLOUD_SOURCES` are read
off it. A source is a :class:`NoticeSource`, the shape the cloud pollers share.

A new source: a module here with a class that is a :class:`NoticeSource`, one row below, and its
setting in ``settings.py`` if it has one (docs/architecture.md, "How to extend").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import spot_callbacks.settings as settings
from spot_callbacks.preemption.aws import AwsPoller
from spot_callbacks.preemption.azure import AzurePoller
from spot_callbacks.preemption.gcp import GcpPoller
from spot_callbacks.preemption.notice_file import NoticeFileSource, notice_file_problem
from spot_callbacks.preemption.poller import CloudPoller, Poll
from spot_callbacks.preemption.signals import ChainedSignalHandlers, SignalSource


@runtime_checkable
class NoticeSource(Protocol):
    """Where a preemption notice comes from: what the cloud pollers share, and signals and the file too.

    ``poll`` asks once (``wait_s``: how long a long poll may hold it) and returns a :class:`Poll`: a
    notice with its deadline, an early hint, or neither; it may raise, which the polling thread
    logs once and treats as no notice. A signal is pushed by its handler instead; its ``poll``
    hands over what has arrived.
    """

    name: str

    def poll(self, wait_s: float) -> Poll:
        """Ask once: a notice (with its deadline), a hint, or neither."""
        ...

    def acknowledge(self) -> None:
        """The emergency checkpoint has committed (only Azure listens)."""
        ...

    def abort(self) -> None:
        """End a poll in flight at once, and every later one (the watcher stops)."""
        ...

    def describe(self) -> str:
        """What is watched, for the log."""
        ...


@dataclass(frozen=True)
class SourceContext:
    """What the watcher gives a source's factory: the request timeout and its signal handlers."""

    request_timeout_s: float
    signals: ChainedSignalHandlers


def _always() -> bool:
    return True


def _never() -> bool:
    return False


def _in_slurm() -> bool:
    # SLURM sends the signal chosen with --signal (SIGUSR1 by convention) before its time limit.
    return settings.environment_variable("SLURM_JOB_ID") is not None


def _notice_file_set() -> bool:
    return settings.NOTICE_FILE.value() is not None


def _no_problem() -> str | None:
    return None


@dataclass(frozen=True)
class SourceKind:
    """One row of :data:`NOTICE_SOURCES`.

    Args:
        make: ``(name, context)`` -> the source; a ``ValueError`` (a malformed endpoint) is logged
            and the source is not watched, training goes on.
        in_auto: whether ``preemption="auto"`` watches it (asked when the watcher is made).
        cloud: the cloud's poller class: ``"auto"`` polls the cloud only where its ``detect`` says
            this machine runs there, and the in-region check asks it for the region.
        signal: a signal: its handler pushes the notice; it is not polled.
        grace: a signal that SIGKILL follows after ``$SPOT_SIGNAL_GRACE_S`` (the start-up exit
            and the grace check watch these).
        problem: why the source cannot be watched as configured (its setting is missing), checked
            when the config is built; None when it can.
    """

    make: Callable[[str, SourceContext], NoticeSource]
    in_auto: Callable[[], bool] = _never
    cloud: type[CloudPoller] | None = None
    signal: bool = False
    grace: bool = False
    problem: Callable[[], str | None] = _no_problem


def _signal(name: str, context: SourceContext) -> NoticeSource:
    return SignalSource(name, context.signals)


def _cloud(poller: type[CloudPoller]) -> Callable[[str, SourceContext], NoticeSource]:
    def make(name: str, context: SourceContext) -> NoticeSource:
        return poller(name, request_timeout_s=context.request_timeout_s)

    return make


def _notice_file(name: str, context: SourceContext) -> NoticeSource:
    return NoticeFileSource(name)


# The two signals other layers answer to by name: the termination a scheduler, Lightning's signal
# connector and the HF Trainer's own jit checkpoint answer to, and Ctrl-C, which always stops.
TERMINATION = "SIGTERM"
INTERRUPT = "SIGINT"

NOTICE_SOURCES: dict[str, SourceKind] = {
    TERMINATION: SourceKind(_signal, in_auto=_always, signal=True, grace=True),
    "SIGUSR1": SourceKind(_signal, in_auto=_in_slurm, signal=True, grace=True),
    # Ctrl-C: the first checkpoints and stops, the second stops at once.
    INTERRUPT: SourceKind(_signal, in_auto=_always, signal=True),
    "aws": SourceKind(_cloud(AwsPoller), in_auto=_always, cloud=AwsPoller),
    "gcp": SourceKind(_cloud(GcpPoller), in_auto=_always, cloud=GcpPoller),
    "azure": SourceKind(_cloud(AzurePoller), in_auto=_always, cloud=AzurePoller),
    "file": SourceKind(_notice_file, in_auto=_notice_file_set, problem=notice_file_problem),
}

SIGNAL_SOURCES = tuple(name for name, kind in NOTICE_SOURCES.items() if kind.signal)
GRACE_SIGNALS = tuple(name for name, kind in NOTICE_SOURCES.items() if kind.grace)
CLOUD_SOURCES = tuple(name for name, kind in NOTICE_SOURCES.items() if kind.cloud is not None)


def auto_sources() -> list[str]:
    """The sources ``preemption="auto"`` watches, in the table's order (the clouds as candidates).

    Example:
        >>> auto_sources()[-3:] == list(CLOUD_SOURCES) or auto_sources()[-1] == "file"
        True
    """
    return [name for name, kind in NOTICE_SOURCES.items() if kind.in_auto()]
