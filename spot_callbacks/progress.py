"""What ``spot-callbacks pull`` and ``verify`` (and a resume's pull on a terminal) show while they move
bytes: done, total, rate and time left, per file and overall.

On a terminal (stderr) a rich bar per file in flight and one for the whole checkpoint; piped (or
without rich), one plain line per file as it completes and a closing total, so a log keeps a
record and a script can read it. stdout carries only the pulled folder's path either way.

The store's pull and verify take no progress callback, so :func:`reporting_pull` sees each file
through the store's filesystem: a download starts and completes with its ``get_file`` call (the
bytes so far are the size of its local copy: any backend writes progressively), a verify's read
with its ``open`` and its last ``read`` (the bytes so far are those read).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from spot_callbacks._format import human_duration, human_rate, human_size
from spot_callbacks.accounting.throughput import eta_s
from spot_callbacks.store import CheckpointInfo, CheckpointStore

REFRESH_S = 0.2  # how often a terminal's bars are redrawn from the local file sizes


def is_terminal(stream: TextIO | None) -> bool:
    """The stream is an interactive terminal (closed or replaced streams are not)."""
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False


class PlainPullProgress:
    """One line per completed file on ``stream``, then the total.

    Example:
        >>> import io
        >>> from spot_callbacks.store.checksums import FileDigest
        >>> sink, now = io.StringIO(), iter([0.0, 0.0, 2.0, 2.0]).__next__
        >>> progress = PlainPullProgress({"state.pt": 4_000_000}, sink, clock=now)
        >>> progress.file_started("state.pt", "/tmp/state.pt"); progress.file_done("state.pt"); progress.close()
        >>> print(sink.getvalue(), end="")
        state.pt: 4.0 MB in 2s (2.0 MB/s); 1/1 files, 4.0 MB of 4.0 MB, ETA 0s
        pulled 1 files, 4.0 MB in 2s (2.0 MB/s)
    """

    def __init__(
        self,
        sizes: dict[str, int],
        stream: TextIO,
        clock: Callable[[], float] = time.monotonic,
        verb: str = "pulled",
    ):
        self.sizes = sizes
        self.verb = verb  # of the closing line: "pulled", "verified"
        self.total = sum(sizes.values())
        self.stream = stream
        self.clock = clock
        self.started_at = clock()
        self.moving_since: float | None = None  # the first file's start: the ETA's rate leaves setup out
        self.done_bytes = 0
        self.done_files = 0
        self.in_flight: dict[str, tuple[Callable[[], int], float]] = {}  # name -> (its bytes so far, start)
        self._lock = threading.RLock()  # files arrive on the store's download threads

    def file_started(self, name: str, local_path: str) -> None:
        """A download of ``name`` into ``local_path`` started (its bytes so far: the local file's size)."""
        self.file_reading(name, lambda: _local_size(local_path))

    def file_reading(self, name: str, bytes_so_far: Callable[[], int]) -> None:
        """``name`` started moving; ``bytes_so_far()`` says how far it got."""
        with self._lock:
            now = self.clock()
            self.in_flight[name] = (bytes_so_far, now)
            self.moving_since = now if self.moving_since is None else self.moving_since

    def file_abandoned(self, name: str) -> None:
        """``name`` stopped before its end (an attempt that failed and is retried)."""
        with self._lock:
            self.in_flight.pop(name, None)

    def file_done(self, name: str) -> None:
        with self._lock:
            _, started = self.in_flight.pop(name, ("", self.started_at))
            size = self.sizes.get(name, 0)
            now = self.clock()
            self.done_bytes += size
            self.done_files += 1
            since = self.started_at if self.moving_since is None else self.moving_since
            self._file_line(name, size, now - started, now - since)

    def bytes_so_far(self) -> int:
        """The completed files and what the files in flight have written so far."""
        return self.done_bytes + sum(so_far() for so_far, _ in self.in_flight.values())

    def _file_line(self, name: str, size: int, file_s: float, elapsed_s: float) -> None:
        # Files download in parallel: the time left counts the bytes of those still in flight too.
        left = eta_s(self.bytes_so_far(), self.total, elapsed_s)
        print(
            f"{name}: {human_size(size)} in {human_duration(file_s)} ({human_rate(size, file_s)}); "
            f"{self.done_files}/{len(self.sizes)} files, {human_size(self.done_bytes)} of "
            f"{human_size(self.total)}, ETA {human_duration(left)}",
            file=self.stream,
            flush=True,
        )

    def close(self, completed: bool = True) -> None:
        """The end; the closing total only for a transfer that ``completed`` (a failure says its own line)."""
        if self.done_files and completed:
            elapsed = self.clock() - self.started_at
            print(
                f"{self.verb} {self.done_files} files, {human_size(self.done_bytes)} in {human_duration(elapsed)} "
                f"({human_rate(self.done_bytes, elapsed)})",
                file=self.stream,
                flush=True,
            )


class RichPullProgress(PlainPullProgress):
    """Bars on a terminal: the checkpoint overall and each file in flight (bytes, rate, time left).

    ``transient``: the bars vanish once done (a resume's pull, whose log line stays).
    """

    def __init__(
        self,
        sizes: dict[str, int],
        stream: TextIO,
        console: Any,
        transient: bool = False,
        verb: str = "pulled",
    ) -> None:
        super().__init__(sizes, stream, verb=verb)
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
        self.bars = Progress(*columns, TimeRemainingColumn(), console=console, transient=transient)
        self.overall = self.bars.add_task("checkpoint", total=self.total)
        self.tasks: dict[str, Any] = {}
        self._stopped = threading.Event()
        self.bars.start()
        self._refresher = threading.Thread(target=self._refresh, name="spot-pull-progress", daemon=True)
        self._refresher.start()

    def file_reading(self, name: str, bytes_so_far: Callable[[], int]) -> None:
        with self._lock:
            super().file_reading(name, bytes_so_far)
            if name not in self.tasks:
                self.tasks[name] = self.bars.add_task(name, total=self.sizes.get(name))

    def _file_line(self, name: str, size: int, file_s: float, elapsed_s: float) -> None:
        with self._lock:
            task = self.tasks.pop(name, None)
            if task is not None:
                self.bars.remove_task(task)
            self.bars.update(self.overall, completed=self.done_bytes)

    def _refresh(self) -> None:
        while not self._stopped.wait(REFRESH_S):
            with self._lock:
                for name, (so_far, _) in self.in_flight.items():
                    if name in self.tasks:
                        self.bars.update(self.tasks[name], completed=so_far())
                self.bars.update(self.overall, completed=self.bytes_so_far())

    def close(self, completed: bool = True) -> None:
        self._stopped.set()
        self._refresher.join()
        self.bars.update(self.overall, completed=self.done_bytes)
        self.bars.stop()
        super().close(completed)


def _local_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # not created yet, or renamed into place already
        return 0


def pull_progress(
    info: CheckpointInfo, stream: TextIO | None = None, transient: bool = False, verb: str = "pulled"
) -> PlainPullProgress:
    """Bars when ``stream`` (default stderr) is a terminal and rich is installed, plain lines otherwise."""
    stream = sys.stderr if stream is None else stream
    sizes = {name: digest.size for name, digest in info.files.items()}
    if is_terminal(stream):
        try:
            from rich.console import Console
        except ImportError:
            return PlainPullProgress(sizes, stream, verb=verb)
        console = Console(file=stream, stderr=True, highlight=False)
        return RichPullProgress(sizes, stream, console, transient, verb)
    return PlainPullProgress(sizes, stream, verb=verb)


class _CountingReader:
    """A remote file opened for reading, telling ``progress`` how far it got and when it was read to its end."""

    def __init__(self, handle: Any, name: str, progress: PlainPullProgress) -> None:
        self._handle, self._name, self._progress = handle, name, progress
        self._read = 0
        self._at_end = False
        progress.file_reading(name, lambda: self._read)

    def read(self, size: int = -1) -> bytes:
        block = self._handle.read(size)
        self._read += len(block)
        self._at_end |= not block
        return block

    def close(self) -> None:
        self._handle.close()
        if self._at_end:
            self._progress.file_done(self._name)
        else:
            self._progress.file_abandoned(self._name)

    def __enter__(self) -> _CountingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._handle, attribute)


