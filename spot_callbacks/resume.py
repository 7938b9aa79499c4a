"""How a resume is found and verified: the newest committed checkpoint that pulls intact, once per node.

Rank 0 picks the newest committed checkpoint and pulls it (the pull verifies every file against
the manifest); a damaged one is skipped, with one log line, for the previous valid one, never
deleted. The other nodes' local main processes then pull what rank 0 chose. Local folders newer
than that checkpoint were never committed (they may be half-written) and are moved aside, so a
framework's own "resume from the newest local folder" cannot pick one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from spot_callbacks._dist import barrier, broadcast_object
from spot_callbacks.accounting.throughput import log_slow_pull
from spot_callbacks.persist.dcp_safety import check_sharded_folder
from spot_callbacks.progress import reporting_on_a_terminal
from spot_callbacks.store import CheckpointInfo, CheckpointStore
from spot_callbacks.store.commit import DAMAGE_ERRORS, damaged_message

log = logging.getLogger("spot_callbacks")


@dataclass(frozen=True)
class ResumeInfo:
    """Where a resume came from and what it cost."""

    info: CheckpointInfo
    local_dir: Path
    pull_s: float
    pulled_at: float = 0.0  # time.perf_counter() when the pull ended: the load is timed from here


def pull_newest_valid(
    store: CheckpointStore,
    folder_for: Callable[[int], Path],
    check: Callable[[Path, CheckpointInfo], None] | None = None,
) -> CheckpointInfo | None:
    """Pull the newest checkpoint that downloads intact; a damaged one is skipped for the previous.

    ``check(folder, info)``, the framework's, raises :class:`~spot_callbacks.errors.CorruptCheckpointError`
    for a payload it cannot load (a truncated file behind a matching manifest, another kind of
    file): that is damage too. So is a sharded (DCP) folder whose pickles would construct anything
    DCP does not write (:func:`~spot_callbacks.persist.dcp_safety.check_sharded_folder`), checked
    before any framework loads it.

    Example:
        >>> import tempfile
        >>> pull_newest_valid(CheckpointStore(tempfile.mkdtemp()), lambda step: Path(tempfile.mkdtemp())) is None
        True
    """
    candidate = store.latest()
    while candidate is not None:
        try:
            pull_showing_progress(store, candidate, folder_for(candidate.step))
            check_sharded_folder(folder_for(candidate.step))
            if check is not None:
                check(folder_for(candidate.step), candidate)
            return candidate
        except DAMAGE_ERRORS as err:  # deleted since the listing included: damaged, never the user's error
            log.warning("%s", damaged_message(candidate.url, str(err) or type(err).__name__))
            older = [info for info in store.committed() if info.step < candidate.step]
            candidate = store.newest_valid(
                older, on_damaged=lambda info, why: log.warning("%s", damaged_message(info.url, why))
            )
    return None


def pull_latest(
    store: CheckpointStore,
    folder_for: Callable[[int], Path],
    rank: int,
    local_rank: int,
    check: Callable[[Path, CheckpointInfo], None] | None = None,
) -> ResumeInfo | None:
    """The newest valid checkpoint, pulled on every node into ``folder_for(step)`` (collective).

    Every rank gets the same answer (rank 0 decides); ``None`` when nothing is committed.
    """
    started = time.perf_counter()
    info = pull_newest_valid(store, folder_for, check) if rank == 0 else None
    info = broadcast_object(info)
    say = log.info if rank == 0 else log.debug  # once per run, not once per rank
    if info is None:
        say("spot_callbacks: no committed checkpoint in %s; starting from scratch", store.url)
        return None
    local_dir = folder_for(info.step)
    if local_rank == 0 and rank != 0:  # the other nodes pull what rank 0 chose
        pull_showing_progress(store, info, local_dir)
        check_sharded_folder(local_dir)  # the same bytes rank 0 checked, unless the store changed since
    barrier()
    resumed = ResumeInfo(info, local_dir, time.perf_counter() - started, pulled_at=time.perf_counter())
    if rank == 0:
        log_slow_pull(info, resumed.pull_s)  # a wait worth explaining: its size and rate
    say(
        "spot_callbacks: resuming from %s (step %d, %s) pulled in %.1fs",
        info.url, info.step, info.reason, resumed.pull_s,
    )  # fmt: skip
    return resumed


def pull_showing_progress(store: CheckpointStore, info: CheckpointInfo, folder: Path) -> Path:
    """``store.pull`` of ``info`` into ``folder``, with the bars of ``spot-callbacks pull`` while it runs
    when stderr is a terminal (a log file gets the slow-pull line, see :func:`pull_latest`)."""
    with reporting_on_a_terminal(store, info, transient=True):
        return store.pull(info.step, folder)


def move_aside_uncommitted(
    local_checkpoints: Iterable[tuple[int, Path]], committed_step: int, aside: Callable[[Path], Path]
) -> list[Path]:
    """Move each local checkpoint folder of a step past ``committed_step`` to ``aside(folder)``.

    Such a folder was never committed (it may be incomplete); once moved, no "resume from the
    newest local folder" can pick it. ``aside`` names the new place (a framework's naming); a
    place already taken gets a unique suffix. Returns the new places.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> for step in (4, 6):
        ...     (root / f"ckpt-{step}").mkdir()
        >>> moved = move_aside_uncommitted(
        ...     [(4, root / "ckpt-4"), (6, root / "ckpt-6")], 4, lambda f: f.with_name("old-" + f.name))
        >>> sorted(p.name for p in root.iterdir())
        ['ckpt-4', 'old-ckpt-6']
    """
    moved = []
    for step, folder in sorted(local_checkpoints):
        if step <= committed_step or not folder.is_dir():
            continue
        target = aside(folder)
        if target.exists():
            target = target.with_name(f"{target.name}-{time.time_ns()}")
        folder.rename(target)
        log.warning(
            "spot_callbacks: %s is newer than the newest committed checkpoint (step %d) and was never "
            "committed (it may be incomplete); moved it to %s so it cannot be resumed from",
            folder, committed_step, target,
        )  # fmt: skip
        moved.append(target)
    return moved
