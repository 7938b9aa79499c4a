"""Rank collectives, one copy: every rank calls each of these at the same point.

Without torch.distributed (or with one process) each returns the local value, so the single
process path never needs a process group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import spot_callbacks.settings as settings


def distributed_ready() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _collective_device() -> torch.device:
    backend = str(dist.get_backend())
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(
    rank0_interval_due: bool, steps_due: bool, notice_seen: bool, rank0_lease_lost: bool = False
) -> tuple[bool, bool, bool, bool]:
    """Make one decision for all ranks: rank 0's clock and lease, and a notice seen by *any* rank.

    One all-reduce (MAX) of four flags; without torch.distributed the local flags stand.
    """
    if not distributed_ready():
        return rank0_interval_due, steps_due, notice_seen, rank0_lease_lost
    on_rank0 = dist.get_rank() == 0
    flags = torch.tensor(
        [rank0_interval_due and on_rank0, steps_due, notice_seen, rank0_lease_lost and on_rank0],
        dtype=torch.int32,
        device=_collective_device(),
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    interval, steps, notice, lease_lost = (bool(v) for v in flags.tolist())
    return interval, steps, notice, lease_lost


def gather_from_ranks(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (just this one's without torch.distributed)."""
    if not distributed_ready():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


class _Array:
    """A CPU tensor on its way through :func:`gather_states_from_ranks`: its bytes as a NumPy array."""

    def __init__(self, array: Any) -> None:
        self.array = array


def _to_arrays(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and type(value) is torch.Tensor:
        return _Array(value.numpy())
    if type(value) is dict:
        return {key: _to_arrays(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_to_arrays(item) for item in value)
    return value


def _to_tensors(value: Any) -> Any:
    if isinstance(value, _Array):
        return torch.from_numpy(value.array)
    if type(value) is dict:
        return {key: _to_tensors(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_to_tensors(item) for item in value)
    return value


def gather_states_from_ranks(value: Any) -> list[Any]:
    """:func:`gather_from_ranks` of a value whose tensors are small CPU tensors (RNG states).

    Their bytes travel as NumPy arrays inside one pickle: ``all_gather_object`` pickles a tensor
    through ``torch.save`` and unpickles it through ``torch.load``, per tensor and per rank, which
    made the RNG gather the largest fixed cost of a Lightning FSDP checkpoint after the copy. The
    tensors come back with the same dtype, shape and values.

    Example:
        >>> gathered = gather_states_from_ranks({"torch": torch.get_rng_state()})
        >>> torch.equal(gathered[0]["torch"], torch.get_rng_state())
        True
    """
    if not distributed_ready():
        return [value]
    return [_to_tensors(item) for item in gather_from_ranks(_to_arrays(value))]


def gather_states_to_first(value: Any, group: Any) -> list[Any] | None:
    """:func:`gather_states_from_ranks` on ``group`` (a process group of its own), onto its rank 0
    only: every rank's ``value`` in rank order there, ``None`` on the others."""
    first = dist.get_rank(group) == 0
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if first else None
    dist.gather_object(_to_arrays(value), gathered, dst=dist.get_global_rank(group, 0), group=group)
    return None if gathered is None else [_to_tensors(item) for item in gathered]


def agree_on_alerts(notice: Any, hint: str | None) -> tuple[Any, str | None]:
    """Every rank's notice and hint -> the same answer on all: the notice with the earliest deadline.

    A notice outranks a hint; without a notice anywhere, the first rank's hint stands.
    """
    if not distributed_ready():
        return notice, hint
    gathered = gather_from_ranks((notice, hint))
    notices = [n for n, _ in gathered if n is not None]
    hints = [h for _, h in gathered if h is not None]
    if not notices:
        return None, hints[0] if hints else None
    with_deadline = [n for n in notices if n.deadline is not None]
    chosen = min(with_deadline, key=lambda n: n.deadline) if with_deadline else notices[0]
    return chosen, None


def agree_at_step(
    interval_due: bool, steps_due: bool, notice: Any, hint: str | None, lease_lost: bool = False
) -> tuple[bool, bool, Any, str | None, bool]:
    """Every rank's view of a step boundary -> one for all: rank 0's clock and lease, any rank's
    steps, and the notice (earliest deadline) or hint any rank saw. One all-reduce; a gather only
    when alerted."""
    # One flag for both: the rare step that has either pays for one gather to tell them apart.
    interval, steps, alerted, lease_lost = agree(
        interval_due, steps_due, notice is not None or hint is not None, lease_lost
    )
    if not alerted:
        return interval, steps, None, None, lease_lost
    notice, hint = agree_on_alerts(notice, hint)
    return interval, steps, notice, hint, lease_lost


def barrier() -> None:
    if distributed_ready():
        dist.barrier()


def rank() -> int:
    return dist.get_rank() if distributed_ready() else 0


def is_writer() -> bool:
    """Rank 0: it writes single-file checkpoints and manifests, and decides for all."""
    return rank() == 0


def local_rank() -> int:
    return int(settings.environment_variable("LOCAL_RANK") or 0) if distributed_ready() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed_ready() else 1


def broadcast_object(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value`` on every rank (``group``: a process group of the caller's, else the default)."""
    if not distributed_ready():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]
