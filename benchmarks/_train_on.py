"""Measuring a checkpoint from outside while training runs on (used by the multi-rank workers).

- :class:`HookClock`: wraps the checkpoint callback's hooks and adds the time spent in them to the
  step they belong to; a checkpoint's *blocked* time is its step's hook time less the median of
  the steps without a checkpoint.
- :class:`Floor`: ``copy_`` of the tensors the rank stages into buffers allocated (and touched)
  once, before the RSS baseline, timed just before each checkpoint's hooks (side by side), between
  two :func:`line_up` barriers (at every step), so every rank enters the hooks at once.
- :class:`RssWindow`: RSS sampled every 2 ms over the whole run. The baseline is the *peak* over
  plain training steps before the first checkpoint (a step's own activations and gradients come
  and go: the RSS at a step boundary is not the training's peak); *extra* is the peak from the
  first checkpoint to the end of the run (the writes and uploads included) over that baseline.
  The same sampler follows glibc's *heap in use* (:func:`heap_in_use_bytes`: bytes malloc handed out
  and not yet freed) over the same windows: the checkpoint's own memory inside the process, without
  the freed-but-kept heap (fragmentation, trims) that makes RSS differ between two runs.
"""

from __future__ import annotations

import ctypes
import functools
import os
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, cast

import torch

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        function = ctypes.CDLL("libc.so.6").mallinfo2  # glibc 2.33+
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return cast(Callable[[], _MallInfo2], function)


_MALLINFO2 = _mallinfo2()


def heap_in_use_bytes() -> int | None:
    """Bytes glibc's malloc has handed out and not had back, every thread's arena and mmapped block
    (``mallinfo2``: ``uordblks + hblkhd``); ``None`` off glibc. Every CPU tensor's storage is in it
    (torch allocates them with ``posix_memalign``), and so is every buffer a writer or an upload
    holds; memory freed but kept by malloc (fragmentation, a heap not trimmed) is not, so training's
    own figure repeats from one step to the next, where its RSS drifts."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


class RssWindow:
    """The peak RSS since the last :meth:`cut`, sampled by a daemon thread, and beside it the peak
    heap in use (:func:`heap_in_use_bytes`; :attr:`heap_peak`, :attr:`cut_heap`) over the same windows.

    :attr:`discount` (until a :meth:`cut` with ``end_discount``): bytes taken off each sample, such as
    the staging buffers the callback allocates in the background after the first step, which belong
    to the checkpoints, not to the plain steps' baseline (read after the RSS: a buffer added in
    between lowers the sample, so the baseline errs low and the extra high; in the heap figure a
    buffer is in use from its allocation, counted a moment later: one buffer either way at most).
    """

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self.heap_peak = heap_in_use_bytes()
        self.cut_heap: int | None = None  # the heap peak of the window the last cut() ended
        self.discount: Callable[[], int] | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            value, heap = rss_bytes(), heap_in_use_bytes()
            with self._lock:
                if self.discount is not None:
                    discount = self.discount()
                    value -= discount
                    heap = None if heap is None else heap - discount
                self.peak = max(self.peak, value)
                if heap is not None and self.heap_peak is not None:
                    self.heap_peak = max(self.heap_peak, heap)
            time.sleep(0.002)  # a sampling period, not synchronisation

    def reset(self) -> int:
        """Start a new window now; the RSS it starts from."""
        with self._lock:
            self.peak, self.heap_peak = rss_bytes(), heap_in_use_bytes()
            return self.peak

    def cut(self, end_discount: bool = False) -> int:
        """The peak RSS of the window that ends now (its peak heap in use: :attr:`cut_heap`); a new
        window starts (without :attr:`discount` where ``end_discount``)."""
        with self._lock:
            peak, self.peak = self.peak, rss_bytes()
            self.cut_heap, self.heap_peak = self.heap_peak, heap_in_use_bytes()
            if end_discount:
                self.discount = None
            return peak


class HookClock:
    """Seconds spent in a callback's hooks, by the step they belong to (set :attr:`step` first)."""

    def __init__(self, profile_every: int | None = None) -> None:
        self.step: int | None = None
        self.seconds: dict[int, float] = defaultdict(float)
        # The calling thread's CPU time in the same hooks: what another process's load does not stretch.
        self.cpu_seconds: dict[int, float] = defaultdict(float)
        # SPOT_BENCH_PROFILE=path: cProfile the hooks of every ``profile_every``-th step into path.
        self.profile_path = os.environ.get("SPOT_BENCH_PROFILE")
        self.profile_every = profile_every
        self.profiler: Any = None
        if self.profile_path and profile_every:
            import cProfile

            self.profiler = cProfile.Profile()

    def dump_profile(self, rank: int) -> None:
        if self.profiler is not None:
            self.profiler.dump_stats(f"{self.profile_path}.rank{rank}")

    def wrap(self, callback: Any, names: list[str]) -> None:
        for name in names:
            hook = getattr(callback, name)

            @functools.wraps(hook)
            def timed(*args: Any, __hook: Any = hook, **kwargs: Any) -> Any:
                started, cpu_started = time.perf_counter(), time.thread_time()
                profiled = (
                    self.profiler is not None
                    and self.step is not None
                    and self.step % self.profile_every == 0
                )
                try:
                    if profiled:
                        return self.profiler.runcall(__hook, *args, **kwargs)
                    return __hook(*args, **kwargs)
                finally:
                    if self.step is not None:
                        self.seconds[self.step] += time.perf_counter() - started
                        self.cpu_seconds[self.step] += time.thread_time() - cpu_started

            setattr(callback, name, timed)


