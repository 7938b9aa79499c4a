"""The commit protocol, in one place: what makes a checkpoint committed, and what retention may delete.

The rules:

1. A checkpoint is the folder ``<dirpath>/step-<09d>/``. It is **committed** iff its
   ``manifest.json`` exists and parses. A single-object PUT is atomic on S3, GCS and Azure, and
   rename is not, so the manifest is the commit; nothing relies on rename.
2. It is **valid** when, besides, every file it lists exists with the listed size
   (:func:`size_problem`, checked by ``CheckpointStore.damage``) and every file its
   framework needs. ``latest()``, what a resume uses, is the newest valid one **of the current
   lineage** (:func:`resume_order`: the lineage of the newest commit, the manifest the store wrote
   last by its own clock, :func:`commit_order`; another lineage's only when none of it is valid),
   and ``verify()`` also compares every checksum. A checkpoint that fails is
   skipped with a warning, never deleted.
3. **Writing** step N (``CommitWriter.write_checkpoint``): clear a stale folder of step N
   (``begin``: its manifest first, so a mix of old and new payload is never committed), upload
   the payload (``upload``), and write the manifest **last** (``commit_files``), once every
   payload file is durable; a manifest write whose answer was lost is read back (:func:`landed`).
4. **Deleting** a checkpoint (``delete``) retires its manifest first (it stops counting at once),
   then its payload.
5. **Retention** (``prune``, deciding with :func:`retention_victims`) keeps the newest
   ``keep_last`` *valid* checkpoints of the committing run's lineage (:func:`lineage_of`), runs
   only after a newer checkpoint committed (``CommitWriter.settle``, :func:`retention_follows`), never
   during an emergency save, never deletes the checkpoint the run resumed from, a damaged one,
   another lineage's, or one it did not see committed.

The steps that do I/O are methods of :class:`~spot_callbacks.store.CheckpointStore` (reading,
deleting, retention) and of :class:`~spot_callbacks.store.CommitWriter` (writing), named in
each rule; this module holds the rules and the pure decisions they take (what a manifest or a
listing means, what retention may delete) and never calls back into the store.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from spot_callbacks.errors import CorruptCheckpointError, ManifestError
from spot_callbacks.store.layout import DCP_METADATA_FILE, HF_TRAINER_STATE_FILE, STATE_FILE
from spot_callbacks.store.manifest import CheckpointInfo, parse_manifest
from spot_callbacks.store.manifest_limits import ManifestLimits

log = logging.getLogger("spot_callbacks")


# Failures that make one checkpoint damaged (skip it, fall back, never delete), as opposed to the
# store being unreachable or refusing access, which say nothing about the checkpoint and propagate.
DAMAGE_ERRORS: tuple[type[BaseException], ...] = (ManifestError, CorruptCheckpointError, FileNotFoundError)


@dataclass(frozen=True)
class Verdict:
    """What one step folder holding a manifest is: ``info`` (``None``: the manifest cannot be
    trusted) and ``problem`` (``None``: valid), the one verdict a resume and the CLI both show."""

    step: int
    url: str
    info: CheckpointInfo | None
    problem: str | None


# ----------------------------------------------------------------- 1, 2: what is committed
def manifest_verdict(
    step: int, url: str, raw: bytes | FileNotFoundError | None, limits: ManifestLimits
) -> Verdict | None:
    """What the manifest bytes ``raw`` of step folder ``url`` make it (``None``: no manifest, not committed).

    Example:
        >>> manifest_verdict(3, "memory://run/step-000000003", None, ManifestLimits()) is None
        True
        >>> manifest_verdict(3, "memory://run/step-000000003", b"{", ManifestLimits()).problem[:27]
        'memory://run/step-000000003'
    """
    if not isinstance(raw, bytes):
        return None  # an upload in progress or abandoned
    try:
        info = parse_manifest(raw, step, url, limits)
    except ManifestError as err:
        return Verdict(step, url, None, str(err))
    return Verdict(step, info.url, info, None)


def size_problem(info: CheckpointInfo, sizes: Mapping[str, int | None]) -> str | None:
    """Why the files found (``sizes`` by name) do not make ``info`` valid, or ``None``: rule 2.

    Example:
        >>> from datetime import datetime, timezone
        >>> from spot_callbacks.store.checksums import FileDigest
        >>> info = CheckpointInfo(1, "memory://run/step-000000001", datetime.now(timezone.utc), "end", 10, "demo",
        ...                       files={"weights.bin": FileDigest(10, "xxh3_64:ab")})
        >>> size_problem(info, {"weights.bin": 4})
        'memory://run/step-000000001/weights.bin is 4 bytes but the manifest says 10 (truncated or replaced)'
    """
    if (problem := payload_problem(info)) is not None:
        return problem
    for name, digest in info.files.items():
        if name not in sizes:
            return f"{info.url}/{name} is missing"
        if sizes[name] != digest.size:
            return f"{info.url}/{name} is {sizes[name]} bytes but the manifest says {digest.size} (truncated or replaced)"
    return None


# What a resume of each framework cannot do without: one of these names in the manifest's files.
REQUIRED_PAYLOAD: dict[str, tuple[str, ...]] = {
    "lightning": (STATE_FILE, DCP_METADATA_FILE),  # a state file, or a sharded (DCP) checkpoint
    "hf": (HF_TRAINER_STATE_FILE,),
}


def payload_problem(info: CheckpointInfo) -> str | None:
    """Why the manifest ``info`` lists no payload its framework can resume from, or ``None``: a
    manifest with ``files: {}`` (or a Lightning one without its state file) is damaged everywhere.

    Example:
        >>> from datetime import datetime, timezone
        >>> info = CheckpointInfo(1, "memory://run/step-000000001", datetime.now(timezone.utc), "end", 0, "lightning")
        >>> payload_problem(info)
        'memory://run/step-000000001/manifest.json lists no payload files'
    """
    where = f"{info.url}/manifest.json"
    if not info.files:
        return f"{where} lists no payload files"
    needed = REQUIRED_PAYLOAD.get(info.framework)
    if needed and not any(name in info.files for name in needed):
        return f"{where} lists no {' or '.join(needed)}, which a {info.framework} resume needs"
    return None


def check_size_problem(info: CheckpointInfo, sizes: Mapping[str, int | None]) -> None:
    """Raise :class:`CorruptCheckpointError` for :func:`size_problem`."""
    problem = size_problem(info, sizes)
    if problem is not None:
        raise CorruptCheckpointError(problem)


def damaged_message(url: str, problem: str) -> str:
    """The one line said about a damaged checkpoint, wherever it is found."""
    return f"spot_callbacks: skipping damaged checkpoint {url}: {problem}; trying the previous one"


# ----------------------------------------------------------------- 3: writing
def landed(found: bytes | None, written: bytes) -> bool:
    """A manifest write that failed (or whose answer was lost) landed when the store holds exactly it."""
    return found == written


# ----------------------------------------------------------------- 2, 5: lineages
def lineage_of(info: CheckpointInfo) -> str | None:
    """The lineage a checkpoint continues (``extra["lineage"]["id"]``): a fresh run starts one, a
    resume continues its checkpoint's; ``None`` for manifests written before lineages were recorded
    (they form one lineage together, as every run's checkpoints did then)."""
    lineage = info.extra.get("lineage")
    lineage_id = lineage.get("id") if isinstance(lineage, dict) else None
    return lineage_id if isinstance(lineage_id, str) else None


def resumed_from(info: CheckpointInfo) -> int | None:
    """The step the run that wrote ``info`` resumed from (``None``: it started fresh, or it is not said)."""
    lineage = info.extra.get("lineage")
    step = lineage.get("resumed_from") if isinstance(lineage, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


# A manifest dated further than this past this host's clock was written by a host whose clock is off
# (or forged): it is suspect, and never makes its lineage the current one while another is at hand.
FUTURE_SLACK_S = 15 * 60.0
_said_future: set[str] = set()

# Where each backend's listing entry says when the store wrote the object: S3 ``LastModified``, Azure
# ``last_modified``, the local disk and others ``mtime``, GCS ``updated``, the memory store ``created``.
STORED_TIME_KEYS = ("LastModified", "last_modified", "mtime", "updated", "created")


def stored_time(entry: Mapping[str, Any]) -> float | None:
    """When the store says it wrote the object of the listing ``entry`` (epoch seconds), or ``None``
    where the backend does not say: a time the store's clock put there, not a writer's.

    Example:
        >>> from datetime import datetime, timezone
        >>> stored_time({"name": "run/step-000000006/manifest.json", "LastModified": datetime(2026, 1, 1, tzinfo=timezone.utc)})
        1767225600.0
        >>> stored_time({"updated": "2026-01-01T00:00:00.000Z"}), stored_time({"size": 3})
        (1767225600.0, None)
    """
    for key in STORED_TIME_KEYS:
        value = entry.get(key)
        if isinstance(value, str):
            try:
                value = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
        if isinstance(value, datetime):
            return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


def is_future_dated(info: CheckpointInfo, now: float | None = None) -> bool:
    """``info``'s manifest says it was committed more than :data:`FUTURE_SLACK_S` from now.

    Example:
        >>> info = CheckpointInfo(1, "memory://run/1", datetime(2100, 1, 1, tzinfo=timezone.utc), "end", 1, "demo")
        >>> is_future_dated(info)
        True
    """
    return info.created.timestamp() > (time.time() if now is None else now) + FUTURE_SLACK_S


def commit_order(stored_at: Mapping[int, float]) -> Callable[[CheckpointInfo], tuple[float, datetime, int]]:
    """The key that orders commits, newest last: when the **store** wrote each manifest
    (``stored_at``, by step, from the listing: the store's clock), else, where the store gives no
    time, the manifest's own ``created`` (its writer's clock); within one stamp of the store (S3
    and Azure stamp whole seconds), ``created``, then the step.

    Example:
        >>> def ckpt(step, year):
        ...     return CheckpointInfo(step, f"memory://run/{step}", datetime(year, 1, 1, tzinfo=timezone.utc), "end", 1, "demo")
        >>> key = commit_order({6: 2.0e9, 50: 1.9e9})  # step 6 stored after step 50, whatever their created says
        >>> [info.step for info in sorted([ckpt(6, 2026), ckpt(50, 2027)], key=key)]
        [50, 6]
    """

    def key(info: CheckpointInfo) -> tuple[float, datetime, int]:
        stored = stored_at.get(info.step)
        return (info.created.timestamp() if stored is None else stored, info.created, info.step)

    return key


def current_lineage(
    infos: list[CheckpointInfo], stored_at: Mapping[int, float] | None = None, own: str | None = None
) -> str | None:
    """The lineage of the newest commit (:func:`commit_order`: when the store wrote its manifest,
    ``stored_at`` by step; ``created`` only where the store gives no time): the one ``latest()``
    follows and retention prunes. ``None`` also when ``infos`` is empty.

    A host whose clock runs ahead cannot move the resume point: the store stamps its manifests when
    they land, by its own clock. A manifest dated in the future (:func:`is_future_dated`: a skewed
    clock, or forged) does not count as the newest commit while one dated sanely is at hand; it is
    logged once. ``own``: the lineage of the run asking, while it runs (it committed or resumed):
    followed while it has a checkpoint among ``infos``, whatever another lineage wrote since.

    Example:
        >>> def ckpt(step, year, lineage):
        ...     return CheckpointInfo(step, f"memory://run/{step}", datetime(year, 1, 1, tzinfo=timezone.utc),
        ...                           "interval", 1, "demo", extra={"lineage": {"id": lineage}})
        >>> current_lineage([ckpt(10, 2026, "ours"), ckpt(99, 2999, "forged")])
        'ours'
        >>> # the old run's host dated its step 50 later than the fresh run's step 6; the store wrote 6 last:
        >>> current_lineage([ckpt(6, 2026, "fresh"), ckpt(50, 2027, "old")], {6: 1.9e9, 50: 1.8e9})
        'fresh'
    """
    if not infos:
        return None
    if own is not None and any(lineage_of(info) == own for info in infos):
        return own
    now = time.time()
    sane = [info for info in infos if not is_future_dated(info, now)]
    for info in infos:
        if info not in sane and info.url not in _said_future:
            _said_future.add(info.url)
            log.warning(
                "spot_callbacks: %s says it was committed at %s, in the future by this host's clock: its "
                "writer's clock is off (or the manifest is not a run's); it does not decide which run's "
                "checkpoints a resume follows", info.url, info.created.isoformat(),
            )  # fmt: skip
    return lineage_of(max(sane or infos, key=commit_order(stored_at or {})))


def resume_order(
    infos: list[CheckpointInfo], stored_at: Mapping[int, float] | None = None, own: str | None = None
) -> list[CheckpointInfo]:
    """``infos`` (oldest first) reordered so the current lineage (:func:`current_lineage`, with the
    store's times ``stored_at`` and the asking run's ``own``) comes last, by step: walking it from
    the end, as ``newest_valid`` does, tries the current lineage from its highest step down, then
    the other lineages' (highest first) only when none of it is valid.

    A fresh run on an old dirpath (another lineage up to step 50) resumes its own step 12 after a
    preemption, not step 50.

    Example:
        >>> from datetime import timedelta
        >>> t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
        >>> def ckpt(step, minute, lineage):
        ...     return CheckpointInfo(step, f"memory://run/{step}", t0 + timedelta(minutes=minute), "interval", 1,
        ...                           "demo", extra={"lineage": {"id": lineage}})
        >>> old = [ckpt(30, 0, "a"), ckpt(50, 1, "a")]
        >>> [info.step for info in resume_order([ckpt(5, 9, "b"), *old, ckpt(10, 10, "b")])]
        [30, 50, 5, 10]
        >>> # "a"'s host clock ran 20 minutes ahead; the store wrote "b"'s step 10 last:
        >>> stored = {30: 1000.0, 50: 1060.0, 5: 1100.0, 10: 1160.0}
        >>> [info.step for info in resume_order([ckpt(5, 9, "b"), ckpt(30, 20, "a"), ckpt(50, 21, "a"), ckpt(10, 10, "b")], stored)]
        [30, 50, 5, 10]
    """
    lineage = current_lineage(infos, stored_at, own)
    others = sorted((info for info in infos if lineage_of(info) != lineage), key=lambda info: info.step)
    return [*others, *(info for info in infos if lineage_of(info) == lineage)]


def retention_victims(
    seen: list[CheckpointInfo],
    keep_last: int,
    damaged: Callable[[CheckpointInfo], bool],
    lineage: str | None,
    protected: Iterable[int] = (),
    vouched: Iterable[int] | None = None,
) -> list[CheckpointInfo]:
    """What retention may delete of the committed checkpoints ``seen`` (oldest first), oldest first.

    Rule 5 by lineage: only checkpoints of ``lineage`` (the committing run's) are candidates;
    walking it down from its highest step, the first ``keep_last`` *valid* ones are kept (one
    ``damaged`` is neither counted nor deleted: a damaged or foreign higher step never costs the
    lineage a good checkpoint), every older one goes, except the ``protected`` steps (the
    checkpoint the run resumed from, the one just committed). Another lineage's checkpoints are
    never deleted by a run (``spot-callbacks rm`` does that). ``damaged`` is asked only until
    ``keep_last`` valid ones are found; ``keep_last=0`` keeps all.

    ``vouched`` (a run's retention: the steps it committed, and the one it resumed from): only those
    count toward ``keep_last``. A checkpoint of the lineage that the run did not write is neither
    counted nor deleted while it is above the oldest vouched step (a manifest put there by someone
    else must not push the run's own out), logged once; below it, it is the history that led to the
    resume point and goes like any older one.

    Example:
        >>> from datetime import datetime, timezone
        >>> infos = [CheckpointInfo(s, f"memory://run/{s}", datetime.now(timezone.utc), "end", 1, "demo") for s in (15, 16, 17, 18, 20)]
        >>> # keep_last=1, step 20 committed but unloadable, the run resumed from 15 and reached 18:
        >>> [i.step for i in retention_victims(infos, 1, lambda i: i.step == 20, None, protected=[15, 18])]
        [16, 17]
        >>> # the run resumed from 15 and committed 17 and 18; 16 and 20 appeared, written by no one it knows:
        >>> [i.step for i in retention_victims(infos, 2, lambda i: False, None, protected=[15, 18],
        ...                                    vouched=[15, 17, 18])]
        []
    """
    if keep_last < 0:
        raise ValueError(f"keep_last={keep_last!r} must be >= 0")
    if keep_last == 0:
        return []
    keep = set(protected)
    own = None if vouched is None else set(vouched)
    oldest_own = min(own) if own else None
    valid_kept = 0
    victims = []
    for info in reversed([info for info in seen if lineage_of(info) == lineage]):
        if own is not None and info.step not in own and (oldest_own is None or info.step > oldest_own):
            _say_unvouched(info)
        elif valid_kept < keep_last:
            valid_kept += not damaged(info)
        elif info.step not in keep:
            victims.append(info)
    return victims[::-1]


_said_unvouched: set[str] = set()


def _say_unvouched(info: CheckpointInfo) -> None:
    if info.url not in _said_unvouched:
        _said_unvouched.add(info.url)
        log.warning(
            "spot_callbacks: %s continues this run's lineage but this run did not write it (another process "
            "on this dirpath, or a manifest put there by hand): retention neither counts nor deletes it",
            info.url,
        )  # fmt: skip


def retention_follows(deadline: float | None) -> bool:
    """Whether retention runs after a commit: never for an emergency checkpoint (one with a
    ``deadline``), which spends none of its seconds on deletes; the next commit prunes."""
    return deadline is None
