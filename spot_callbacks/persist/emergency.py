"""The emergency plan: whether the upload in flight may finish before an emergency checkpoint uploads.

An upload cannot be cancelled mid-put, so "not finishing" it means uploading the emergency
checkpoint alongside it at once rather than after it. The measured upload speed decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spot_callbacks.persist.tracking import PersistRecord

# An upload that has run this many times longer than its size predicts (plus the grace) is stalled
# or throttled, and no estimate of its end holds.
STALL_FACTOR = 3.0
STALL_GRACE_S = 1.0
SPEED_RECORDS = 3  # the upload speed is measured over the newest few commits


@dataclass(frozen=True)
class EmergencyPlan:
    """What to do with the upload in flight when an emergency checkpoint arrives (see :func:`plan_emergency`).

    Example:
        >>> plan = plan_emergency(100e6, 1.0, 100e6, bytes_per_s=100e6, seconds_left=30)
        >>> plan.describe(in_flight_step=4, emergency_step=5).endswith("deadline in 30.0s: finishing step 4 first")
        True
    """

    finish_in_flight: bool
    seconds_left: float
    in_flight_elapsed_s: float
    in_flight_left_s: float | None = None  # None: no estimate (no speed measured yet, or stalled)
    emergency_s: float | None = None
    stalled: bool = False

    def describe(self, in_flight_step: int, emergency_step: int) -> str:
        if self.stalled:
            needs = (
                f"has been uploading for {self.in_flight_elapsed_s:.1f}s, far longer than its size predicts"
            )
        elif self.in_flight_left_s is None:
            needs = "needs an unknown time (no upload speed measured yet)"
        else:
            needs = (
                f"needs ~{self.in_flight_left_s:.1f}s more and the emergency checkpoint of step "
                f"{emergency_step} ~{self.emergency_s:.1f}s"
            )
        if self.finish_in_flight:
            action = f"finishing step {in_flight_step} first"
        else:
            action = (
                f"uploading step {emergency_step} now, alongside step {in_flight_step} "
                f"(which commits only if it finishes in time)"
            )
        return f"in-flight step {in_flight_step} {needs}, deadline in {self.seconds_left:.1f}s: {action}"


def plan_emergency(
    in_flight_bytes: int,
    in_flight_elapsed_s: float,
    emergency_bytes: int,
    bytes_per_s: float | None,
    seconds_left: float,
) -> EmergencyPlan:
    """Finish the upload in flight first only if it and then the emergency checkpoint both fit in time.

    Example:
        >>> plan_emergency(100e6, 1.0, 100e6, bytes_per_s=100e6, seconds_left=30).finish_in_flight
        True
        >>> plan = plan_emergency(4e9, 1.0, 4e9, bytes_per_s=100e6, seconds_left=30)
        >>> plan.finish_in_flight, round(plan.in_flight_left_s)
        (False, 39)
    """
    if not bytes_per_s or bytes_per_s <= 0:
        return EmergencyPlan(False, seconds_left, in_flight_elapsed_s)
    expected_s = in_flight_bytes / bytes_per_s
    if in_flight_elapsed_s > STALL_FACTOR * expected_s + STALL_GRACE_S:
        return EmergencyPlan(False, seconds_left, in_flight_elapsed_s, stalled=True)
    left_s = max(expected_s - in_flight_elapsed_s, 0.0)
    emergency_s = emergency_bytes / bytes_per_s
    return EmergencyPlan(
        left_s + emergency_s <= seconds_left, seconds_left, in_flight_elapsed_s, left_s, emergency_s
    )


def measured_bytes_per_s(records: Sequence[PersistRecord]) -> float | None:
    """The upload speed of the newest few commits (None before the first).

    Example:
        >>> measured_bytes_per_s([]) is None
        True
    """
    recent = records[-SPEED_RECORDS:]
    seconds = sum(record.upload_s for record in recent)
    return sum(record.bytes for record in recent) / seconds if recent and seconds > 0 else None
