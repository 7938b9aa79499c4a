"""The framework-neutral half of ``benchmarks/stall.py``: one fit's context, its timings, its settling, its result.

The framework adapters (:mod:`_stall_lightning`, :mod:`_stall_hf`) turn their trainer's hooks into
calls on :class:`StepClock` and :class:`HookMeter`, build a :class:`Setup` per variant, and finish
a fit with :func:`fit_result`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import os
import resource
import shutil
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import torch
from _common import med

FULL_SIZE_FRACTION = 0.95  # a landed checkpoint must hold at least this much of the state
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
WARM_UP_STEPS = 2  # the first steps allocate: not in the step-period baselines


# --------------------------------------------------------------------------------- the state
def linear_stack(width: int, depth: int) -> torch.nn.Sequential:
    """``depth`` × ``Linear(width, width)``: a big state with cheap steps at a tiny batch."""
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))


def depth_for(size_bytes: int, width: int) -> int:
    """Layers so that params + 2 AdamW moments (fp32) come to about ``size_bytes``."""
    return max(1, round(size_bytes / (3 * 4 * (width * width + width))))


def state_bytes(width: int, depth: int) -> int:
    params = depth * (width * width + width)
    tensors = 2 * depth
    return 3 * 4 * params + 4 * tensors  # + one fp32 ``step`` tensor per parameter (AdamW)


@dataclass
class Context:
    """What one fit needs; ``prefix`` is unique to the fit."""

    args: argparse.Namespace
    storage_options: dict[str, Any]
    scratch: Path
    prefix: str  # bucket/key-prefix, no protocol
    depth: int
    state_bytes: int

    @property
    def url(self) -> str:
        return f"s3://{self.prefix}"

    @property
    def ckpt_steps(self) -> list[int]:
        return [self.args.every_n * (i + 1) for i in range(self.args.ckpts)]

    @property
    def max_steps(self) -> int:
        return self.args.every_n * self.args.ckpts

    def fs(self) -> fsspec.AbstractFileSystem:
        fs = fsspec.filesystem("s3", **self.storage_options)
        fs.invalidate_cache()
        return fs

    def model_and_data(self) -> tuple[torch.nn.Sequential, torch.Tensor]:
        """The layer stack and one input row per sample, the same in every fit (seed 0)."""
        torch.manual_seed(0)
        net = linear_stack(self.args.width, self.depth)
        return net, torch.randn(self.max_steps * self.args.batch, self.args.width)


# -------------------------------------------------------------------------------- the result
@dataclass
class Landed:
    """What one fit left in the store."""

    expected: int
    found: int
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.found == self.expected and not self.note


@dataclass
class FitResult:
    """One fit of one variant: per-checkpoint samples (in step order) and the store check."""

    blocked_s: list[float] = field(default_factory=list)
    step_excess_s: list[float] = field(default_factory=list)
    quiet_step_s: float | None = None  # median period of the quiet (settled) steps
    busy_step_s: float | None = None  # median period of the other steps (background work may run)
    parts: dict[str, list[float]] = field(default_factory=dict)
    landed: Landed | None = None  # None: the variant writes nothing remotely
    error: str | None = None
    counts: collections.Counter[str] = field(default_factory=collections.Counter)

    def add(self, key: str, value: float | None) -> None:
        if value is not None:
            self.parts.setdefault(key, []).append(value)


class Recorder:
    """Timings keyed by name, then by global step (a checkpoint hook sees the incremented step)."""

    def __init__(self) -> None:
        self.by_name: dict[str, dict[int, float]] = {}
        self.step = 0
        self.counts: collections.Counter[str] = collections.Counter()

    def record(self, name: str, value: float | None, step: int | None = None) -> None:
        if value is not None:
            self.by_name.setdefault(name, {})[self.step if step is None else step] = value

    def accumulate(self, name: str, value: float) -> None:
        values = self.by_name.setdefault(name, {})
        values[self.step] = values.get(self.step, 0.0) + value

    def at(self, name: str, steps: list[int]) -> list[float]:
        values = self.by_name.get(name, {})
        return [values[s] for s in steps if s in values]


def time_method(obj: Any, attr: str, recorder: Recorder, name: str) -> None:
    """Replace ``obj.attr`` by a wrapper that records its wall time under ``name`` (at the current step)."""
    original = getattr(obj, attr)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            recorder.record(name, time.perf_counter() - started)

    setattr(obj, attr, timed)


# ------------------------------------------------------------------------------ the machine
def cpu_ticks() -> tuple[int, int]:
    """(busy clock ticks of the whole machine, ticks of this process): their difference is other processes."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    ours = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return user + nice + system + irq + softirq + steal, int(ours[11]) + int(ours[12])  # utime + stime


