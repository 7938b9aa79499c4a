"""What the reliability tests put the library through, counted and printed at the end of the run.

Tests call :func:`record` once their assertions passed (``kills survived``, ``faults injected``,
``damaged inputs refused``). Under pytest-xdist each worker hands its counts to the controller
through ``config.workeroutput`` (see the hooks at the end of ``conftest.py``), which sums them
into the line ``pytest_terminal_summary`` prints.
"""

from __future__ import annotations

import json
import threading
from collections import Counter

KILLS = "kills survived"
FAULTS = "faults injected"
DAMAGED = "damaged inputs refused"
KINDS = (KILLS, FAULTS, DAMAGED)
WORKEROUTPUT_KEY = "spot_reliability_counts"

_counts: Counter[str] = Counter()
_lock = threading.Lock()


def record(kind: str, count: int = 1) -> None:
    """Add ``count`` to one of :data:`KINDS` (call it after the assertions that make it count)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {list(KINDS)}")
    with _lock:
        _counts[kind] += count


def to_json() -> str:
    with _lock:
        return json.dumps(dict(_counts))


def add_json(text: str) -> None:
    """Add a worker's counts (from :func:`to_json`) to this process's."""
    for kind, count in json.loads(text).items():
        record(kind, int(count))


def summary() -> str | None:
    """The line printed at the end of the run, or None when no reliability test ran."""
    with _lock:
        if not any(_counts.values()):
            return None
        return "spot_callbacks reliability: " + ", ".join(f"{_counts[kind]} {kind}" for kind in KINDS)
