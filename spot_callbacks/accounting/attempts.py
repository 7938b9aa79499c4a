"""Every billed second of a run: one record per process that trained in a ``dirpath``.

A manifest tells what its checkpoint cost; it cannot tell of a process that died before its next
commit, nor of the seconds before training (imports, the preflight, the lock wait, the pull) or
after it (the last upload). So each process that trains in a ``dirpath`` (its writer rank) keeps one
small record in ``<dirpath>/.spot-attempts/``, rewritten every ``SPOT_ATTEMPT_RECORD_S`` (1 s) by a
daemon thread, and once more when it ends:

- ``started``: when the process started (the kernel's start time on Linux, else when
  ``spot_callbacks`` was imported); ``host``, ``pid``, ``run_id``, ``lineage``;
- ``lock_wait_s`` / ``lock_cause``: how long it waited for the run lock, and why;
- ``resumed_from``: the step it resumed from (``None``: it started fresh);
- ``first_step`` / ``first_step_at`` and ``last_step`` / ``last_step_at``: its first and newest
  step boundaries (Unix times); ``checkpoints``: ``[step, time]`` of its newest checkpoints;
- ``alive_at``: when the record was written; ``ended_at`` and ``end`` once training ended cleanly
  (the record goes on being rewritten after that, for up to :data:`AFTER_END_S`, and once at exit).

From them :func:`attempt_outcomes` computes what ``spot-callbacks report`` shows. **Billed**: each
process from its start to its last record (its exit; after a hard kill, which writes nothing more:
plus half a period). **Trained**: its first to its newest step boundary, plus one step. **Lost**: its
training after the point the next process resumed from (from the time it took that checkpoint, or
at its own step time), plus, after a hard kill mid-training, the half period after its last record. **Goodput**: what an uninterrupted run
would have spent too (training kept, over all processes, plus one start-up and one end: the first
process's start to its first step, the finishing one's last step to its exit) / billed. **Downtime**: a process's start to its first step.

Clocks: every time in a record is its own host's, and each figure subtracts two times of one host,
so skew between machines does not enter them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from spot_callbacks import settings
from spot_callbacks._format import printable
from spot_callbacks.accounting.ledger import count_value, seconds_value
from spot_callbacks.errors import ManifestError
from spot_callbacks.store import CheckpointStore
from spot_callbacks.store.layout import ATTEMPTS_FOLDER, is_local_fs
from spot_callbacks.store.manifest_limits import load_bounded_json
from spot_callbacks.store.retry import call_with_timeout
from spot_callbacks.store.transfer import put_bytes, whole_read_options

log = logging.getLogger("spot_callbacks")

RECORD_VERSION = 1
MAX_RECORD_BYTES = 8 * 1024  # a record is ~500 bytes; anything larger is no run's
MAX_RECORDS_READ = 500  # the newest records a report reads (one per process start)
MAX_TEXT = 255  # host names, causes, ends
CHECKPOINTS_KEPT = 16  # the newest checkpoints of a process: the next one resumes from one of them
CLOSE_TIMEOUT_S = 5.0
# After training ends the process is still billed (the script's own code after fit, the interpreter's
# exit): the record goes on being rewritten for up to this long, and once more at exit.
AFTER_END_S = 120.0
EXIT_WRITE_TIMEOUT_S = 2.0
# Records of one process more than this far apart from its own start are no run's (a clock jump, a forgery).
MAX_ATTEMPT_S = 366 * 86400.0
ENDS = ("finished", "preempted", "stopped")


def _process_started() -> float:
    """When this process started (Unix time): ``/proc/self/stat``'s start time against ``/proc/uptime``,
    so the interpreter's start-up and the imports count; where there is no ``/proc``, now."""
    now = time.time()
    try:
        with open("/proc/self/stat", "rb") as stat_file:
            stat = stat_file.read()
        with open("/proc/uptime", "rb") as uptime_file:
            uptime_s = float(uptime_file.read().split()[0])
        # Fields after the command name (which may hold spaces and parentheses): the 22nd is the start, in ticks.
        start_ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
        age_s = uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - age_s if 0.0 <= age_s < MAX_ATTEMPT_S else now


