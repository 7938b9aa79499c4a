"""How far one checkpoint's transfer got: bytes moved per file, told by the data plane as they move,
read by whoever shows progress (:mod:`spot_callbacks.progress`) or waits for it.

Every client reports differently (boto3 per read of a part, obstore per range or chunk, fsspec
through its ``callback``, some only when a file ends), so a plane reports what it can through
a :data:`Moved` callable and the store marks each file done when its attempt succeeded: a file's
bytes are right at its end whatever its client told before. Each attempt of a file counts from
zero, and an abandoned attempt that keeps reporting (it may run on after its retry started) is
ignored.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

Moved = Callable[[int], None]  # bytes moved since the last call (negative: bytes an attempt took back)


def ignore_moved(nbytes: int) -> None:
    """A :data:`Moved` for a transfer nobody watches."""


@dataclass(frozen=True)
class MeterReading:
    """A transfer at one instant: bytes and files done of the whole, and each file in flight.

    Example:
        >>> reading = MeterReading(done_bytes=25, total_bytes=100, files_done=1, files_total=4,
        ...                        moving_s=5.0, elapsed_s=6.0)
        >>> reading.rate_bps, reading.eta_s, reading.fraction
        (5.0, 15.0, 0.25)
    """

    done_bytes: int
    total_bytes: int
    files_done: int
    files_total: int
    moving_s: float  # since the first byte was asked for (setup before it leaves the rate alone)
    elapsed_s: float  # since the meter was made
    in_flight: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (bytes so far, size)

    @property
    def rate_bps(self) -> float | None:
        return self.done_bytes / self.moving_s if self.moving_s > 0 and self.done_bytes > 0 else None

    @property
    def eta_s(self) -> float | None:
        rate = self.rate_bps
        return None if rate is None else max(0, self.total_bytes - self.done_bytes) / rate

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 0.0

    @property
    def complete(self) -> bool:
        return self.files_total > 0 and self.files_done >= self.files_total


class TransferMeter:
    """The bytes moved of one checkpoint's files, thread-safe (updated from the transfer threads).

    ``expect`` sets the files and their sizes (the store does, once it knows them); each attempt at
    a file gets its own :data:`Moved` from :meth:`attempt`; :meth:`file_done` sets the file to its
    size whatever its client reported.

    Example:
        >>> meter = TransferMeter("pull", clock=iter([0.0, 1.0, 3.0]).__next__)
        >>> meter.expect({"a.pt": 60, "b.pt": 40})
        >>> moved = meter.attempt("a.pt"); moved(30); moved(30); meter.file_done("a.pt")
        >>> retry_me = meter.attempt("b.pt"); retry_me(10); again = meter.attempt("b.pt"); retry_me(99)
        >>> reading = meter.reading()
        >>> reading.done_bytes, reading.files_done, reading.in_flight, reading.rate_bps
        (60, 1, {'b.pt': (0, 40)}, 30.0)
    """

    def __init__(self, what: str = "transfer", clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what  # "pull", "upload", "verify": for the lines that show it
        self._clock = clock
        self._lock = threading.Lock()
        self._created_at = clock()
        self._moving_since: float | None = None
        self._sizes: dict[str, int] = {}
        self._moved: dict[str, int] = {}  # name -> bytes of its current attempt (files in flight)
        self._attempts: dict[str, int] = {}
        self._done: set[str] = set()

    def expect(self, sizes: Mapping[str, int]) -> None:
        """The files of the transfer and their sizes (bytes)."""
        with self._lock:
            self._sizes.update(sizes)

    def attempt(self, name: str) -> Moved:
        """A new attempt at ``name``: its bytes count from zero; the previous attempt's reports stop counting."""
        with self._lock:
            number = self._attempts[name] = self._attempts.get(name, 0) + 1
            self._moved[name] = 0
            if self._moving_since is None:
                self._moving_since = self._clock()

        def moved(nbytes: int) -> None:
            with self._lock:
                if self._attempts.get(name) == number and name in self._moved:
                    self._moved[name] = max(0, self._moved[name] + nbytes)

        return moved

    def file_done(self, name: str) -> None:
        """``name`` arrived whole (its attempt succeeded)."""
        with self._lock:
            self._moved.pop(name, None)
            self._attempts[name] = self._attempts.get(name, 0) + 1  # a late report of any attempt is ignored
            self._done.add(name)

    def reading(self) -> MeterReading:
        with self._lock:
            now = self._clock()
            done = sum(self._sizes.get(name, 0) for name in self._done)
            in_flight = {name: (moved, self._sizes.get(name, 0)) for name, moved in self._moved.items()}
            return MeterReading(
                done_bytes=done
                + sum(min(moved, size) if size else moved for moved, size in in_flight.values()),
                total_bytes=sum(self._sizes.values()),
                files_done=len(self._done),
                files_total=len(self._sizes),
                moving_s=0.0 if self._moving_since is None else now - self._moving_since,
                elapsed_s=now - self._created_at,
                in_flight=in_flight,
            )
