"""Hand the C heap's free pages back to the OS once a checkpoint is uploaded (glibc only; elsewhere nothing).

Under glibc's default allocator a training process that checkpoints in the background keeps
memory it has freed: FSDP frees large all-gather blocks every step, which raises glibc's dynamic
mmap threshold, so later large blocks (the writer's, the training's) come from heaps that glibc
trims only from their top. The peak RSS of an FSDP run then grows by 0.8-1.4x a rank's shard after
its first checkpoint, though no second copy of the shard is alive (BENCHMARKS.md, "strategies").
``malloc_trim(0)`` returns every arena's free pages (``madvise(MADV_DONTNEED)``, glibc 2.8+);
the persisters' upload threads call it after each checkpoint, never the training thread.
``SPOT_TRIM_HEAP=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform
import time
from collections import deque
from collections.abc import Callable

import spot_callbacks.settings as settings

log = logging.getLogger("spot_callbacks")

RECENT_TRIMS_S: deque[float] = deque(
    maxlen=64
)  # the last calls' seconds (benchmarks/strategies.py reads them)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None  # musl, macOS, Windows: no malloc_trim, and another allocator's habits
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_heap() -> float | None:
    """Release the C heap's free pages to the OS; the seconds it took, or ``None`` where it does nothing.

    Example:
        >>> seconds = trim_heap()
        >>> seconds is None or seconds >= 0
        True
    """
    trim = _malloc_trim()
    if trim is None or not settings.TRIM_HEAP.value():
        return None
    started = time.perf_counter()
    trim(0)
    took_s = time.perf_counter() - started
    RECENT_TRIMS_S.append(took_s)
    log.debug("spot_callbacks: malloc_trim took %.1f ms", took_s * 1e3)
    return took_s
