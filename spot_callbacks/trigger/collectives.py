"""Rank collectives, one copy: every rank calls each of these at the same point.

Without torch.distributed (or with one process) each returns the local value, so the single
process path never needs a process group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def distributed_ready() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _collective_device() -> torch.device:
    backend = str(dist.get_backend())
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(rank0_interval_due: bool, steps_due: bool, notice_seen: bool) -> tuple[bool, bool, bool]:
    """Make one decision for all ranks: rank 0's clock, and a notice seen by *any* rank.

    One all-reduce (MAX) of three flags; without torch.distributed the local flags stand.
    """
    if not distributed_ready():
        return rank0_interval_due, steps_due, notice_seen
    interval_flag = rank0_interval_due if dist.get_rank() == 0 else False
    flags = torch.tensor(
        [interval_flag, steps_due, notice_seen], dtype=torch.int32, device=_collective_device()
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    interval, steps, notice = (bool(v) for v in flags.tolist())
    return interval, steps, notice


def gather_from_ranks(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (just this one's without torch.distributed)."""
    if not distributed_ready():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast_object(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value`` on every rank (``group``: a process group of the caller's, else the default)."""
    if not distributed_ready():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]
