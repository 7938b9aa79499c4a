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
from spot_callbacks.progress import showing_progress
from spot_callbacks.store import CheckpointInfo, CheckpointStore
from spot_callbacks.store.checkpoint_store import RunListing, WalkReads, pull_checkpoint, walk_down
from spot_callbacks.store.commit import DAMAGE_ERRORS, lineage_of
from spot_callbacks.store.layout import holds_dcp_index
from spot_callbacks.store.meter import TransferMeter

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
    own: str | None = None,
    taken: RunListing | None = None,
) -> CheckpointInfo | None:
    """Pull the newest checkpoint that downloads intact; a damaged one is skipped for the previous.

    ``own``: the lineage of a run that resumes again while it runs (it committed or resumed): its
    checkpoints come first, whatever another lineage wrote since (``commit.current_lineage``).
    ``taken``: the run folder's listings taken just before (the preflight's probe), not taken again.

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
    # One listing, manifests read a batch at a time from the top, each candidate judged once:
    # linear in the damaged checkpoints skipped, bounded by them whatever the store holds. What the
    # walk read (the listing's sizes, the manifest's bytes) serves the damage check and the pull.
    reads = WalkReads()

    def problem_of(candidate: CheckpointInfo) -> str | None:
        problem = store.damage(candidate, reads.sizes_of(store, candidate))
        if problem is None:
            try:
                pull_showing_progress(
                    store, candidate, folder_for(candidate.step), reads.manifests.get(candidate.step)
                )
                check_sharded_folder(folder_for(candidate.step))
                if check is not None:
                    check(folder_for(candidate.step), candidate)
            except DAMAGE_ERRORS as err:  # deleted since listed, or unloadable: damage, not the user's error
                problem = str(err) or type(err).__name__
        return problem

    found, seen = walk_down(store, problem_of, own, taken, reads)
    if found is not None:
        say_lineage(store, found, seen)
    return found


def say_lineage(store: CheckpointStore, resumed: CheckpointInfo, seen: list[CheckpointInfo]) -> None:
    """A resume below the highest committed step ``seen`` says why, and what ``latest`` follows."""
    above = [info for info in seen if info.step > resumed.step]
    if not above:
        return
    lineage = lineage_of(resumed)
    foreign = sorted(info.step for info in above if lineage_of(info) != lineage)
    own = sorted(info.step for info in above if lineage_of(info) == lineage)
    parts = []
    if own:
        parts.append(
            f"its lineage's steps {_steps(own)} were skipped as damaged; this run's checkpoints replace "
            "them as it reaches them"
        )
    if foreign:
        parts.append(
            f"steps {_steps(foreign)} belong to another lineage (another run's): kept, never resumed"
        )
    log.warning(
        "spot_callbacks: resuming %s from step %d, below step %d, the highest committed: %s; `latest` "
        "follows the lineage of the newest commit (the manifest the store wrote last), this run's (%s) from its "
        "first checkpoint on",
        store.url, resumed.step, max(info.step for info in above), "; ".join(parts), _lineage_name(lineage),
    )  # fmt: skip


def say_new_lineage(store: CheckpointStore, step: int) -> None:
    """A run that starts afresh in a ``dirpath`` holding higher steps says so (one listing), once."""
    top = max(store.step_folders(), default=None)
    if top is None or top <= step:
        return
    log.warning(
        "spot_callbacks: %s holds checkpoints up to step %d and this run started afresh (step %d): it "
        "starts a new lineage. From its first commit on, `latest` follows this run's checkpoints and "
        "retention prunes only them; the other lineage's are kept (spot-callbacks rm deletes them). "
        "To continue the stored run instead, resume it (fit(ckpt_path=\"latest\") or "
        "train(resume_from_checkpoint=ckpt.latest()))",
        store.url, top, step,
    )  # fmt: skip


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:5])) + (f" and {len(steps) - 5} more" if len(steps) > 5 else "")


def _lineage_name(lineage: str | None) -> str:
    return f"lineage {lineage[:8]}" if lineage is not None else "the unnamed lineage of earlier versions"


def pull_latest(
    store: CheckpointStore,
    folder_for: Callable[[int], Path],
    rank: int,
    local_rank: int,
    check: Callable[[Path, CheckpointInfo], None] | None = None,
    own: str | None = None,
    taken: RunListing | None = None,
) -> ResumeInfo | None:
    """The newest valid checkpoint, pulled on every node into ``folder_for(step)`` (collective).

    Every rank gets the same answer (rank 0 decides); ``None`` when nothing is committed. ``own``,
    ``taken`` (rank 0's): see :func:`pull_newest_valid`.
    """
    started = time.perf_counter()
    if local_rank == 0:
        store.warm_data_plane()  # while the manifests are read
    info = pull_newest_valid(store, folder_for, check, own, taken) if rank == 0 else None
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


def check_sharded_folder(folder: Path) -> None:
    """:func:`spot_callbacks.persist.dcp_safety.check_sharded_folder` of a pulled checkpoint; DCP's modules
    are imported only for a folder that holds a DCP index (a plain checkpoint's resume does without them,
    and the check finds nothing to read there either)."""
    if holds_dcp_index(folder):
        from spot_callbacks.persist.dcp_safety import check_sharded_folder as check_dcp_pickles

        check_dcp_pickles(folder)


def pull_showing_progress(
    store: CheckpointStore, info: CheckpointInfo, folder: Path, manifest: bytes | None = None
) -> Path:
    """``store.pull`` of ``info`` into ``folder``, showing its progress: the bars of ``spot-callbacks pull``
    when stderr is a terminal, else a log line every ``$SPOT_PROGRESS_EVERY_S`` (and the slow-pull
    line at the end, see :func:`pull_latest`).

    ``info`` is not read again to start (another node pulls what rank 0 read, and the store's manifest,
    read after the files, must still be it); ``manifest``: the bytes it was parsed from in this resume,
    written as the pulled manifest rather than read a third time (``checkpoint_store.pull_checkpoint``).
    """
    meter = TransferMeter("pull")
    with showing_progress(meter, f"pulling {info.url}", to_log=True, transient=True):
        return pull_checkpoint(store, info, folder, meter=meter, manifest=manifest)


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