class Floor:
    """``copy_`` of this rank's tensors into buffers kept for the run."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        # Touched now, so later copies add no resident memory.
        self.buffers = [torch.zeros_like(tensor, device="cpu") for tensor in tensors]
        self.nbytes = sum(buffer.numel() * buffer.element_size() for buffer in self.buffers)
        self.seconds: dict[int, float] = {}
        self.cpu_seconds: dict[int, float] = {}  # the thread's CPU time in the same copies

    def time(self, step: int, tensors: list[torch.Tensor]) -> None:
        started, cpu_started = time.perf_counter(), time.thread_time()
        with torch.no_grad():
            for buffer, tensor in zip(self.buffers, tensors, strict=True):
                buffer.copy_(tensor)
        self.seconds[step] = time.perf_counter() - started
        self.cpu_seconds[step] = time.thread_time() - cpu_started


def dump_heap(label: str) -> None:
    """SPOT_BENCH_HEAP=prefix: glibc's malloc_info (every arena's sizes) and smaps_rollup into prefix.PID."""
    prefix = os.environ.get("SPOT_BENCH_HEAP")
    if not prefix:
        return
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    path = f"{prefix}.{os.getpid()}"
    with open(path, "a") as handle:
        handle.write(
            f"=== {label} rss {rss_bytes() / 1e6:.0f} MB threads {[t.name for t in threading.enumerate()]}\n"
        )
        with open("/proc/self/smaps_rollup") as rollup:
            handle.write(rollup.read())
    stream = libc.fopen(path.encode(), b"a")
    libc.malloc_info(0, stream)
    libc.fclose(stream)


def line_up() -> None:
    """Every rank here before going on: the hooks timed next start together on every rank, so a
    collective inside them waits for the other ranks' checkpoint work only, not for the noise of
    the training step (or of the floor) before it. Called at every step, checkpoint or not."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def local_tensors(parameters: Any, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's local shards (or whole tensors) of every parameter and optimizer tensor."""
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in parameters]
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tensors.append(value.to_local() if hasattr(value, "to_local") else value)
    return [tensor.detach() for tensor in tensors]


def checkpoint_rows(
    clock: HookClock, floor: Floor, every: int, last_step: int
) -> tuple[float, list[dict[str, float]]]:
    """The median hook time of plain steps, and one row per checkpoint (not the last step's, whose
    hooks also wait for the final commit); each row also in the main thread's CPU time (``cpu_ratio``:
    blocked / floor in CPU seconds, which a loaded machine's other processes do not stretch, nor
    does a wait in a collective or for the GIL)."""

    def plain_median(seconds: dict[int, float]) -> float:
        plain = [s for step, s in seconds.items() if step % every and 1 < step < last_step]
        return statistics.median(plain) if plain else 0.0

    plain_s, plain_cpu_s = plain_median(clock.seconds), plain_median(clock.cpu_seconds)
    rows = []
    for step, floor_s in sorted(floor.seconds.items()):
        if step >= last_step or step not in clock.seconds:
            continue
        blocked_s = max(clock.seconds[step] - plain_s, 0.0)
        blocked_cpu_s = max(clock.cpu_seconds[step] - plain_cpu_s, 0.0)
        floor_cpu_s = floor.cpu_seconds[step]
        rows.append({
            "step": step, "blocked_s": blocked_s, "floor_s": floor_s, "ratio": blocked_s / floor_s,
            "blocked_cpu_s": blocked_cpu_s, "floor_cpu_s": floor_cpu_s,
            "cpu_ratio": blocked_cpu_s / floor_cpu_s if floor_cpu_s > 0 else None,
        })  # fmt: skip
    return plain_s, rows
