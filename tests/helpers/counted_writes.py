"""A file object wrapper that records the size of every write: the page-cache write-size tests use it."""

from __future__ import annotations

from typing import Any


class CountedWrites:
    """A file object that records the size of every write it is handed, then passes it on."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.writes = raw, list[int]()

    def write(self, data: Any) -> int:
        self.writes.append(memoryview(data).nbytes)
        return self.raw.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)
