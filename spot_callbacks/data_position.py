"""What a checkpoint's place in the data depends on, and the one warning when a resume changes it.

A checkpoint says "N optimizer steps, M batches into epoch E". Those counts mean the same samples
only with the same per-device batch size, number of processes, gradient accumulation and dataset:
resumed with another batch size, the epoch's remaining batches are counted in the new size
(samples are skipped or trained on twice) and a step-based learning-rate schedule continues from a
step count made of batches of the old size. Both adapters record a :class:`DataPosition` in their
checkpoint and call :func:`warn_if_changed` on resume.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from spot_callbacks._dist import rank

log = logging.getLogger("spot_callbacks")

_LABELS = {
    "batch_size": "per-device batch size",
    "world_size": "processes (world size)",
    "accumulate_grad_batches": "gradient accumulation",
    "dataset_length": "dataset length",
}


@dataclass(frozen=True)
class DataPosition:
    """The settings a position in the training data is counted in (None: not known).

    ``batch_size`` and ``dataset_length`` hold one entry per train loader.

    Example:
        >>> old = DataPosition(batch_size=(64,), world_size=1, accumulate_grad_batches=1, dataset_length=(8192,))
        >>> new = DataPosition(batch_size=(32,), world_size=1, accumulate_grad_batches=1, dataset_length=(8192,))
        >>> changed_settings(old.to_dict(), new)
        ['per-device batch size 64 -> 32']
    """

    batch_size: tuple[int | None, ...]
    world_size: int
    accumulate_grad_batches: int
    dataset_length: tuple[int | None, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()
        }


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join("unknown" if item is None else str(item) for item in value)
    return "unknown" if value is None else str(value)


def _same_where_known(old: Any, new: Any) -> bool:
    """Per-loader lists of equal length that differ only where one side is unknown."""
    if not (isinstance(old, list) and isinstance(new, list) and len(old) == len(new)):
        return False
    return all(a is None or b is None or a == b for a, b in zip(old, new, strict=True))


def changed_settings(saved: Any, now: DataPosition) -> list[str]:
    """``"<setting> <old> -> <new>"`` for each setting the checkpoint recorded that differs now.

    ``saved`` comes from a checkpoint (untrusted): anything but a dict, and settings it lacks or
    that are unknown on either side, count as unchanged.
    """
    if not isinstance(saved, dict):
        return []
    changes = []
    for key, value in now.to_dict().items():
        old = saved.get(key)
        if old is None or value is None or old == value:
            continue
        if _same_where_known(old, value):
            continue
        changes.append(f"{_LABELS[key]} {_shown(old)} -> {_shown(value)}")
    return changes


def global_batch(position: Any) -> tuple[int, ...] | None:
    """Samples per optimizer step for each train loader (per-device batch x processes x accumulation),
    or ``None`` where any factor is unknown; ``position`` is a :class:`DataPosition` or its dict.

    Example:
        >>> global_batch({"batch_size": [16], "world_size": 2, "accumulate_grad_batches": 1})
        (32,)
    """
    values = position.to_dict() if isinstance(position, DataPosition) else position
    if not isinstance(values, dict):
        return None
    sizes, world, accumulate = (
        values.get("batch_size"),
        values.get("world_size"),
        values.get("accumulate_grad_batches"),
    )
    if (
        not isinstance(sizes, (list, tuple))
        or not sizes
        or not isinstance(world, int)
        or not isinstance(accumulate, int)
    ):
        return None
    if not all(isinstance(size, int) for size in sizes):
        return None
    return tuple(size * world * accumulate for size in sizes)


def same_samples_per_step(saved: Any, now: DataPosition) -> bool:
    """True when a resume changed only how each step's samples are split (per-device batch, processes,
    accumulation) and not how many there are, nor the dataset: the position and the schedule still hold.

    Example:
        >>> old = {"batch_size": [16], "world_size": 2, "accumulate_grad_batches": 1, "dataset_length": [512]}
        >>> same_samples_per_step(old, DataPosition((32,), 1, 1, (512,)))
        True
    """
    old_batch = global_batch(saved)
    if old_batch is None or old_batch != global_batch(now) or not isinstance(saved, dict):
        return False
    old_length = saved.get("dataset_length")
    return (
        old_length is None
        or now.dataset_length is None
        or _same_where_known(old_length, list(now.dataset_length))
    )


def warn_if_changed(saved: Any, now: DataPosition, where: str) -> bool:
    """Log one warning naming every changed setting and what it means for this resume; True if any.

    ``where`` describes the position resumed at (e.g. ``"step 120, 40 batches into epoch 1"``).
    """
    changes = changed_settings(saved, now)
    if rank() != 0:  # every rank resumes with the same settings: one says it for all
        return bool(changes)
    if changes and same_samples_per_step(saved, now):
        # FSDP on 2 processes resumed on 1 with twice the batch: every step still sees as many
        # samples, so no sample is skipped or repeated; only which rank sees which one changes.
        log.warning(
            "spot_callbacks: resuming at %s with the same %s samples per optimizer step, split differently: "
            "%s. The position and a step-based learning-rate schedule hold; only which process sees which "
            "sample changes, so the run is not bit-identical to an uninterrupted one",
            where, "/".join(map(str, global_batch(now) or ())), "; ".join(changes),
        )  # fmt: skip
    elif changes:
        log.warning(
            "spot_callbacks: resuming at %s with other data settings than the checkpoint was written with: "
            "%s. The position counts batches of the old settings, so this resume is not exact: the rest "
            "of this epoch is counted in the new ones (samples are skipped or trained on twice), epochs "
            "have another number of steps, and a step-based learning-rate schedule continues from the "
            "old step count. Resume with the old values for an exact continuation, or start a new dirpath",
            where, "; ".join(changes),
        )  # fmt: skip
    return bool(changes)