class _ReportingFilesystem:
    """The store's filesystem, telling ``progress`` when each payload file of ``folder`` starts and ends
    (downloaded with ``get_file``, or read through ``open``)."""

    def __init__(self, fs: Any, folder: str, progress: PlainPullProgress) -> None:
        self._fs = fs
        self._folder = folder.rstrip("/")
        self._progress = progress

    def get_file(self, rpath: str, lpath: str, *args: Any, **kwargs: Any) -> Any:
        name = posixpath.relpath(str(rpath), self._folder)
        self._progress.file_started(name, os.fspath(lpath))
        result = self._fs.get_file(rpath, lpath, *args, **kwargs)
        self._progress.file_done(name)
        return result

    def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        handle = self._fs.open(path, mode, *args, **kwargs)
        name = posixpath.relpath(str(path), self._folder)
        if mode != "rb" or name not in self._progress.sizes:  # the manifest, a probe: not a payload file
            return handle
        return _CountingReader(handle, name, self._progress)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._fs, attribute)


@contextlib.contextmanager
def reporting_pull(
    store: CheckpointStore,
    info: CheckpointInfo,
    stream: TextIO | None = None,
    transient: bool = False,
    verb: str = "pulled",
) -> Iterator[None]:
    """Show the progress of a ``store.pull`` (or ``store.verify``: ``verb="verified"``) of ``info`` run
    inside the block (see :func:`pull_progress`)."""
    progress = pull_progress(info, stream, transient, verb)
    original = store.fs
    store.fs = _ReportingFilesystem(original, store.step_path(info.step), progress)
    completed = False
    try:
        yield
        completed = True
    finally:
        store.fs = original
        progress.close(completed)


def reporting_on_a_terminal(
    store: CheckpointStore, info: CheckpointInfo, transient: bool = False, verb: str = "pulled"
) -> contextlib.AbstractContextManager[None]:
    """:func:`reporting_pull` when stderr is a terminal; nothing otherwise (stderr is a log's, or for errors)."""
    if is_terminal(sys.stderr):
        return reporting_pull(store, info, transient=transient, verb=verb)
    return contextlib.nullcontext()
