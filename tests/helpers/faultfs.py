"""A fault-injecting wrapper around a real fsspec filesystem (it never replaces one)."""

from __future__ import annotations

import random
import threading
from typing import Any


class FaultyFileSystem:
    """Delegates every call to ``inner``; ``put_file`` / ``pipe_file`` can fail or block on demand.

    - ``transient_failures``: the next N writes raise ConnectionError (retryable).
    - ``failure_rate``: each write raises ConnectionError with this probability (seeded by ``seed``).
    - ``permanent``: every write raises PermissionError (not retryable).
    - ``injected`` counts every fault injected (failures raised and writes held).
    - ``gate``: a threading.Event every write waits on before running (to hold an upload);
      with ``gate_only``, only writes whose path contains it wait. ``held`` is set once one waits.
      With ``hang_first=N`` only the first N such writes wait (a hung connection that a retry
      gets past); ``held_writes_done`` is set once every held write has run after the gate opened.
    """

    def __init__(self, inner: Any, failure_rate: float = 0.0, seed: int = 0) -> None:
        self.inner = inner
        self.transient_failures = 0
        self.failure_rate = failure_rate
        self.injected = 0
        self._rng = random.Random(seed)
        self.permanent = False
        self.gate: threading.Event | None = None
        self.gate_only: str | None = None
        self.hang_first: int | None = None
        self.held = threading.Event()
        self.held_writes_done = threading.Event()
        self._holding = 0
        self.writes_started = threading.Event()
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _before_write(self, op: str, path: str) -> None:
        with self._lock:
            self.calls.append((op, path))
            self.writes_started.set()
            if self.permanent:
                self.injected += 1
                raise PermissionError(f"injected: access denied writing {path}")
            if self.failure_rate and self._rng.random() < self.failure_rate:
                self.injected += 1
                raise ConnectionError(
                    f"injected ({self.failure_rate:.0%} of writes): connection reset writing {path}"
                )
            if self.transient_failures > 0:
                self.transient_failures -= 1
                self.injected += 1
                raise ConnectionError(f"injected: connection reset writing {path}")

    def _hold(self, path: str) -> bool:
        """Wait at the gate if this write is one to hold; True if it was held."""
        if self.gate is None or (self.gate_only is not None and self.gate_only not in path):
            return False
        with self._lock:
            if self.hang_first is not None:
                if self.hang_first <= 0:
                    return False
                self.hang_first -= 1
            self._holding += 1
            self.injected += 1
        self.held.set()
        self.gate.wait()
        return True

    def _held_write_done(self) -> None:
        with self._lock:
            self._holding -= 1
            if self._holding == 0:
                self.held_writes_done.set()

    def _write(self, op: str, path: str, call: Any) -> Any:
        self._before_write(op, path)
        if not self._hold(path):
            return call()
        try:
            return call()
        finally:
            self._held_write_done()

    def put_file(self, lpath: str, rpath: str, *args: Any, **kwargs: Any) -> Any:
        return self._write("put_file", rpath, lambda: self.inner.put_file(lpath, rpath, *args, **kwargs))

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> Any:
        return self._write("pipe_file", path, lambda: self.inner.pipe_file(path, value, *args, **kwargs))
