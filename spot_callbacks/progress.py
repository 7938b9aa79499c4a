"""What a wait on a transfer shows while bytes move: done, total, rate and time left.

Every transfer of the store (a pull, a deep verify, an upload) tells a
:class:`~spot_callbacks.store.meter.TransferMeter` the bytes as its data plane moves them, whichever
client that is. :func:`showing_progress` shows a meter while a block runs: on a terminal (stderr)
a rich bar for the whole transfer and one per file in flight; anywhere else (a log file, a pipe)
a line every ``$SPOT_PROGRESS_EVERY_S`` seconds (default 10), to the stream or to the
``spot_callbacks`` log, and a closing total, so a log keeps a record and a script can read it.
stdout is never written (``spot-callbacks pull`` prints only the pulled folder's path there).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import spot_callbacks.settings as settings
from spot_callbacks._format import count_of, human_duration, human_rate, human_size, printable
from spot_callbacks.store.meter import MeterReading, TransferMeter

log = logging.getLogger("spot_callbacks")

REFRESH_S = 0.2  # how often a terminal's bars are redrawn
MeterSource = Callable[[], "TransferMeter | None"]  # the meter to show now (None: nothing moving yet)


def is_terminal(stream: TextIO | None) -> bool:
    """The stream is an interactive terminal (closed or replaced streams are not)."""
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False


def progress_every_s() -> float:
    """``$SPOT_PROGRESS_EVERY_S``: seconds between the lines of a transfer not shown on a terminal."""
    return float(settings.PROGRESS_EVERY_S.value())


def progress_line(reading: MeterReading) -> str:
    """How far a transfer got, in one line.

    Example:
        >>> progress_line(MeterReading(25_000_000, 100_000_000, 1, 4, moving_s=5.0, elapsed_s=6.0))
        '25.0 MB of 100.0 MB (25%), 1/4 files, 5.0 MB/s, ETA 15s'
    """
    rate = "starting" if reading.rate_bps is None else human_rate(reading.done_bytes, reading.moving_s)
    left = "" if reading.eta_s is None else f", ETA {human_duration(reading.eta_s)}"
    return (
        f"{human_size(reading.done_bytes)} of {human_size(reading.total_bytes)} ({reading.fraction:.0%}), "
        f"{reading.files_done}/{count_of(reading.files_total, 'file')}, {rate}{left}"
    )


def closing_line(verb: str, reading: MeterReading) -> str:
    """The total of a finished transfer.

    Example:
        >>> closing_line("pulled", MeterReading(4_000_000, 4_000_000, 1, 1, moving_s=2.0, elapsed_s=2.0))
        'pulled 1 file, 4.0 MB in 2s (2.0 MB/s)'
    """
    return (
        f"{verb} {count_of(reading.files_done, 'file')}, {human_size(reading.done_bytes)} in "
        f"{human_duration(reading.elapsed_s)} ({human_rate(reading.done_bytes, reading.elapsed_s)})"
    )


def short_label(label: str) -> str:
    """``label`` with each URL in it cut to its last part, so a terminal's bar keeps room for its numbers.

    Example:
        >>> short_label("pull s3://bucket/runs/demo/step-000000040")
        'pull step-000000040'
    """
    return " ".join(
        word.rstrip("/").rsplit("/", 1)[-1] if "://" in word else word for word in label.split(" ")
    )


def _as_source(meter: TransferMeter | MeterSource) -> MeterSource:
    return (lambda: meter) if isinstance(meter, TransferMeter) else meter


class PlainProgress:
    """A line every ``every_s`` seconds while the block runs, given to ``emit`` (a stream's print, a log),
    then the closing total (``verb``) for a transfer that completed.

    Example:
        >>> meter, lines = TransferMeter("pull"), []
        >>> meter.expect({"state.pt": 100})
        >>> progress = PlainProgress(meter, "pull s3://b/run/step-5", lines.append, every_s=3600, verb="pulled")
        >>> moved = meter.attempt("state.pt"); moved(40); progress.tell()
        >>> meter.file_done("state.pt"); progress.close()
        >>> lines[0].startswith("pull s3://b/run/step-5: 40 B of 100 B (40%), 0/1 file"), lines[1].startswith("pulled 1 file, 100 B")
        (True, True)
    """

    def __init__(
        self,
        meter: TransferMeter | MeterSource,
        label: str,
        emit: Callable[[str], None],
        *,
        every_s: float,
        verb: str | None = None,
    ) -> None:
        self._source, self.label, self._emit, self.verb = _as_source(meter), label, emit, verb
        self.every_s = every_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spot-progress", daemon=True)
        self._thread.start()

    def reading(self) -> MeterReading | None:
        meter = self._source()
        reading = None if meter is None else meter.reading()
        return reading if reading is not None and reading.total_bytes > 0 else None

    def tell(self) -> None:
        """Emit how far it got now (when anything is moving)."""
        reading = self.reading()
        if reading is not None:
            self._emit(f"{self.label}: {progress_line(reading)}")

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            self.tell()

    def close(self, completed: bool = True) -> None:
        """Stop; the closing total only for a transfer that ``completed`` (a failure says its own line)."""
        self._stopped.set()
        self._thread.join()
        reading = self.reading()
        if completed and self.verb and reading is not None and reading.files_done:
            self._emit(closing_line(self.verb, reading))


class RichProgress:
    """Bars on a terminal: the whole transfer and each file in flight (bytes, rate, time left).

    ``transient``: the bars vanish once done (a wait whose log line stays); otherwise the closing total
    (``verb``) is printed on ``stream`` under them.
    """

    def __init__(
        self,
        meter: TransferMeter | MeterSource,
        label: str,
        stream: TextIO,
        *,
        transient: bool = False,
        verb: str | None = None,
    ) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._source, self.stream, self.transient, self.verb = _as_source(meter), stream, transient, verb
        console = Console(file=stream, stderr=True, highlight=False)
        # Names come from the store: plain text (markup=False), control characters escaped (printable).
        columns = (
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
        )
        self.bars = Progress(*columns, TimeRemainingColumn(), console=console, transient=transient)
        self.overall = self.bars.add_task(printable(short_label(label)), total=None)
        self.tasks: dict[str, Any] = {}
        self._stopped = threading.Event()
        self.bars.start()
        self._thread = threading.Thread(target=self._refresh, name="spot-progress", daemon=True)
        self._thread.start()

    def reading(self) -> MeterReading | None:
        meter = self._source()
        return None if meter is None else meter.reading()

    def redraw(self) -> None:
        reading = self.reading()
        if reading is None:
            return
        for name in [name for name in self.tasks if name not in reading.in_flight]:
            self.bars.remove_task(self.tasks.pop(name))
        for name, (so_far, size) in reading.in_flight.items():
            if name not in self.tasks:
                self.tasks[name] = self.bars.add_task(printable(name), total=size or None)
            self.bars.update(self.tasks[name], completed=so_far)
        self.bars.update(self.overall, total=reading.total_bytes or None, completed=reading.done_bytes)

    def _refresh(self) -> None:
        while not self._stopped.wait(REFRESH_S):
            self.redraw()

    def close(self, completed: bool = True) -> None:
        self._stopped.set()
        self._thread.join()
        self.redraw()
        self.bars.stop()
        reading = self.reading()
        if completed and self.verb and not self.transient and reading is not None and reading.files_done:
            print(closing_line(self.verb, reading), file=self.stream, flush=True)


@contextlib.contextmanager
def showing_progress(
    meter: TransferMeter | MeterSource,
    label: str,
    *,
    stream: TextIO | None = None,
    to_log: bool = False,
    transient: bool = False,
    verb: str | None = None,
) -> Iterator[None]:
    """Show ``meter`` (or the meter ``meter()`` gives at each look) while the block runs.

    On a terminal (``stream``, default stderr) with rich installed: bars. Otherwise a line every
    ``$SPOT_PROGRESS_EVERY_S`` seconds: on ``stream``, or with ``to_log`` on the ``spot_callbacks`` log
    (training's waits: their lines belong with the run's). ``verb`` ("pulled", "verified"): the closing
    total of a transfer that completed; ``transient``: bars vanish once done.

    Example:
        >>> import io
        >>> meter, piped = TransferMeter("pull"), io.StringIO()
        >>> with showing_progress(meter, "pull", stream=piped, verb="pulled"):
        ...     meter.expect({"a.pt": 10}); meter.file_done("a.pt")
        >>> piped.getvalue().startswith("pulled 1 file, 10 B in ")
        True
    """
    stream = sys.stderr if stream is None else stream
    display: PlainProgress | RichProgress
    if is_terminal(stream) and _rich_installed():
        display = RichProgress(meter, label, stream, transient=transient, verb=verb)
    elif to_log:
        display = PlainProgress(meter, label, lambda line: log.info("spot_callbacks: %s", line),
                                every_s=progress_every_s(), verb=verb)  # fmt: skip
    else:
        display = PlainProgress(meter, label, lambda line: print(line, file=stream, flush=True),
                                every_s=progress_every_s(), verb=verb)  # fmt: skip
    completed = False
    try:
        yield
        completed = True
    finally:
        display.close(completed)


def _rich_installed() -> bool:
    try:
        import rich.progress  # noqa: F401
    except ImportError:
        return False
    return True