def others_cpu_s(before: tuple[int, int], after: tuple[int, int]) -> float:
    """CPU seconds other processes (and the kernel) used between two :func:`cpu_ticks` readings."""
    return max((after[0] - before[0]) - (after[1] - before[1]), 0) / CLOCK_TICKS


def wait_quiet(
    threshold_cores: float, window_s: float = 0.25, timeout_s: float = 20.0
) -> tuple[float, float]:
    """Wait until other processes use less than ``threshold_cores`` over a window; (waited s, last load)."""
    started = time.perf_counter()
    load = float("inf")
    while time.perf_counter() - started < timeout_s:
        before = cpu_ticks()
        time.sleep(window_s)
        load = others_cpu_s(before, cpu_ticks()) / window_s
        if load < threshold_cores:
            break
    return time.perf_counter() - started, load


class HookMeter:
    """The blocked time of one checkpoint (``start`` → ``stop``), with the process CPU, minor faults, others' CPU.

    ``pause``/``resume``: a checkpoint that blocks the loop in two pieces (HF's staged snapshot at
    ``on_step_end``, its submission at the next hook) counts only the pieces.
    """

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.started: float | None = None
        self._ticks = cpu_ticks()
        self._cpu = 0.0
        self._faults = 0
        self._banked = (0.0, 0.0, 0, 0.0)  # wall, process CPU, minor faults, others' CPU s of earlier pieces
        self._paused = False

    def start(self) -> None:
        self._banked, self._paused = (0.0, 0.0, 0, 0.0), False
        self._rebase()

    def _rebase(self) -> None:
        self._ticks, self._cpu = cpu_ticks(), time.process_time()
        self._faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        self.started = time.perf_counter()

    def _so_far(self) -> tuple[float, float, int, float]:
        wall, cpu, faults, others = self._banked
        if self._paused or self.started is None:
            return self._banked
        return (
            wall + time.perf_counter() - self.started,
            cpu + time.process_time() - self._cpu,
            faults + resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - self._faults,
            others + others_cpu_s(self._ticks, cpu_ticks()),
        )

    def pause(self) -> None:
        if self.started is not None and not self._paused:
            self._banked, self._paused = self._so_far(), True

    def resume(self) -> None:
        if self.started is not None and self._paused:
            self._paused = False
            self._rebase()

    def stop(self, step: int) -> None:
        if self.started is None:
            return
        wall, cpu, faults, others = self._so_far()
        self.started = None
        self.recorder.record("hook", wall, step)
        self.recorder.record("hook: process CPU s", cpu, step)
        self.recorder.record("hook: minor faults (k)", faults / 1e3, step)
        self.recorder.record("hook: others' CPU (cores)", others / max(wall, 1e-3), step)


class RssPeak:
    """This process's resident memory, sampled every ``period_s`` in a thread: the peak since :meth:`mark`.

    ``extra_ratio(nbytes)`` = (peak since the mark − RSS at the mark) / ``nbytes``: with the mark at
    the start of the first checkpoint, the host memory checkpointing added (staging buffers, the
    writer's and the upload's buffers) while training ran on, in units of the state.
    """

    PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, period_s: float = 0.01) -> None:
        self.period_s = period_s
        self.base: int | None = None
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-peak", daemon=True)

    @classmethod
    def rss(cls) -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * cls.PAGE

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.base is not None:
                self.peak = max(self.peak, self.rss())

    def mark(self) -> None:
        if self.base is None:
            self.base = self.peak = self.rss()

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def extra_ratio(self, nbytes: int) -> float | None:
        return None if self.base is None else (self.peak - self.base) / nbytes