PROCESS_STARTED = _process_started()


# ------------------------------------------------------------------------------------ the record
@dataclass(frozen=True)
class AttemptRecord:
    """One process's record, as read back from a store (untrusted: checked by :meth:`from_json`)."""

    run_id: str
    host: str
    started: float
    alive_at: float
    lineage: str | None = None
    lock_wait_s: float | None = None
    lock_cause: str | None = None
    resumed_from: int | None = None
    first_step: int | None = None
    first_step_at: float | None = None
    last_step: int | None = None
    last_step_at: float | None = None
    end: str | None = None
    ended_at: float | None = None
    checkpoints: tuple[tuple[int, float], ...] = ()  # (step, Unix time) of its newest checkpoints

    @classmethod
    def from_json(cls, doc: Any) -> AttemptRecord | None:
        """The record in ``doc``, or ``None`` when it is not one a run writes (a value out of range,
        times out of order, a text too long): it is left out of the report, never an exception.

        Example:
            >>> AttemptRecord.from_json({"version": 1, "run_id": "ab", "host": "h", "started": 10.0,
            ...                          "alive_at": 12.0}).alive_at
            12.0
            >>> AttemptRecord.from_json({"version": 1, "run_id": "ab", "host": "h", "started": 10.0,
            ...                          "alive_at": 9.0}) is None
            True
        """
        if not isinstance(doc, dict) or doc.get("version") != RECORD_VERSION:
            return None
        texts: dict[str, str | None] = {}
        for key in ("run_id", "host", "lineage", "lock_cause", "end"):
            value = doc.get(key)
            if value is not None and (not isinstance(value, str) or len(value) > MAX_TEXT):
                return None
            texts[key] = printable(value) if isinstance(value, str) else None
        times: dict[str, float | None] = {}
        for key in ("started", "alive_at", "lock_wait_s", "first_step_at", "last_step_at", "ended_at"):
            value = doc.get(key)
            times[key] = seconds_value(value)
            if value is not None and times[key] is None:
                return None
        steps: dict[str, int | None] = {}
        for key in ("resumed_from", "first_step", "last_step"):
            value = doc.get(key)
            steps[key] = count_value(value)
            if value is not None and steps[key] is None:
                return None
        started, alive_at = times["started"], times["alive_at"]
        if texts["run_id"] is None or texts["host"] is None or started is None or alive_at is None:
            return None
        stamps = [times[key] for key in ("first_step_at", "last_step_at", "ended_at")]
        if not started <= alive_at <= started + MAX_ATTEMPT_S or any(
            stamp is not None and not started <= stamp <= alive_at + 1.0 for stamp in stamps
        ):
            return None
        first, last = steps["first_step"], steps["last_step"]
        if (first is None) != (last is None) or (first is not None and last is not None and first > last):
            return None
        if (first is None) != (times["first_step_at"] is None) or (last is None) != (
            times["last_step_at"] is None
        ):
            return None
        checkpoints = _checkpoint_times(doc.get("checkpoints", []), started, alive_at)
        if checkpoints is None:
            return None
        return cls(
            run_id=texts["run_id"], host=texts["host"], started=started, alive_at=alive_at,
            lineage=texts["lineage"], lock_wait_s=times["lock_wait_s"], lock_cause=texts["lock_cause"],
            resumed_from=steps["resumed_from"], first_step=first, first_step_at=times["first_step_at"],
            last_step=last, last_step_at=times["last_step_at"], end=texts["end"], ended_at=times["ended_at"],
            checkpoints=checkpoints,
        )  # fmt: skip


