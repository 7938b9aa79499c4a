"""After a checkpoint's upload the C heap's free pages go back to the OS (glibc), unless SPOT_TRIM_HEAP=0."""

from __future__ import annotations

import os
import platform

import pytest

from spot_callbacks.persist import heap

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's"
)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@glibc
def test_freed_blocks_below_a_live_one_go_back_to_the_os(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOT_TRIM_HEAP", raising=False)
    blocks = [bytearray(64 * 1024) for _ in range(3200)]  # 200 MiB of heap blocks (below the mmap threshold)
    pinned = bytearray(64 * 1024)  # above them, so that free() alone cannot shrink the heap from its top
    del blocks
    before = resident_bytes()
    took_s = heap.trim_heap()
    after = resident_bytes()
    assert took_s is not None and took_s >= 0
    assert before - after > 100 * 1024**2, (before, after)
    assert heap.RECENT_TRIMS_S[-1] == took_s
    del pinned


def test_spot_trim_heap_0_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOT_TRIM_HEAP", "0")
    assert heap.trim_heap() is None
