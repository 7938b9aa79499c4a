"""When to checkpoint: the interval clock, every N steps, "auto", preemption; agreed by every rank."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

from spot_callbacks._format import format_seconds
from spot_callbacks.accounting.costs import (
    PRIOR_INTERRUPTIONS_PER_HOUR,
    daly_interval_s,
    posterior_interruptions_per_hour,
)
from spot_callbacks.accounting.ledger import finite_number

log = logging.getLogger("spot_callbacks")

AUTO_INITIAL_INTERVAL_S = 1800.0
AUTO_MIN_INTERVAL_S = 60.0
AUTO_MAX_INTERVAL_S = 6 * 3600.0
# When "auto" is told no rate and the run has no history yet: a pessimistic spot market.
DEFAULT_INTERRUPTIONS_PER_HOUR = PRIOR_INTERRUPTIONS_PER_HOUR
AUTO_RECENT_COSTS = 10  # delta is the median of this many recent checkpoint costs
AUTO_RETUNE_THRESHOLD = 0.1  # a new interval within 10 % of the current one is not worth a change


class CheckpointTrigger:
    """Decides, at a step boundary, whether a checkpoint is due on this process.

    The interval clock counts wall-clock seconds of training since the last checkpoint; it is
    part of :meth:`state_dict`, so a resumed run continues the count instead of restarting it.

    Example:
        >>> now = [0.0]
        >>> trigger = CheckpointTrigger(interval_s=60, every_n_steps=None, clock=lambda: now[0])
        >>> trigger.due(step=1) is None
        True
        >>> now[0] = 61.0; trigger.due(step=2)
        'interval'
    """

    def __init__(
        self,
        interval_s: float | None,
        every_n_steps: int | None,
        auto: bool = False,
        interruptions_per_hour: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.auto = auto
        self.interval_s = AUTO_INITIAL_INTERVAL_S if auto else interval_s
        self.every_n_steps = every_n_steps
        self.interruptions_per_hour = interruptions_per_hour
        self._clock = clock
        self._last_checkpoint_at = clock()
        self._checkpoint_costs_s: list[float] = []
        self._observed_interruptions = 0
        self._observed_hours = 0.0

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._last_checkpoint_at

    def due(self, step: int) -> str | None:
        if self.interval_s is not None and self.elapsed_s >= self.interval_s:
            return "interval"
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0:
            return "steps"
        return None

    def mark_checkpoint(self, cost_s: float | None = None) -> None:
        """Restart the clock; with ``interval="auto"``, feed the measured cost into the interval.

        ``cost_s`` is what the checkpoint cost the training: the blocked time plus the slowdown
        its background persist causes.
        """
        self._last_checkpoint_at = self._clock()
        if cost_s is not None and self.auto:
            self._checkpoint_costs_s = [*self._checkpoint_costs_s[-(AUTO_RECENT_COSTS - 1) :], cost_s]
            self._retune()

    def observe_interruptions(self, interruptions: int, hours: float) -> None:
        """The run's own history (from its ledger), for ``"auto"`` when ``interruptions_per_hour`` is None."""
        self._observed_interruptions, self._observed_hours = interruptions, hours

    def interruption_rate(self) -> tuple[float, str]:
        """The rate ``"auto"`` plans for, and where it comes from (for the log line)."""
        if self.interruptions_per_hour is not None:
            return self.interruptions_per_hour, "interruptions_per_hour"
        rate = posterior_interruptions_per_hour(self._observed_interruptions, self._observed_hours)
        return rate, (
            f"{self._observed_interruptions} interruptions in {self._observed_hours:.1f} h of this run, "
            f"with a prior of {DEFAULT_INTERRUPTIONS_PER_HOUR:g}/h"
        )

    def describe(self) -> str:
        """The interval in force, for the cost summary: ``"30.0 min"``, ``"off"``, or with its "auto" rate.

        Example:
            >>> CheckpointTrigger(None, 5).describe()
            'off'
        """
        interval = format_seconds(self.interval_s) if self.interval_s else "off"
        if self.auto:
            rate, _ = self.interruption_rate()
            interval += f" (auto, for {rate:.3g} interruptions/h)"
        return interval

    def auto_choice(self) -> str | None:
        """What ``interval="auto"`` chose and from what, for advice that fits it; ``None`` when not "auto".

        Example:
            >>> trigger = CheckpointTrigger(None, None, auto=True, interruptions_per_hour=0.1)
            >>> trigger.mark_checkpoint(cost_s=0.25)
            >>> print(trigger.auto_choice())  # doctest: +ELLIPSIS
            interval='auto' chose 2.2 min (Daly's optimum) from a checkpoint cost of 0.25 s (...) and 0.1 interruptions/h from interruptions_per_hour
            >>> CheckpointTrigger(60, None).auto_choice() is None
            True
        """
        if not self.auto:
            return None
        rate, rate_source = self.interruption_rate()
        rate_text = f"{rate:.3g} interruptions/h from {rate_source}"
        if not self._checkpoint_costs_s:
            return (
                f"interval='auto' is at its starting {format_seconds(self.interval_s)} until a checkpoint's "
                f"cost is measured ({rate_text})"
            )
        inputs = (
            f"from a checkpoint cost of {format_seconds(statistics.median(self._checkpoint_costs_s))} (what a "
            f"checkpoint blocks training, median of {len(self._checkpoint_costs_s)}) and {rate_text}"
        )
        chose = f"interval='auto' chose {format_seconds(self.interval_s)}"
        if self.interval_s is not None and self.interval_s <= AUTO_MIN_INTERVAL_S:
            return f"{chose}, its floor (Daly's optimum is shorter), {inputs}"
        if self.interval_s is not None and self.interval_s >= AUTO_MAX_INTERVAL_S:
            return f"{chose}, its ceiling (Daly's optimum is longer), {inputs}"
        return f"{chose} (Daly's optimum) {inputs}"

    def _retune(self) -> None:
        if not self._checkpoint_costs_s:
            return
        rate, rate_source = self.interruption_rate()
        cost = statistics.median(self._checkpoint_costs_s)
        new = AUTO_MAX_INTERVAL_S if rate <= 0 else daly_interval_s(max(cost, 1e-3), 3600.0 / rate)
        new = min(max(new, AUTO_MIN_INTERVAL_S), AUTO_MAX_INTERVAL_S)
        if self.interval_s is None or abs(new - self.interval_s) / self.interval_s > AUTO_RETUNE_THRESHOLD:
            log.info(
                "spot_callbacks: interval='auto' now checkpoints every %s (Daly: checkpoint cost %s, "
                "median of %d; %.3g interruptions/h from %s; kept within %s..%s)",
                format_seconds(new), format_seconds(cost), len(self._checkpoint_costs_s), rate, rate_source,
                format_seconds(AUTO_MIN_INTERVAL_S), format_seconds(AUTO_MAX_INTERVAL_S),
            )  # fmt: skip
            self.interval_s = new

    def state_dict(self) -> dict[str, Any]:
        return {
            "elapsed_s": self.elapsed_s,
            "interval_s": self.interval_s,
            "costs_s": list(self._checkpoint_costs_s),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a checkpoint's clock. The values come from a store, so each is checked: a
        non-finite, negative or out-of-range number is dropped (the default stays), never used."""
        elapsed_s = finite_number(state.get("elapsed_s"))
        self._last_checkpoint_at = self._clock() - (
            elapsed_s if elapsed_s is not None and elapsed_s >= 0 else 0.0
        )
        if self.auto:
            interval_s = finite_number(state.get("interval_s"))
            if interval_s is not None and AUTO_MIN_INTERVAL_S <= interval_s <= AUTO_MAX_INTERVAL_S:
                self.interval_s = interval_s
            costs = state.get("costs_s")
            if isinstance(costs, (list, tuple)):
                valid = [float(c) for c in costs[-AUTO_RECENT_COSTS:] if (finite_number(c) or -1.0) >= 0]
                self._checkpoint_costs_s = valid
