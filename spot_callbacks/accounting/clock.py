"""What this run's checkpoints cost, as it trains: the training clock, the ledger, the slowdown meter.

The ledger (:class:`~spot_callbacks.accounting.ledger.RunLedger`) is the lineage's: it continues
the one in the checkpoint resumed from, records that resume, and goes into every manifest. The
training clock counts wall-clock training seconds of the lineage (not pulls, loads or downtime).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from spot_callbacks._format import format_seconds
from spot_callbacks.accounting.ledger import (
    DIED_UNCOMMITTED,
    RunLedger,
    SlowdownMeter,
    ledger_after_resume,
    seconds_value,
)
from spot_callbacks.accounting.report import RunHistory, format_rows, history_rows

log = logging.getLogger("spot_callbacks")


class RunAccounts:
    """The training clock, the ledger and the slowdown meter of one run.

    Example:
        >>> accounts = RunAccounts()
        >>> accounts.start_clock(0.0)
        >>> metrics = accounts.add_checkpoint("interval", stall_s=0.25, interval_s=60.0)
        >>> accounts.ledger.checkpoints, metrics["stall_s"], metrics["interval_s"]
        ({'interval': 1}, 0.25, 60.0)
    """

    def __init__(self) -> None:
        self.ledger = RunLedger()
        # Every manifest says which lineage it continues (store/commit.py: retention and latest()
        # follow it): a fresh run starts one, a resume continues the one of its checkpoint.
        self.lineage: dict[str, Any] = {"id": uuid.uuid4().hex, "resumed_from": None}
        self.slowdown = SlowdownMeter()
        self.created_at = time.time()  # a resume's downtime ends when this run's callback exists
        self.train_base_s = 0.0
        self.train_started_at: float | None = None
        self._last_step_at: float | None = None
        # (started, last heartbeat) of a previous run seen dead through its stale run lock (run_lease).
        self.dead_run: tuple[float, float] | None = None

    def start_clock(self, train_s: float | None = None) -> None:
        """(Re)start the training clock at ``train_s`` seconds (default: the ledger's)."""
        self.train_base_s = self.ledger.train_s if train_s is None else train_s
        self.train_started_at = time.monotonic()
        self._last_step_at = None

    def train_seconds(self) -> float:
        """Seconds of training in this run's lineage: the checkpoint resumed from's, plus this run's so far."""
        if self.train_started_at is None:
            return self.ledger.train_s
        return self.train_base_s + time.monotonic() - self.train_started_at

    def time_step(self, persisting: bool) -> None:
        """A step boundary: the step's time feeds the slowdown meter (``persisting``: an upload ran)."""
        now = time.perf_counter()
        if self._last_step_at is not None:
            self.slowdown.observe_step(now - self._last_step_at, persisting)
        self._last_step_at = now

    def add_checkpoint(self, reason: str, stall_s: float, interval_s: float | None) -> dict[str, Any]:
        """Add a checkpoint to the ledger; return what its manifest's ``metrics`` record (see ledger.py)."""
        slowdown_s = self.slowdown.per_checkpoint_s()
        train_s = self.train_seconds()
        self.ledger = self.ledger.add_checkpoint(reason, stall_s, train_s, slowdown_s)
        return {
            "stall_s": round(stall_s, 6),
            "slowdown_s": round(slowdown_s, 6),
            "train_s": round(train_s, 3),
            "taken_at": round(time.time(), 3),
            "interval_s": interval_s,
        }

    def checkpoint_taken(self, stall_s: float) -> float:
        """After a checkpoint: its cost to the training (the stall plus the persist's slowdown)."""
        self.slowdown.checkpoint_taken()
        cost_s = stall_s + self.slowdown.per_checkpoint_s()
        self._last_step_at = time.perf_counter()  # the next step's time must not include this stall
        return cost_s

    def interruption_history(self) -> tuple[int, float]:
        """Interruptions and billed hours of the lineage, for ``interval="auto"``."""
        return self.ledger.interruptions, self.ledger.billed_s / 3600.0

    def continue_lineage(self, info: Any) -> None:
        """This run resumed from checkpoint ``info``: its checkpoints continue that one's lineage
        (``None`` for a checkpoint written before lineages were recorded), and ``info`` is protected."""
        lineage = info.extra.get("lineage") if isinstance(info.extra.get("lineage"), dict) else {}
        lineage_id = lineage.get("id")
        self.lineage = {"id": lineage_id if isinstance(lineage_id, str) else None, "resumed_from": info.step}

    def record_resume(self, info: Any, pull_s: float, pulled_at: float, say_info: bool) -> None:
        """Continue the ledger of the checkpoint resumed from (``info``), with this resume in it."""
        load_s = time.perf_counter() - pulled_at
        self.ledger = ledger_after_resume(info, self.created_at, pull_s, load_s, self.dead_run)
        record = self.ledger.recent_resumes[-1]
        if record.from_reason == DIED_UNCOMMITTED and self.dead_run is not None:
            log.warning(
                "spot_callbacks: the previous run (its stale run lock says: started %s, last heartbeat "
                "%s later) died before committing anything: an interruption that lost at least %s of work",
                datetime.fromtimestamp(self.dead_run[0], timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                format_seconds(record.lost_work_s), format_seconds(record.lost_work_s),
            )  # fmt: skip
        self.start_clock(self.ledger.train_s)
        lost = format_seconds(record.lost_work_s)
        lost = lost if record.lost_work_measured else f"<= {lost} (estimated: no emergency checkpoint)"
        (log.info if say_info else log.debug)(
            "spot_callbacks: resumed from step %d (%s): pull %s, load %s%s",
            info.step, info.reason, format_seconds(record.pull_s), format_seconds(record.load_s),
            f", lost work {lost}, downtime {format_seconds(record.downtime_s)}" if record.interrupted else "",
        )  # fmt: skip

    def load(self, state: dict[str, Any]) -> bool:
        """Continue the ledger and clock saved in ``state`` (untrusted: checked); False if it has none."""
        ledger = RunLedger.from_json(state.get("ledger"), "the checkpoint's state")
        if ledger is None:
            return False
        self.ledger = ledger
        self.start_clock(seconds_value(state.get("train_s")) or ledger.train_s)
        return True

    def summary(self, store_url: str, records: Sequence[Any], interval_line: str) -> str:
        """The run's checkpoint costs on one screen (``records``: this run's commits)."""
        history = RunHistory(
            store_url, self.ledger, tuple(record.info for record in records), at_hand="committed by this run"
        )
        rows = history_rows(history, records=records)
        rows.append(("interval", interval_line))
        return f"spot_callbacks: checkpoint costs of {store_url}\n{format_rows(rows)}"