class StepClock:
    """Step periods, and the settling before each checkpoint; fed by the adapter at every step start.

    Each checkpoint interval of N steps ends with two *quiet* steps and the checkpoint step. At the
    start of the first quiet step the variant's background work is waited for (``settle``), dirty
    pages are written back (``os.sync``) and the machine is waited on until other processes are
    quiet; none of that is timed. The quiet steps' median period is the step-excess baseline.
    """

    def __init__(self, args: argparse.Namespace, recorder: Recorder, settle: Callable[[], None]) -> None:
        self.every_n = args.every_n
        self.quiet_cores = args.quiet_cores
        self.quiet_timeout_s = args.quiet_timeout
        self.recorder = recorder
        self.settle = settle
        self.period_started: float | None = None
        self.step_ended_at: float | None = None  # HF: "to next step" runs from here
        self.quiet_steps: set[int] = set()

    def close_period(self, completed_step: int) -> None:
        now = time.perf_counter()
        if self.period_started is not None:
            self.recorder.record("period", now - self.period_started, completed_step)
        if self.step_ended_at is not None:
            self.recorder.record("to next step", now - self.step_ended_at, completed_step)
        self.period_started = self.step_ended_at = None

    def step_begins(self, completed_steps: int) -> None:
        """The step ``completed_steps + 1`` starts (the step a checkpoint hook will see)."""
        self.close_period(completed_steps)
        step = completed_steps + 1
        self.recorder.step = step
        phase = step % self.every_n
        if phase == self.every_n - 2:
            self._settle_before(ckpt_step=step + 2)
        if phase in (self.every_n - 2, self.every_n - 1):
            self.quiet_steps.add(step)
        if phase == 0:
            started = time.perf_counter()
            self.settle()  # normally idle already: shows if background work outlived the quiet steps
            self.recorder.record("settle: at checkpoint", time.perf_counter() - started)
            gc.collect()  # no collector pause inside the timed checkpoint step
        self.period_started = time.perf_counter()

    def _settle_before(self, ckpt_step: int) -> None:
        record = functools.partial(self.recorder.record, step=ckpt_step)
        started = time.perf_counter()
        self.settle()
        record("settle: background", time.perf_counter() - started)
        started = time.perf_counter()
        os.sync()
        record("settle: sync", time.perf_counter() - started)
        waited, load = wait_quiet(self.quiet_cores, timeout_s=self.quiet_timeout_s)
        record("settle: quiet wait", waited)
        record("others' load before (cores)", load)


# ------------------------------------------------------------------------------- a variant
@dataclass
class Setup:
    """How one variant checkpoints; ``trainer_options`` and ``timed`` are the adapter's to read."""

    callbacks: list[Any]
    settle: Callable[[], None] = lambda: None
    landed: Callable[[], Landed] | None = None  # runs after fit
    after_fit: list[Callable[[FitResult], None]] = field(default_factory=list)
    around_fit: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    trainer_options: dict[str, Any] = field(default_factory=dict)
    timed: Any = None  # Lightning: the callback whose on_train_batch_end is the blocked time


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    make_setup: Callable[[Context, Recorder], Setup]
    kept: str = "remote"  # where its checkpoints go: "remote" is counted in the bucket; "RAM"/"local" are not


def run_guarded(setup: Setup, fit: Callable[[], None]) -> str | None:
    """Run ``fit`` inside ``setup.around_fit``; a failure is printed and returned, so the other variants still run."""
    try:
        with setup.around_fit():
            fit()
    except Exception as err:  # noqa: BLE001 - a failing variant is reported, the others still run
        traceback.print_exc()
        return f"{type(err).__name__}: {err}"
    return None


def fit_result(
    ctx: Context, recorder: Recorder, clock: StepClock, setup: Setup, error: str | None
) -> FitResult:
    """What the recorder holds, per checkpoint step; then the variant's own additions and its store check."""
    steps = ctx.ckpt_steps
    result = FitResult(error=error, counts=recorder.counts)
    result.blocked_s = recorder.at("hook", steps)
    periods = recorder.by_name.get("period", {})
    warm = {s: v for s, v in periods.items() if s > WARM_UP_STEPS}
    quiet = [v for s, v in warm.items() if s in clock.quiet_steps]
    result.busy_step_s = med([v for s, v in warm.items() if s not in clock.quiet_steps and s not in steps])
    if quiet:
        result.quiet_step_s = statistics.median(quiet)
        result.step_excess_s = [periods[s] - result.quiet_step_s for s in steps if s in periods]
    for name in recorder.by_name:
        if name not in ("hook", "period"):
            for value in recorder.at(name, steps):
                result.add(name, value)
    for after in setup.after_fit:
        after(result)
    if setup.landed is not None:
        try:
            result.landed = setup.landed()
        except Exception as err:  # noqa: BLE001
            result.landed = Landed(len(steps), 0, f"listing failed: {type(err).__name__}: {err}")
    gc.collect()
    return result


