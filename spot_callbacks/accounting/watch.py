"""The writer's watch over persisting, fed at each step boundary: how stale, and from which region.

Two alarms, each in its own module: the staleness alarm (``staleness.py``: no commit for too
long) and the in-region warning (``region.py``: the store is in another region than the machine,
judged once the first sizes and speeds are known).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spot_callbacks.accounting.region import RegionCheck
from spot_callbacks.accounting.staleness import StalenessMonitor
from spot_callbacks.store import CheckpointStore


class PersistWatch:
    """The staleness monitor and (on the writer) the region check of one store.

    Example:
        >>> import tempfile
        >>> watch = PersistWatch(CheckpointStore(tempfile.mkdtemp()))
        >>> watch.start(writer=False); watch.staleness.lag_s() >= 0
        True
    """

    def __init__(self, store: CheckpointStore, auto_choice: Callable[[], str | None] | None = None) -> None:
        self.store = store
        self.auto_choice = auto_choice  # with interval="auto": what it chose, for the staleness advice
        self.staleness = StalenessMonitor(store.url)
        self.region_check: RegionCheck | None = None  # the writer's, from start()

    def start(self, writer: bool) -> None:
        self.staleness.start()
        if writer and self.region_check is None and RegionCheck.enabled():
            self.region_check = RegionCheck(self.store.fs, self.store.root, self.store.url)
            self.region_check.start()  # a daemon thread: start-up does not wait for it

    def observe(self, records: Sequence[Any], persister: Any, interval_s: float | None, resumed: Any) -> None:
        """One step boundary on the writer: this run's commits, the persister (or None), the resume (or None)."""
        self.staleness.observe(
            records,
            persister.failures if persister is not None else [],
            persister.in_flight_step if persister is not None else None,
            interval_s,
            getattr(persister, "dropped_for_newer", 0),
            self.auto_choice,
        )
        if self.region_check is not None:
            size = records[-1].bytes if records else resumed.info.size_bytes if resumed else None
            pulled = (resumed.info.size_bytes, resumed.pull_s) if resumed is not None else None
            self.region_check.warn_once(size, pulled)
