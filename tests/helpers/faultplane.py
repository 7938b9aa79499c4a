"""A fault-injecting wrapper around a store's real data plane (the fast client; it never replaces one).

The data-plane twin of :class:`helpers.faultfs.FaultyFileSystem`: the same knobs, on the calls that
move payload bytes (``upload``, ``download``, ``digest``), so the store's reliability cases run with
boto3 / obstore moving the bytes against a real server.
"""

from __future__ import annotations

import random
import threading
from typing import Any

from spot_callbacks.store.meter import ignore_moved


class FaultyPlane:
    """Delegates to ``inner`` (a data plane); uploads and downloads can fail or block on demand.

    - ``transient_failures``: the next N calls raise ConnectionError (retryable).
    - ``failure_rate``: each call raises ConnectionError with this probability (seeded by ``seed``).
    - ``permanent``: every upload raises PermissionError (not retryable).
    - ``gate`` / ``gate_only`` / ``hang_first``: as FaultyFileSystem's, for uploads: the held upload
      runs (late) once the gate opens; ``held_writes_done`` is set when every held one has run.
    - ``injected`` counts every fault; ``calls`` lists ``(op, path)``.

    It serves any filesystem: set as ``store.data_plane`` it stays in the path even when the test
    also wraps ``store.fs`` (the manifest's path).
    """

    def __init__(self, inner: Any, failure_rate: float = 0.0, seed: int = 0) -> None:
        self.inner = inner
        self.name = f"faulty {inner.name}"
        self.failure_rate = failure_rate
        self.transient_failures = 0
        self.permanent = False
        self.injected = 0
        self.gate: threading.Event | None = None
        self.gate_only: str | None = None
        self.hang_first: int | None = None
        self.held = threading.Event()
        self.held_writes_done = threading.Event()
        self.calls: list[tuple[str, str]] = []
        self._holding = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def serves(self, fs: Any) -> bool:
        return True

    def _before(self, op: str, path: str, *, write: bool) -> None:
        with self._lock:
            self.calls.append((op, path))
            if write and self.permanent:
                self.injected += 1
                raise PermissionError(f"injected: access denied writing {path}")
            if self.failure_rate and self._rng.random() < self.failure_rate:
                self.injected += 1
                raise ConnectionError(
                    f"injected ({self.failure_rate:.0%} of calls): connection reset on {path}"
                )
            if self.transient_failures > 0:
                self.transient_failures -= 1
                self.injected += 1
                raise ConnectionError(f"injected: connection reset on {path}")

    def _hold(self, path: str) -> bool:
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

    def warm(self, remote_path: str) -> None:
        self.inner.warm(remote_path)

    @property
    def hashes_as_it_sends(self) -> bool:
        return bool(self.inner.hashes_as_it_sends)

    def upload(self, local_path: str, remote_path: str, moved: Any = ignore_moved, **options: Any) -> Any:
        self._before("upload", remote_path, write=True)
        if not self._hold(remote_path):
            return self.inner.upload(local_path, remote_path, moved=moved, **options)
        try:
            return self.inner.upload(local_path, remote_path, moved=moved, **options)
        finally:
            with self._lock:
                self._holding -= 1
                if self._holding == 0:
                    self.held_writes_done.set()

    def download(
        self,
        remote_path: str,
        local_path: str,
        timeout_s: float | None,
        expected_size: Any = None,
        moved: Any = ignore_moved,
        **options: Any,
    ) -> Any:
        self._before("download", remote_path, write=False)
        return self.inner.download(remote_path, local_path, timeout_s, expected_size, moved=moved, **options)

    def digest(
        self,
        remote_path: str,
        timeout_s: float | None,
        expected_size: Any = None,
        moved: Any = ignore_moved,
        **options: Any,
    ) -> Any:
        self._before("digest", remote_path, write=False)
        return self.inner.digest(remote_path, timeout_s, expected_size, moved=moved, **options)