def _checkpoint_times(value: Any, started: float, alive_at: float) -> tuple[tuple[int, float], ...] | None:
    """A record's ``[[step, time], ...]``, checked (``None``: not what a run writes)."""
    if not isinstance(value, list) or len(value) > CHECKPOINTS_KEPT:
        return None
    pairs = []
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2:
            return None
        step, at = count_value(pair[0]), seconds_value(pair[1])
        if step is None or at is None or not started <= at <= alive_at + 1.0:
            return None
        pairs.append((step, at))
    return tuple(pairs)


class AttemptLog:
    """This process's attempt record, kept in the store by a daemon thread (the writer rank only).

    Cheap on the training loop: :meth:`step` sets two numbers; the thread writes a ~500-byte object
    every ``period_s``. A store that refuses the write costs a warning, never the run.

    Example:
        >>> import tempfile
        >>> log_ = AttemptLog(CheckpointStore(tempfile.mkdtemp()))
        >>> log_.begin(); log_.step(1); log_.step(2)
        >>> log_.close("finished")
        >>> [record.last_step for record in read_attempts(log_.store)]
        [2]
    """

    def __init__(self, store: CheckpointStore, period_s: float | None = None) -> None:
        self.store = store
        self.period_s = period_s if period_s is not None else settings.ATTEMPT_RECORD_S.value()
        self.run_id = uuid.uuid4().hex
        self.path = posixpath.join(
            store.root, ATTEMPTS_FOLDER, f"{int(PROCESS_STARTED * 1000):013d}-{self.run_id}.json"
        )
        self._fields: dict[str, Any] = {
            "version": RECORD_VERSION, "run_id": self.run_id, "host": socket.gethostname()[:MAX_TEXT],
            "pid": os.getpid(), "started": round(PROCESS_STARTED, 3), "lineage": None,
            "lock_wait_s": None, "lock_cause": None, "resumed_from": None,
            "first_step": None, "first_step_at": None, "last_step": None, "last_step_at": None,
            "end": None, "ended_at": None, "checkpoints": [],
        }  # fmt: skip
        self._guard = threading.Lock()
        self._writing = threading.Lock()  # one write at a time, each of the newest fields
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._written = False  # once any write of the record was tried: discard() deletes it
        self._written_at: float | None = None  # monotonic time of the newest write that succeeded
        self._ended_at: float | None = None  # monotonic time of close()
        self._warned = False

    def begin(self) -> None:
        """Start keeping the record (idempotent; after :meth:`close` or :meth:`discard`, nothing)."""
        if self._thread is not None or self._closed:
            return
        self._thread = threading.Thread(target=self._keep, name="spot-attempt-record", daemon=True)
        self._thread.start()

    def write_now(self) -> None:
        """Write the record once, in this thread, before :meth:`begin` (a process killed before its
        thread's first write is billed from its start all the same); nothing after close or discard.
        The thread then writes a period after this write, not at once (one write at start, not two)."""
        if self._closed or self._thread is not None:
            return
        self._write()

    def note(self, **fields: Any) -> None:
        """Set fields of the record (``lineage``, ``lock_wait_s``, ``lock_cause``, ``resumed_from``)."""
        with self._guard:
            self._fields.update(fields)

    def step(self, step: int) -> None:
        """A step boundary of this process (every step: two numbers set; rounded when written)."""
        now = time.time()
        with self._guard:
            fields = self._fields
            if fields["first_step"] is None:
                fields["first_step"], fields["first_step_at"] = step, round(now, 3)
            fields["last_step"], fields["last_step_at"] = step, now

    def checkpoint_taken(self, step: int) -> None:
        """This process takes a checkpoint of ``step`` now."""
        now = round(time.time(), 3)
        with self._guard:
            self._fields["checkpoints"] = [*self._fields["checkpoints"], [step, now]][-CHECKPOINTS_KEPT:]

    def close(self, end: str, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Training ended (``end``: one of :data:`ENDS`): written at once, within ``timeout_s``; the
        process's remaining life is still recorded (every period for :data:`AFTER_END_S`, and at exit)."""
        if self._closed or self._thread is None:
            self._closed = True
            return
        self._closed = True
        self.note(end=end, ended_at=round(time.time(), 3))
        self._ended_at = time.monotonic()
        self._write_within(timeout_s)
        if end != "preempted":  # a preempted process exits by its deadline: nothing may hold it up
            atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        self._stop.set()
        self._write_within(EXIT_WRITE_TIMEOUT_S)

    def discard(self) -> None:
        """This process does not belong to the run (refused by a live run's lock): its record goes."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CLOSE_TIMEOUT_S)
        if self._written:
            with contextlib.suppress(Exception):
                call_with_timeout(
                    lambda: self.store.fs.rm(self.path), CLOSE_TIMEOUT_S, "delete the attempt record"
                )

    def _keep(self) -> None:
        # After write_now (in the preflight, moments ago) the next write is a period after it, as any
        # other: a kill before then is billed to the same half period past the last record.
        written_at = self._written_at
        if written_at is not None and self._stop.wait(
            max(0.0, written_at + self.period_s - time.monotonic())
        ):
            return
        while True:
            self._write()
            if self._stop.wait(self.period_s):
                return
            if self._ended_at is not None and time.monotonic() - self._ended_at > AFTER_END_S:
                return  # a long-lived process (a notebook) stops writing; its exit still writes once

    def _write_within(self, timeout_s: float) -> None:
        writer = threading.Thread(target=self._write, name="spot-attempt-record-end", daemon=True)
        writer.start()
        writer.join(timeout_s)

    def _write(self) -> None:
        with self._writing:
            self._written = True
            if self._write_newest():
                self._written_at = time.monotonic()

    def _write_newest(self) -> bool:
        """Write the record with the newest fields; whether the store took it (a failure is warned once)."""
        with self._guard:
            doc = {**self._fields, "alive_at": round(time.time(), 3)}
            doc["checkpoints"] = list(doc["checkpoints"])
        if doc["last_step_at"] is not None:
            doc["last_step_at"] = round(doc["last_step_at"], 3)
        try:
            if is_local_fs(self.store.fs):
                self.store.fs.makedirs(posixpath.dirname(self.path), exist_ok=True)
            put_bytes(self.store.fs, self.path, json.dumps(doc).encode())
            return True
        except Exception as err:  # noqa: BLE001 - the record is for the report; the run goes on
            if not self._warned:
                self._warned = True
                log.warning(
                    "spot_callbacks: could not write this process's attempt record %s (%s: %s); "
                    "`spot-callbacks report` will not count its billed time", self.store.url_of(self.path),
                    type(err).__name__, err,
                )  # fmt: skip
            return False


def read_attempts(store: CheckpointStore, limit: int = MAX_RECORDS_READ) -> list[AttemptRecord]:
    """The attempt records in ``store`` (the newest ``limit`` by start), oldest first; a record no run
    wrote (too large, not JSON, a value out of range) is left out, with one warning for all."""
    folder = posixpath.join(store.root, ATTEMPTS_FOLDER)
    try:
        entries = {
            entry["name"]: entry.get("size")
            for entry in store.fs.ls(folder, detail=True)
            if entry.get("type") == "file" and str(entry.get("name", "")).endswith(".json")
        }
    except (FileNotFoundError, NotADirectoryError):
        return []
    names = sorted(entries)[-limit:]
    # The listing's sizes: one request for all, not one HEAD per record.
    sizes_ok = [
        name for name in names if isinstance(entries[name], int) and entries[name] <= MAX_RECORD_BYTES
    ]
    # Small objects: one GET each, no HEAD first (s3fs with max_concurrency > 1, see whole_read_options).
    raws = store.fs.cat(sizes_ok, on_error="omit", **whole_read_options(store.fs)) if sizes_ok else {}
    records, refused = [], len(names) - len(sizes_ok)
    for name in sizes_ok:
        raw = raws.get(name) if isinstance(raws, dict) else None
        record = None
        if isinstance(raw, bytes):
            with contextlib.suppress(ManifestError):
                record = AttemptRecord.from_json(load_bounded_json(raw, store.url_of(name)))
        if record is None:
            refused += 1
        else:
            records.append(record)
    if refused:
        log.warning(
            "spot_callbacks: ignoring %d attempt record(s) in %s that no run writes (too large, not JSON, "
            "or values out of range)", refused, store.url_of(folder),
        )  # fmt: skip
    return sorted(records, key=lambda record: (record.started, record.run_id))


# ------------------------------------------------------------------------------------ the outcome
@dataclass(frozen=True)
class AttemptOutcome:
    """What one process cost and kept (see the module docstring)."""

    record: AttemptRecord
    billed_s: float
    trained_s: float
    lost_s: float
    lost_steps: int
    downtime_s: float | None  # its start to its first step boundary; None: it never trained
    hard_loss: bool  # it wrote no end: killed, or its machine vanished
    after_training_s: float = 0.0  # a clean end: its last step to its exit (the last upload, the exit)

    @property
    def kept_s(self) -> float:
        return max(self.trained_s - self.lost_s, 0.0)


@dataclass(frozen=True)
class AttemptsSummary:
    """The processes of one run and their totals."""

    outcomes: tuple[AttemptOutcome, ...]

    @property
    def billed_s(self) -> float:
        return sum(outcome.billed_s for outcome in self.outcomes)

    @property
    def kept_s(self) -> float:
        """Training kept, plus what an uninterrupted run pays once too: the first process's start-up
        (to its first step) and the finishing process's end (its last step to its exit)."""
        if not self.outcomes:
            return 0.0
        once = (self.outcomes[0].downtime_s or 0.0) + self.outcomes[-1].after_training_s
        return sum(outcome.kept_s for outcome in self.outcomes) + once

    @property
    def lost_s(self) -> float:
        return sum(outcome.lost_s for outcome in self.outcomes)

    @property
    def goodput(self) -> float | None:
        return self.kept_s / self.billed_s if self.billed_s > 0 else None

    @property
    def restarts(self) -> tuple[AttemptOutcome, ...]:
        return self.outcomes[1:]


def attempt_outcomes(
    records: Sequence[AttemptRecord], resume_point: int | None, period_s: float | None = None
) -> AttemptsSummary:
    """What each process in ``records`` cost and kept; ``resume_point``: the step the next process
    would resume from now (the newest valid checkpoint; ``None``: none, it would start fresh).

    Example:
        >>> first = AttemptRecord("a", "h1", started=0.0, alive_at=60.0, first_step=1, first_step_at=10.0,
        ...                       last_step=50, last_step_at=59.0)  # killed: no end
        >>> second = AttemptRecord("b", "h2", started=70.0, alive_at=120.0, resumed_from=40, first_step=41,
        ...                        first_step_at=80.0, last_step=90, last_step_at=118.0, end="finished",
        ...                        ended_at=120.0)
        >>> summary = attempt_outcomes([first, second], resume_point=90, period_s=1.0)
        >>> [(o.billed_s, o.lost_steps, round(o.lost_s, 2)) for o in summary.outcomes]
        [(60.5, 10, 10.5), (50.0, 0, 0.0)]
        >>> round(summary.goodput, 3)
        0.821
    """
    period = period_s if period_s is not None else settings.ATTEMPT_RECORD_S.value()
    records = sorted(records, key=lambda record: (record.started, record.run_id))
    outcomes = []
    for index, record in enumerate(records):
        hard_loss = record.ended_at is None
        # A process killed outright died some time in the period after its last record: half of it, on average.
        tail_s = period / 2.0 if hard_loss else 0.0
        end = record.alive_at + tail_s  # its exit, or (killed) its last record and half a period
        billed_s = max(end - record.started, 0.0)
        trained_s, lost_s, lost_steps, downtime_s = 0.0, 0.0, 0, None
        first, last = record.first_step, record.last_step
        if first is not None and last is not None and record.first_step_at is not None:
            assert record.last_step_at is not None  # from_json pairs them
            span_s = max(record.last_step_at - record.first_step_at, 0.0)
            step_s = span_s / (last - first) if last > first else 0.0
            trained_s = span_s + step_s
            downtime_s = max(record.first_step_at - record.started, 0.0)
            resumed_at = _next_resume_point(records[index + 1 :], resume_point)
            lost_steps = min(max(last - resumed_at, 0), last - first + 1)
            taken_at = dict(record.checkpoints).get(resumed_at)
            if lost_steps and taken_at is not None:  # it took that checkpoint: what it trained after
                lost_s = min(max(record.last_step_at - taken_at, 0.0), trained_s)
            else:
                lost_s = min(lost_steps * step_s, trained_s) if step_s else (trained_s if lost_steps else 0.0)
            # Training when it last wrote (its newest step within about a period of the record): the
            # tail it trained after the record was lost with it.
            if hard_loss and record.alive_at - record.last_step_at <= 2 * period + step_s:
                trained_s += tail_s
                lost_s += tail_s
        after_s = (
            max(end - record.last_step_at, 0.0) if not hard_loss and record.last_step_at is not None else 0.0
        )
        outcomes.append(
            AttemptOutcome(record, billed_s, trained_s, lost_s, lost_steps, downtime_s, hard_loss, after_s)
        )
    return AttemptsSummary(tuple(outcomes))


def _next_resume_point(later: Iterable[AttemptRecord], resume_point: int | None) -> int:
    """The step the run went on from after a process: the next one that got as far as resuming (or
    training: then it started fresh, from 0), else the resume point the store holds now."""
    for record in later:
        if record.resumed_from is not None:
            return record.resumed_from
        if record.first_step is not None:
            return 0
    return resume_point if resume_point is not None else 0


def attempts_of_lineage(
    records: Sequence[AttemptRecord], lineage_ids: Iterable[str | None], committed: Iterable[str | None]
) -> list[AttemptRecord]:
    """The records of the processes of one lineage: those that said so; those that died before they
    knew (no lineage) once the lineage's first process had started; and those that led to it: a
    process whose lineage never committed a checkpoint here (``committed``: every lineage with a
    manifest in the dirpath), killed before its first commit, so the next process started fresh
    too. It belongs to the lineage whose process came next, unless another job's (a committed
    lineage not in ``lineage_ids``) was still alive when it started.

    Example:
        >>> old = AttemptRecord("o", "h", 0.0, 1.0, lineage="L0")  # another job, committed
        >>> killed = AttemptRecord("k", "h", 2.0, 3.0, lineage="K")  # killed before its first commit
        >>> a = AttemptRecord("a", "h", 5.0, 6.0, lineage="L1")
        >>> b = AttemptRecord("b", "h", 7.0, 8.0)  # died before it knew its lineage
        >>> [r.run_id for r in attempts_of_lineage([old, killed, a, b], {"L1"}, {"L0", "L1"})]
        ['k', 'a', 'b']
    """
    wanted, committed = set(lineage_ids), set(committed) | set(lineage_ids)
    records = sorted(records, key=lambda record: (record.started, record.run_id))

    def is_own(record: AttemptRecord | None) -> bool:
        return record is not None and record.lineage is not None and record.lineage in wanted

    own = [record for record in records if is_own(record)]
    if not own:
        return []
    since = min(record.started for record in own)

    def led_to_own(index: int) -> bool:
        record = records[index]
        if record.lineage is not None and record.lineage in committed:
            return False  # its own lineage, or another job's
        if any(  # another job was still running when it started: one of that job's
            other.lineage in committed - wanted and other.started <= record.started <= other.alive_at
            for other in records[:index]
        ):
            return False
        after = (
            other
            for other in records[index + 1 :]
            if other.lineage is not None and other.lineage in committed
        )
        return is_own(next(after, None))

    return [
        record
        for index, record in enumerate(records)
        if is_own(record) or (record.lineage is None and record.started >= since) or led_to_own(index)
    ]