# ---------------------------------------------------------------------------- the store check
def _landed(ctx: Context, sizes: dict[str, int], kind: str, extra_check: Callable[[], str]) -> Landed:
    minimum = FULL_SIZE_FRACTION * ctx.state_bytes
    full = sum(1 for size in sizes.values() if size >= minimum)
    short = [f"{name}={size / 1e6:.0f}MB" for name, size in sizes.items() if size < minimum]
    note = "; ".join(filter(None, [f"short {kind}: {', '.join(short)}" if short else "", extra_check()]))
    return Landed(len(ctx.ckpt_steps), full, note)


def landed_objects(ctx: Context, extra_check: Callable[[], str] = lambda: "") -> Landed:
    """Count ``*.ckpt`` objects under the fit's prefix that hold the whole state; name the short ones."""
    objects = ctx.fs().find(ctx.prefix, detail=True)
    sizes = {
        p[len(ctx.prefix) :].lstrip("/"): info["size"] for p, info in objects.items() if p.endswith(".ckpt")
    }
    return _landed(ctx, sizes, "objects", extra_check)


def landed_folders(ctx: Context, extra_check: Callable[[], str] = lambda: "") -> Landed:
    """Count folders right under the fit's prefix whose objects together hold the whole state."""
    sizes: collections.Counter[str] = collections.Counter()
    for path, info in ctx.fs().find(ctx.prefix, detail=True).items():
        rel = path[len(ctx.prefix) :].lstrip("/")
        if "/" in rel and not rel.startswith("."):  # .spot-attempts: the run's attempt records
            sizes[rel.split("/", 1)[0]] += info["size"]
    return _landed(ctx, sizes, "folders", extra_check)


# ------------------------------------------------------------------------- the spot variants
def spot_options(ctx: Context) -> dict[str, Any]:
    """The callback's arguments, the same for both frameworks."""
    return {
        "dirpath": ctx.url,
        "interval": None,
        "every_n_steps": ctx.args.every_n,
        "keep_last": 0,  # keep all, so the bucket listing can count them
        "scratch_dir": str(ctx.scratch / "spot-scratch"),
        "storage_options": ctx.storage_options,
        "preemption": [],
    }


def spot_setup(
    ctx: Context, callback: Any, count_landed: Callable[[Context, Callable[[], str]], Landed]
) -> Setup:
    """A spot callback's variant: settle = wait for the commit; the background records; every step committed."""
    engine = callback.engine
    records: list[Any] = []
    new_records = engine.new_records

    def tee_records() -> list[Any]:  # the callback reads them once; keep a copy for the report
        fresh = new_records()
        records.extend(fresh)
        return fresh

    engine.new_records = tee_records

    def committed() -> str:
        steps = sorted(info.step for info in callback.store.committed())
        return "" if steps == ctx.ckpt_steps else f"committed steps {steps}, expected {ctx.ckpt_steps}"

    def after_fit(result: FitResult) -> None:
        for record in records:
            result.add("bg write_s", record.write_s)
            result.add("bg upload_s", record.upload_s)
        shutil.rmtree(engine.scratch_root, ignore_errors=True)

    return Setup(
        callbacks=[callback],
        timed=callback,
        settle=lambda: engine.wait_for_commit(),
        landed=lambda: count_landed(ctx, committed),
        after_fit=[after_fit],
    )


def record_stall(engine: Any, attr: str, recorder: Recorder) -> None:
    """After each ``engine.<attr>`` call, record the engine's own ``last_stall_s`` at the call's step."""
    original = getattr(engine, attr)

    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            recorder.record("engine.last_stall_s", engine.last_stall_s)

    setattr(engine, attr, recorded)


@contextlib.contextmanager
def patched(obj: Any, attr: str, value: Any) -> Iterator[None]:
    original = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, original)
