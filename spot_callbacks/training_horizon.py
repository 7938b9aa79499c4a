"""How far a run was set to train, and the one warning when a resume sets it otherwise.

Resuming a finished run with a larger ``max_steps`` (or more epochs) trains on from its last
checkpoint: the way to extend a run. Both adapters record the limits a checkpoint was written
under (:class:`Horizon`) and, before the first step of a resume under other limits, log one line
naming each old and new value and what follows:

- the limit: training goes on to the new one, or stops at once when the checkpoint is past it;
- the learning-rate schedule, whose length was fixed by the old limits. Lightning loads a
  scheduler's whole ``state_dict``, so ``OneCycleLR.total_steps``, ``CosineAnnealingLR.T_max``,
  ``LinearLR.total_iters`` keep the checkpoint's values (:func:`restored_scheduler_changes`): the
  schedule ends where the old run's did. The HF Trainer rebuilds its schedule for the new horizon
  and keeps only the step count, so the learning rate jumps to the new schedule's value at that
  step (:func:`learning_rate_change`).

An old checkpoint without a recorded horizon resumes as before, without the limits' part.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spot_callbacks._dist import rank

log = logging.getLogger("spot_callbacks")

# The state_dict keys that fix a torch scheduler's length: OneCycleLR; CosineAnnealingLR; LinearLR,
# ConstantLR and PolynomialLR.
SCHEDULER_LENGTH_KEYS = ("total_steps", "T_max", "total_iters")


def _limit(value: Any) -> int | float | None:
    """A limit read from a checkpoint: a positive number, else ``None`` (no limit, or not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value if value > 0 else None


@dataclass(frozen=True)
class Horizon:
    """The limits of a run: ``max_steps`` and ``max_epochs`` (``None``: no limit).

    Example:
        >>> Horizon.from_dict({"max_steps": 6, "max_epochs": -1})
        Horizon(max_steps=6, max_epochs=None)
        >>> limit_changes(Horizon(6, None), Horizon(10, None), step=6, epochs_done=0)
        ['max_steps 6 -> 10 (training goes on to step 10)']
    """

    max_steps: int | float | None
    max_epochs: int | float | None

    @classmethod
    def of(cls, max_steps: Any, max_epochs: Any) -> Horizon:
        """The horizon of a trainer's settings (``-1``, ``0`` or ``None`` mean no limit)."""
        return cls(_limit(max_steps), _limit(max_epochs))

    @classmethod
    def from_dict(cls, saved: Any) -> Horizon | None:
        """The horizon a checkpoint recorded, or ``None`` (an older checkpoint, or not a mapping)."""
        if not isinstance(saved, dict):
            return None
        return cls.of(saved.get("max_steps"), saved.get("max_epochs"))

    def to_dict(self) -> dict[str, Any]:
        return {"max_steps": self.max_steps, "max_epochs": self.max_epochs}


def _shown(limit: int | float | None) -> str:
    return "none" if limit is None else f"{limit:g}"


def limit_changes(
    saved: Horizon | None, now: Horizon, step: int, epochs_done: float, epochs_name: str = "max_epochs"
) -> list[str]:
    """One phrase per limit that differs from the checkpoint's, with what it means at ``step``."""
    if saved is None:
        return []
    changes = []
    if saved.max_steps != now.max_steps:
        if now.max_steps is None:
            what = "no step limit now"
        elif now.max_steps > step:
            what = f"training goes on to step {now.max_steps:g}"
        else:
            what = f"the checkpoint is at step {step} already: training stops at once"
        changes.append(f"max_steps {_shown(saved.max_steps)} -> {_shown(now.max_steps)} ({what})")
    if saved.max_epochs != now.max_epochs:
        if now.max_epochs is None:
            what = "no epoch limit now"
        elif now.max_epochs > epochs_done:
            what = f"training goes on until {now.max_epochs:g} epochs are done"
        else:
            what = f"{epochs_done:g} epochs are done already: training stops at once"
        changes.append(f"{epochs_name} {_shown(saved.max_epochs)} -> {_shown(now.max_epochs)} ({what})")
    return changes


def scheduler_lengths(state: Any) -> dict[str, Any]:
    """The length-fixing entries of a scheduler's ``state_dict`` (see :data:`SCHEDULER_LENGTH_KEYS`)."""
    if not isinstance(state, dict):
        return {}
    return {key: state[key] for key in SCHEDULER_LENGTH_KEYS if key in state}


def restored_scheduler_changes(schedulers: Sequence[tuple[str, Any, Any]]) -> list[str]:
    """For schedulers whose whole state a resume loads (Lightning): one phrase per length the new
    configuration sets otherwise than the checkpoint, whose value wins.

    ``schedulers``: (class name, the state as configured now, the checkpoint's state) per scheduler.

    Example:
        >>> [change] = restored_scheduler_changes([("OneCycleLR", {"total_steps": 10}, {"total_steps": 6})])
        >>> print(change)
        OneCycleLR total_steps 6 -> 10 (the checkpoint's 6 is restored over it, so the schedule ends at step 6 as before, and OneCycleLR raises when stepped past it)
    """
    changes = []
    for name, configured, saved in schedulers:
        old, new = scheduler_lengths(saved), scheduler_lengths(configured)
        for key in old.keys() & new.keys():
            if old[key] == new[key]:
                continue
            what = f"the checkpoint's {old[key]} is restored over it, so the schedule ends at step {old[key]} as before"
            if key == "total_steps":
                what += f", and {name} raises when stepped past it"
            changes.append(f"{name} {key} {old[key]} -> {new[key]} ({what})")
    return changes


def learning_rate_change(name: str, old_lrs: Any, new_lrs: Sequence[float], step: int) -> list[str]:
    """For a schedule rebuilt over the new horizon (HF): the jump from the checkpoint's learning
    rate to the new schedule's at ``step``, or nothing when they agree.

    Example:
        >>> learning_rate_change("LambdaLR", [0.004], [0.0045], step=6)
        ['learning rate 0.004 -> 0.0045 at step 6 (LambdaLR is rebuilt for the new horizon: it follows the new schedule from here)']
    """
    if not isinstance(old_lrs, (list, tuple)) or len(old_lrs) != len(new_lrs):
        return []
    if not all(isinstance(lr, (int, float)) for lr in old_lrs):
        return []
    if all(
        math.isclose(old, new, rel_tol=1e-6, abs_tol=1e-12) for old, new in zip(old_lrs, new_lrs, strict=True)
    ):
        return []
    # One value when every parameter group has it (HF's decay and no-decay groups).
    shown = [
        ", ".join(f"{lr:.3g}" for lr in (lrs[:1] if len(set(lrs)) == 1 else lrs))
        for lrs in (old_lrs, new_lrs)
    ]
    return [
        f"learning rate {shown[0]} -> {shown[1]} at step {step} ({name} is rebuilt for the new horizon: "
        "it follows the new schedule from here)"
    ]


def warn_if_horizon_changed(step: int, changes: Sequence[str]) -> bool:
    """Log one warning (rank 0) naming every change to the training horizon; True if any."""
    if changes and rank() == 0:
        log.warning(
            "spot_callbacks: resuming at step %d with another training horizon than the checkpoint was "
            "written with: %s",
            step, "; ".join(changes),
        )  # fmt: skip
    return bool(changes)
