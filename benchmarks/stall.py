"""Benchmark: how long the Lightning training loop is blocked per checkpoint, vs copying the state in RAM.

A ~600 MB training state (a stack of ``Linear(width, width)`` layers, fp32, AdamW: parameters +
two moments) is trained on CPU with a tiny batch and checkpointed every ``--every-n`` steps to a
moto S3 server on loopback. Variants, each a fresh model and ``Trainer`` per fit:

* ``floor-clone`` -- the floor: ``clone()`` of every tensor of the model ``state_dict`` and of the
  optimizer state, in RAM (the previous snapshot is dropped first); nothing is written;
* ``floor-copy`` -- reference only: ``copy_`` of the same tensors into buffers kept between
  checkpoints (a memcpy bound; allocation-free);
* ``spot`` -- ``SpotCheckpoint(every_n_steps=N)``: snapshot in the loop, serialize + upload in
  the background;
* ``mc-sync`` -- ``ModelCheckpoint(dirpath="s3://...", every_n_train_steps=N)`` (s3fs credentials
  from ``AWS_*`` environment variables);
* ``mc-async`` -- the same with ``Trainer(plugins=[AsyncCheckpointIO()])``.

**Blocked time** = wall time inside the checkpointing callback's ``on_train_batch_end`` on the
checkpoint steps (the hook is wrapped on the instance, so it is timed where Lightning calls it),
with the process CPU time, minor page faults and the CPU other processes used meanwhile. Each
interval of N steps ends with two *quiet* steps and the checkpoint step: before them (untimed) the
previous checkpoint's background work (upload, async write) is waited for, dirty pages are synced
and the machine is waited on (up to ``--quiet-timeout``) until other processes are quiet, so each
checkpoint starts from an idle pipeline, as with realistic (minutes-long) intervals. Cross-check:
"step excess" = checkpoint step period − median quiet step period. For ``spot`` the hook is split
into ``dump_checkpoint`` / ``StagingArea.stage`` (tensor copies vs deep copies of other leaves,
staging-lock wait) / the rest. After each fit the bucket is listed: every remote variant must
have left ``--ckpts`` full-size ``*.ckpt`` objects (and, for ``spot``, as many committed
manifests); otherwise the variant is flagged. The prefix is deleted after each fit.

Variants run in rounds, in reverse order on odd rounds, to spread drift and noise. The table
reports medians over all checkpoints of all rounds, the ratio to the ``floor-clone`` median, and
the ratio of the best samples. On a machine other processes load, pass ``--threads 1``: torch's
multi-threaded copies then wait on their slowest thread and vary 10-50×.

Usage::

    python benchmarks/stall.py [--size-mb 600] [--every-n 5] [--ckpts 3] [--rounds 2] [--threads 1]
                               [--variants floor-clone,floor-copy,spot,mc-sync,mc-async] [--no-append]

Adding a variant: write a ``run(ctx) -> FitResult`` (one training run that makes ``ctx.ckpts``
checkpoints) and register it in :data:`VARIANTS`; Lightning variants only need a
``LightningSetup`` factory passed to :func:`lightning_variant`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import logging
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import types
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from spot_callbacks import staging as snapshot
from spot_callbacks.lightning import SpotCheckpoint

try:  # ``python benchmarks/stall.py`` puts this folder on sys.path
    from _common import (
        S3_KEY,
        S3_SECRET,
        append_markdown,
        machine_line,
        markdown_table,
        mem_info_bytes,
        moto_server,
        print_rich_table,
        versions_line,
    )
except ImportError:  # ``python -m benchmarks.stall`` from the repository root
    from benchmarks._common import (
        S3_KEY,
        S3_SECRET,
        append_markdown,
        machine_line,
        markdown_table,
        mem_info_bytes,
        moto_server,
        print_rich_table,
        versions_line,
    )

BENCH_NAME = "stall: training-loop time blocked per checkpoint (Lightning, moto S3)"
TARGET_RATIO = 1.5
TARGET = f"Target: SpotCheckpoint blocked time ≤ {TARGET_RATIO}× the floor (in-RAM clone of the same state)"
FLOOR = "floor-clone"
BUCKET = "spot-bench-stall"
FULL_SIZE_FRACTION = 0.95  # a landed checkpoint object must hold at least this much of the state


# --------------------------------------------------------------------------------------- model
class StallModel(pl.LightningModule):
    """``depth`` × ``Linear(width, width)``; AdamW. Big state, cheap steps with a tiny batch."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


def depth_for(size_bytes: int, width: int) -> int:
    """Layers so that params + 2 AdamW moments (fp32) come to about ``size_bytes``."""
    return max(1, round(size_bytes / (3 * 4 * (width * width + width))))


def state_bytes(width: int, depth: int) -> int:
    params = depth * (width * width + width)
    tensors = 2 * depth
    return 3 * 4 * params + 4 * tensors  # + one fp32 ``step`` tensor per parameter (AdamW)


def train_state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """The tensors a checkpoint must hold: model ``state_dict`` + every optimizer's state."""
    return {"model": pl_module.state_dict(), "optimizers": [opt.state_dict() for opt in trainer.optimizers]}


# -------------------------------------------------------------------------------- measurement
@dataclass
class Context:
    """What one fit needs; ``prefix`` is unique to the fit."""

    args: argparse.Namespace
    endpoint: str
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


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> tuple[int, int]:
    """(busy clock ticks of the whole machine, ticks of this process): their difference is other processes."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    ours = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return user + nice + system + irq + softirq + steal, int(ours[11]) + int(ours[12])  # utime + stime


def others_cpu_s(before: tuple[int, int], after: tuple[int, int]) -> float:
    """CPU seconds other processes (and the kernel) used between two :func:`cpu_ticks` readings."""
    return max((after[0] - before[0]) - (after[1] - before[1]), 0) / CLOCK_TICKS


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


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


class Probe(pl.Callback):
    """First in the callback list: step periods, settling before checkpoints, the hook timer.

    Each checkpoint interval of N steps ends with two *quiet* steps and the checkpoint step. At the
    start of the first quiet step the variant's background work is waited for (``settle``), dirty
    pages are written back (``os.sync``) and the machine is waited on until other processes are
    quiet; none of that is timed. The quiet steps' median period is the step-excess baseline.
    """

    def __init__(
        self,
        every_n: int,
        recorder: Recorder,
        settle: Callable[[pl.Trainer], None],
        quiet_cores: float,
        quiet_timeout_s: float,
    ) -> None:
        self.every_n = every_n
        self.recorder = recorder
        self.settle = settle
        self.quiet_cores = quiet_cores
        self.quiet_timeout_s = quiet_timeout_s
        self.period_started: float | None = None
        self.quiet_steps: set[int] = set()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Every Lightning checkpoint path goes through these two; instance attributes win.
        time_method(trainer._checkpoint_connector, "dump_checkpoint", self.recorder, "dump_checkpoint")
        time_method(trainer.strategy.checkpoint_io, "save_checkpoint", self.recorder, "checkpoint_io.save")

    def _close_period(self, trainer: pl.Trainer) -> None:
        if self.period_started is not None:
            self.recorder.record("period", time.perf_counter() - self.period_started, trainer.global_step)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._close_period(trainer)
        step = trainer.global_step + 1  # the step this batch completes; checkpoint hooks see it
        self.recorder.step = step
        ckpt_step = -(-step // self.every_n) * self.every_n
        if step % self.every_n == self.every_n - 2:
            started = time.perf_counter()
            self.settle(trainer)
            self.recorder.record("settle: background", time.perf_counter() - started, ckpt_step)
            started = time.perf_counter()
            os.sync()
            self.recorder.record("settle: sync", time.perf_counter() - started, ckpt_step)
            waited, load = wait_quiet(self.quiet_cores, timeout_s=self.quiet_timeout_s)
            self.recorder.record("settle: quiet wait", waited, ckpt_step)
            self.recorder.record("others' load before (cores)", load, ckpt_step)
        if step % self.every_n in (self.every_n - 2, self.every_n - 1):
            self.quiet_steps.add(step)
        if step % self.every_n == 0:
            started = time.perf_counter()
            self.settle(trainer)  # normally idle already: shows if background work outlived the quiet steps
            self.recorder.record("settle: at checkpoint", time.perf_counter() - started)
            gc.collect()  # no collector pause inside the timed checkpoint step
        self.period_started = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_period(trainer)
        self.period_started = None

    def time_hook(self, callback: pl.Callback) -> None:
        """Time ``callback.on_train_batch_end`` as Lightning calls it (the blocked time), with CPU diagnostics."""
        original = callback.on_train_batch_end
        recorder = self.recorder

        def on_train_batch_end(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
            ticks = cpu_ticks()
            cpu = time.process_time()
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            started = time.perf_counter()
            try:
                original(trainer, *args, **kwargs)
            finally:
                wall = time.perf_counter() - started
                step = trainer.global_step
                recorder.record("hook", wall, step)
                recorder.record("hook: process CPU s", time.process_time() - cpu, step)
                recorder.record(
                    "hook: minor faults (k)",
                    (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults) / 1e3,
                    step,
                )
                recorder.record(
                    "hook: others' CPU (cores)", others_cpu_s(ticks, cpu_ticks()) / max(wall, 1e-9), step
                )

        callback.on_train_batch_end = on_train_batch_end


# --------------------------------------------------------------------------- lightning variants
@dataclass
class LightningSetup:
    """How one Lightning variant checkpoints. ``timed`` is the callback whose hook is the blocked time."""

    callbacks: list[pl.Callback]
    timed: pl.Callback
    plugins: list[Any] = field(default_factory=list)
    enable_checkpointing: bool = True
    settle: Callable[[pl.Trainer], None] = lambda trainer: None
    landed: Callable[[], Landed] | None = None  # runs after fit
    after_fit: Callable[[FitResult], None] = lambda result: None
    around_fit: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


def run_lightning(ctx: Context, make_setup: Callable[[Context, Recorder], LightningSetup]) -> FitResult:
    args = ctx.args
    torch.manual_seed(0)
    model = StallModel(args.width, ctx.depth)
    data = torch.utils.data.TensorDataset(torch.randn(ctx.max_steps * args.batch, args.width))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False, num_workers=0)
    recorder = Recorder()
    setup = make_setup(ctx, recorder)
    probe = Probe(args.every_n, recorder, setup.settle, args.quiet_cores, args.quiet_timeout)
    probe.time_hook(setup.timed)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=ctx.max_steps,
        max_epochs=1,
        callbacks=[probe, *setup.callbacks],
        plugins=setup.plugins or None,
        enable_checkpointing=setup.enable_checkpointing,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(ctx.scratch / "lightning"),
    )
    result = FitResult()
    try:
        with setup.around_fit():
            trainer.fit(model, loader)
    except Exception as err:  # noqa: BLE001 - a failing variant is reported, the others still run
        result.error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    steps = ctx.ckpt_steps
    result.blocked_s = recorder.at("hook", steps)
    periods = recorder.by_name.get("period", {})
    quiet = [v for s, v in periods.items() if s in probe.quiet_steps and s > 2]  # the first steps allocate
    busy = [v for s, v in periods.items() if s not in probe.quiet_steps and s not in steps and s > 2]
    result.busy_step_s = med(busy)
    if quiet:
        result.quiet_step_s = statistics.median(quiet)
        result.step_excess_s = [periods[s] - result.quiet_step_s for s in steps if s in periods]
    for name in recorder.by_name:
        if name not in ("hook", "period"):
            for value in recorder.at(name, steps):
                result.add(name, value)
    result.counts = recorder.counts
    setup.after_fit(result)
    if setup.landed is not None:
        try:
            result.landed = setup.landed()
        except Exception as err:  # noqa: BLE001
            result.landed = Landed(len(steps), 0, f"listing failed: {type(err).__name__}: {err}")
    del trainer, model, setup, probe
    gc.collect()
    return result


def list_full_checkpoints(ctx: Context) -> tuple[int, list[str]]:
    """Count ``*.ckpt`` objects under the fit's prefix that hold the whole state; name the short ones."""
    objects = ctx.fs().find(ctx.prefix, detail=True)
    full, short = 0, []
    for path, info in objects.items():
        if path.endswith(".ckpt"):
            if info["size"] >= FULL_SIZE_FRACTION * ctx.state_bytes:
                full += 1
            else:
                short.append(f"{path.rsplit('/', 1)[-1]}={info['size'] / 1e6:.0f}MB")
    return full, short


def remote_landed(ctx: Context, extra_check: Callable[[], str] = lambda: "") -> Landed:
    found, short = list_full_checkpoints(ctx)
    note = "; ".join(filter(None, [f"short objects: {', '.join(short)}" if short else "", extra_check()]))
    return Landed(len(ctx.ckpt_steps), found, note)


class FloorCallback(pl.Callback):
    """At checkpoint steps, snapshot the training state in RAM: ``clone()`` (or ``copy_`` into kept buffers)."""

    def __init__(self, every_n: int, reuse_buffers: bool) -> None:
        self.every_n = every_n
        self.reuse_buffers = reuse_buffers
        self.snapshot: Any = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every_n:
            return
        state = train_state(trainer, pl_module)
        if not self.reuse_buffers:
            self.snapshot = None  # drop the previous snapshot first: one copy at a time
            self.snapshot = apply_to_collection(state, torch.Tensor, lambda t: t.detach().clone())
            return
        if self.snapshot is None:
            self.snapshot = apply_to_collection(state, torch.Tensor, lambda t: torch.empty_like(t))
        flat_src, flat_dst = [], []
        apply_to_collection(state, torch.Tensor, flat_src.append)
        apply_to_collection(self.snapshot, torch.Tensor, flat_dst.append)
        for dst, src in zip(flat_dst, flat_src, strict=True):
            dst.copy_(src)


def floor_setup(reuse_buffers: bool) -> Callable[[Context, Recorder], LightningSetup]:
    def make(ctx: Context, recorder: Recorder) -> LightningSetup:
        floor = FloorCallback(ctx.args.every_n, reuse_buffers)
        return LightningSetup(callbacks=[floor], timed=floor, enable_checkpointing=False)

    return make


def spot_setup(ctx: Context, recorder: Recorder) -> LightningSetup:
    ckpt = SpotCheckpoint(
        dirpath=ctx.url,
        interval=None,
        every_n_steps=ctx.args.every_n,
        keep_last=0,  # keep all, so the bucket listing can count them
        scratch_dir=str(ctx.scratch / "spot-scratch"),
        storage_options=ctx.storage_options,
        preemption=[],
    )
    engine = ckpt.engine
    time_method(engine, "save_state", recorder, "engine.save_state")
    time_method(engine.staging, "stage", recorder, "staging.stage")
    original_save_state = engine.save_state

    def save_state(*args: Any, **kwargs: Any) -> float:
        stall = original_save_state(*args, **kwargs)
        recorder.record("engine.last_stall_s", engine.last_stall_s)
        recorder.record("staging lock wait", engine.staging.last_wait_s)
        return stall

    engine.save_state = save_state

    def committed() -> str:
        steps = sorted(info.step for info in ckpt.store.committed())
        return "" if steps == ctx.ckpt_steps else f"committed steps {steps}, expected {ctx.ckpt_steps}"

    def after_fit(result: FitResult) -> None:
        persister = engine._persister  # the records: SpotCheckpoint reported them already (new_records)
        for record in persister.records if persister is not None else []:
            result.add("bg write_s", record.write_s)
            result.add("bg upload_s", record.upload_s)
        for step in ctx.ckpt_steps:
            parts = [
                recorder.by_name.get(k, {}).get(step)
                for k in ("hook", "dump_checkpoint", "engine.save_state")
            ]
            if None not in parts:
                result.add("hook − dump − save_state", parts[0] - parts[1] - parts[2])
        shutil.rmtree(engine.scratch_root, ignore_errors=True)

    return LightningSetup(
        callbacks=[ckpt],
        timed=ckpt,
        settle=lambda trainer: engine.wait_for_commit(),
        landed=lambda: remote_landed(ctx, committed),
        after_fit=after_fit,
        around_fit=functools.partial(profile_staging, recorder),
    )


@contextlib.contextmanager
def profile_staging(recorder: Recorder) -> Iterator[None]:
    """Split ``StagingArea.stage`` into tensor copies and deep copies of other leaves (patched while a fit runs)."""
    context_cls = snapshot._StageContext
    copy_tensor, copy_module = context_cls.copy_tensor, snapshot.copy

    def timed_copy_tensor(self: Any, tensor: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return copy_tensor(self, tensor, path)
        finally:
            recorder.accumulate("stage: tensor copies", time.perf_counter() - started)

    def timed_deepcopy(value: Any, memo: Any = None) -> Any:
        started = time.perf_counter()
        try:
            return copy_module.deepcopy(value, memo)
        finally:
            recorder.accumulate("stage: deepcopy of other leaves", time.perf_counter() - started)
            recorder.counts[f"deepcopy {type(value).__name__}"] += 1

    context_cls.copy_tensor = timed_copy_tensor
    snapshot.copy = types.SimpleNamespace(deepcopy=timed_deepcopy, copy=copy_module.copy)
    try:
        yield
    finally:
        context_cls.copy_tensor = copy_tensor
        snapshot.copy = copy_module


def model_checkpoint_setup(asynchronous: bool) -> Callable[[Context, Recorder], LightningSetup]:
    def settle(trainer: pl.Trainer) -> None:
        # AsyncCheckpointIO has one worker thread: a no-op queued behind the save finishes after it.
        executor = getattr(trainer.strategy.checkpoint_io, "_executor", None)
        if executor is not None:
            executor.submit(lambda: None).result()

    def make(ctx: Context, recorder: Recorder) -> LightningSetup:
        ckpt = ModelCheckpoint(dirpath=ctx.url, every_n_train_steps=ctx.args.every_n, save_top_k=-1)
        return LightningSetup(
            callbacks=[ckpt],
            timed=ckpt,
            plugins=[AsyncCheckpointIO()] if asynchronous else [],
            settle=settle,
            landed=lambda: remote_landed(ctx),
        )

    return make


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    run: Callable[[Context], FitResult]
    remote: bool = True


def lightning_variant(
    name: str,
    description: str,
    make_setup: Callable[[Context, Recorder], LightningSetup],
    remote: bool = True,
) -> Variant:
    return Variant(name, description, functools.partial(run_lightning, make_setup=make_setup), remote)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        lightning_variant(
            FLOOR, "clone() of model state_dict + optimizer state, in RAM", floor_setup(False), remote=False
        ),
        lightning_variant(
            "floor-copy",
            "copy_ into buffers kept across checkpoints (reference)",
            floor_setup(True),
            remote=False,
        ),
        lightning_variant("spot", "SpotCheckpoint(every_n_steps=N), background persist", spot_setup),
        lightning_variant(
            "mc-sync", "ModelCheckpoint(dirpath=s3://…, every_n_train_steps=N)", model_checkpoint_setup(False)
        ),
        lightning_variant("mc-async", "ModelCheckpoint + AsyncCheckpointIO()", model_checkpoint_setup(True)),
    )
}


# ------------------------------------------------------------------------- Hugging Face group
# Selected with --variants hf-spot,hf-local,hf-sync (never mixed with the Lightning variants above).
# transformers is imported lazily, so the Lightning variants run without it.
HF_REFERENCE = "hf-local"


class HFStallModel(torch.nn.Module):
    """The same ``depth`` × ``Linear(width, width)`` stack as :class:`StallModel`, in the Trainer's calling convention."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))

    def forward(
        self, x: torch.Tensor | None = None, input_ids: Any = None, labels: Any = None
    ) -> dict[str, torch.Tensor]:
        return {"loss": self.net(x).square().mean()}


def hf_probes(
    every_n: int, recorder: Recorder, settle: Callable[[], None], args: argparse.Namespace
) -> tuple[Any, Any]:
    """Two TrainerCallbacks: ``head`` goes first in the callback list, ``tail`` last.

    Blocked time ("hook") = from ``head.on_step_end`` of a checkpoint step to the end of
    ``tail.on_save``: every callback's ``on_step_end`` (the save request), the Trainer's own
    ``_save_checkpoint`` and every ``on_save`` (an upload, for ``hf-sync``). Split into "Trainer
    save" (``tail.on_step_end`` end → ``head.on_save``) and "on_save callbacks". "to next step" =
    from ``head.on_step_end`` to the next ``on_step_begin`` (or ``on_train_end``): the blocked time
    plus what the Trainer does after the save. Step periods are ``on_step_begin`` → next one.
    """
    import transformers

    class Head(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.period_started: float | None = None
            self.step_end_at: float | None = None
            self.quiet_steps: set[int] = set()

        def _close(self, step: int) -> None:
            now = time.perf_counter()
            if self.period_started is not None:
                recorder.record("period", now - self.period_started, step)
            if self.step_end_at is not None:
                recorder.record("to next step", now - self.step_end_at, step)
            self.period_started = self.step_end_at = None

        def on_step_begin(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._close(state.global_step)
            step = state.global_step + 1
            recorder.step = step
            ckpt_step = -(-step // every_n) * every_n
            if step % every_n == every_n - 2:
                started = time.perf_counter()
                settle()
                recorder.record("settle: background", time.perf_counter() - started, ckpt_step)
                started = time.perf_counter()
                os.sync()
                recorder.record("settle: sync", time.perf_counter() - started, ckpt_step)
                waited, load = wait_quiet(args.quiet_cores, timeout_s=args.quiet_timeout)
                recorder.record("settle: quiet wait", waited, ckpt_step)
                recorder.record("others' load before (cores)", load, ckpt_step)
            if step % every_n in (every_n - 2, every_n - 1):
                self.quiet_steps.add(step)
            if step % every_n == 0:
                started = time.perf_counter()
                settle()
                recorder.record("settle: at checkpoint", time.perf_counter() - started)
                gc.collect()
            self.period_started = time.perf_counter()

        def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step_end_at = time.perf_counter()
            tail.ticks, tail.cpu = cpu_ticks(), time.process_time()

        def on_save(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            tail.on_save_at = time.perf_counter()
            if tail.step_end_done_at is not None:
                recorder.record("Trainer save", tail.on_save_at - tail.step_end_done_at, state.global_step)

        def on_train_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._close(state.global_step)

    class Tail(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.step_end_done_at: float | None = None
            self.on_save_at: float | None = None
            self.ticks = cpu_ticks()
            self.cpu = 0.0

        def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step_end_done_at = time.perf_counter()

        def on_save(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            step = state.global_step
            if head.step_end_at is not None:
                wall = now - head.step_end_at
                recorder.record("hook", wall, step)
                recorder.record("hook: process CPU s", time.process_time() - self.cpu, step)
                recorder.record(
                    "hook: others' CPU (cores)", others_cpu_s(self.ticks, cpu_ticks()) / max(wall, 1e-3), step
                )
            if self.on_save_at is not None:
                recorder.record("on_save callbacks", now - self.on_save_at, step)

    head, tail = Head(), Tail()
    return head, tail


@dataclass
class HFSetup:
    """How one HF variant checkpoints: its callbacks, its save_strategy, what to wait for, what to check."""

    callbacks: list[Any]
    save_strategy: str  # "steps" (the Trainer saves every N steps) or "no" (the callback asks)
    settle: Callable[[], None] = lambda: None
    landed: Callable[[], Landed] | None = None
    after_fit: Callable[[FitResult], None] = lambda result: None


def remote_folders_landed(ctx: Context, extra_check: Callable[[], str] = lambda: "") -> Landed:
    """Count folders right under the fit's prefix whose objects together hold the whole state."""
    sizes: dict[str, int] = collections.Counter()
    for path, info in ctx.fs().find(ctx.prefix, detail=True).items():
        rel = path[len(ctx.prefix) :].lstrip("/")
        if "/" in rel:
            sizes[rel.split("/", 1)[0]] += info["size"]
    full = sum(1 for size in sizes.values() if size >= FULL_SIZE_FRACTION * ctx.state_bytes)
    short = [f"{k}={v / 1e6:.0f}MB" for k, v in sizes.items() if v < FULL_SIZE_FRACTION * ctx.state_bytes]
    note = "; ".join(filter(None, [f"short folders: {', '.join(short)}" if short else "", extra_check()]))
    return Landed(len(ctx.ckpt_steps), full, note)


def hf_spot_setup(ctx: Context, recorder: Recorder) -> HFSetup:
    from spot_callbacks.hf import SpotCheckpointCallback

    ckpt = SpotCheckpointCallback(
        dirpath=ctx.url,
        interval=None,
        every_n_steps=ctx.args.every_n,
        keep_last=0,
        scratch_dir=str(ctx.scratch / "spot-scratch"),
        storage_options=ctx.storage_options,
        preemption=[],
    )
    engine = ckpt.engine
    original = engine.save_folder

    def save_folder(step: int, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(step, *args, **kwargs)
        finally:
            recorder.record("engine.last_stall_s", engine.last_stall_s, step)

    engine.save_folder = save_folder

    def committed() -> str:
        steps = sorted(info.step for info in ckpt.store.committed())
        return "" if steps == ctx.ckpt_steps else f"committed steps {steps}, expected {ctx.ckpt_steps}"

    def after_fit(result: FitResult) -> None:
        persister = engine._persister
        for record in persister.records if persister is not None else []:
            result.add("bg upload_s", record.upload_s)
        shutil.rmtree(engine.scratch_root, ignore_errors=True)

    return HFSetup(
        callbacks=[ckpt],
        save_strategy="no",
        settle=lambda: engine.wait_for_commit(),
        landed=lambda: remote_folders_landed(ctx, committed),
        after_fit=after_fit,
    )


def hf_local_setup(ctx: Context, recorder: Recorder) -> HFSetup:
    return HFSetup(callbacks=[], save_strategy="steps")


def hf_sync_setup(ctx: Context, recorder: Recorder) -> HFSetup:
    import transformers

    fs = ctx.fs()

    class SyncUpload(transformers.TrainerCallback):
        def on_save(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            name = f"checkpoint-{state.global_step}"
            started = time.perf_counter()
            fs.put(os.path.join(targs.output_dir, name), f"{ctx.prefix}/{name}", recursive=True)
            recorder.record("s3fs put", time.perf_counter() - started, state.global_step)

    return HFSetup(callbacks=[SyncUpload()], save_strategy="steps", landed=lambda: remote_folders_landed(ctx))


def run_hf(ctx: Context, make_setup: Callable[[Context, Recorder], HFSetup]) -> FitResult:
    import transformers

    args = ctx.args
    torch.manual_seed(0)
    model = HFStallModel(args.width, ctx.depth)
    data = [{"x": row} for row in torch.randn(ctx.max_steps * args.batch, args.width)]
    recorder = Recorder()
    setup = make_setup(ctx, recorder)
    head, tail = hf_probes(args.every_n, recorder, setup.settle, args)
    output_dir = ctx.scratch / f"hf-{uuid.uuid4().hex[:6]}"
    targs = transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=ctx.max_steps,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-5,
        save_strategy=setup.save_strategy,
        save_steps=args.every_n,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=0,
    )
    result = FitResult()
    trainer = None
    try:
        trainer = transformers.Trainer(
            model=model, args=targs, train_dataset=data, callbacks=[head, *setup.callbacks, tail]
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        trainer.train()
    except Exception as err:  # noqa: BLE001 - a failing variant is reported, the others still run
        result.error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    steps = ctx.ckpt_steps
    result.blocked_s = recorder.at("hook", steps)
    periods = recorder.by_name.get("period", {})
    quiet = [v for s, v in periods.items() if s in head.quiet_steps and s > 2]
    busy = [v for s, v in periods.items() if s not in head.quiet_steps and s not in steps and s > 2]
    result.busy_step_s = med(busy)
    if quiet:
        result.quiet_step_s = statistics.median(quiet)
        result.step_excess_s = [periods[s] - result.quiet_step_s for s in steps if s in periods]
    for name in recorder.by_name:
        if name not in ("hook", "period"):
            for value in recorder.at(name, steps):
                result.add(name, value)
    setup.after_fit(result)
    if setup.landed is not None:
        try:
            result.landed = setup.landed()
        except Exception as err:  # noqa: BLE001
            result.landed = Landed(len(steps), 0, f"listing failed: {type(err).__name__}: {err}")
    shutil.rmtree(output_dir, ignore_errors=True)
    del trainer, model, setup, head, tail
    gc.collect()
    return result


HF_VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "hf-spot",
            "SpotCheckpointCallback(every_n_steps=N, dirpath=s3://…): Trainer save + background upload",
            functools.partial(run_hf, make_setup=hf_spot_setup),
        ),
        Variant(
            HF_REFERENCE,
            'Trainer\'s own save (save_strategy="steps", save_steps=N), local only',
            functools.partial(run_hf, make_setup=hf_local_setup),
            remote=False,
        ),
        Variant(
            "hf-sync",
            "Trainer save + a TrainerCallback whose on_save fs.put's checkpoint-N to S3 (s3fs)",
            functools.partial(run_hf, make_setup=hf_sync_setup),
        ),
    )
}
ALL_VARIANTS: dict[str, Variant] = {**VARIANTS, **HF_VARIANTS}


# -------------------------------------------------------------------------------------- report
@dataclass
class Summary:
    variant: Variant
    fits: list[FitResult]

    def values(self, attr: str) -> list[float]:
        return [v for fit in self.fits for v in getattr(fit, attr)]

    def part(self, key: str) -> list[float]:
        return [v for fit in self.fits for v in fit.parts.get(key, [])]

    @property
    def blocked(self) -> list[float]:
        return self.values("blocked_s")

    @property
    def first_blocked(self) -> list[float]:
        return [fit.blocked_s[0] for fit in self.fits if fit.blocked_s]

    @property
    def later_blocked(self) -> list[float]:
        return [v for fit in self.fits for v in fit.blocked_s[1:]]

    def landed_cell(self, ckpts: int) -> str:
        errors = [fit.error for fit in self.fits if fit.error]
        if errors:
            return f"FAILED: {errors[0][:60]}"
        if not self.variant.remote:
            return "n/a (RAM)" if self.variant.name in VARIANTS else "n/a (local)"
        found = sum(fit.landed.found if fit.landed else 0 for fit in self.fits)
        expected = sum(fit.landed.expected if fit.landed else ckpts for fit in self.fits)
        notes = [fit.landed.note for fit in self.fits if fit.landed and fit.landed.note]
        mark = "ok" if found == expected and not notes else "MISSING"
        return f"{found}/{expected} {mark}" + (f" ({notes[0][:60]})" if notes else "")

    @property
    def flagged(self) -> bool:
        if any(fit.error for fit in self.fits):
            return True
        if not self.variant.remote:
            return False
        return not all(fit.landed is not None and fit.landed.ok for fit in self.fits)


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "–" if value is None else format(value, spec)


HEADERS = (
    "variant",
    "landed",
    "blocked s (median)",
    "× floor",
    "min–max s",
    "min × floor",
    "first ckpt s",
    "later ckpts s",
    "engine.last_stall_s",
    "step excess s",
    "others' CPU in hook (cores)",
    "quiet step s",
    "step during bg work s",
)


def rows_for(summaries: list[Summary], ckpts: int) -> list[list[str]]:
    floor = next((s for s in summaries if s.variant.name == FLOOR), None)
    floor_median = med(floor.blocked) if floor else None
    floor_min = min(floor.blocked) if floor and floor.blocked else None
    rows = []
    for s in summaries:
        blocked = med(s.blocked)
        ratio = blocked / floor_median if blocked is not None and floor_median else None
        rows.append(
            [
                s.variant.name,
                s.landed_cell(ckpts),
                fmt(blocked),
                "–" if ratio is None else f"{ratio:.2f}×",
                f"{min(s.blocked):.3f}–{max(s.blocked):.3f}" if s.blocked else "–",
                f"{min(s.blocked) / floor_min:.2f}×" if s.blocked and floor_min else "–",
                fmt(med(s.first_blocked)),
                fmt(med(s.later_blocked)),
                fmt(med(s.part("engine.last_stall_s"))),
                fmt(med(s.values("step_excess_s"))),
                fmt(med(s.part("hook: others' CPU (cores)")), ".2f"),
                fmt(med([f.quiet_step_s for f in s.fits if f.quiet_step_s is not None])),
                fmt(med([f.busy_step_s for f in s.fits if f.busy_step_s is not None])),
            ]
        )
    return rows


BREAKDOWN_KEYS = (
    "hook: process CPU s",
    "hook: minor faults (k)",
    "dump_checkpoint",
    "checkpoint_io.save",
    "engine.save_state",
    "staging.stage",
    "stage: tensor copies",
    "stage: deepcopy of other leaves",
    "staging lock wait",
    "hook − dump − save_state",
    "settle: background",
    "settle: sync",
    "settle: quiet wait",
    "others' load before (cores)",
    "settle: at checkpoint",
    "bg write_s",
    "bg upload_s",
)


def breakdown_lines(summaries: list[Summary]) -> list[str]:
    lines = []
    for s in summaries:
        parts = [f"{key} {fmt(med(s.part(key)))}" for key in BREAKDOWN_KEYS if s.part(key)]
        counts: collections.Counter[str] = collections.Counter()
        for fit in s.fits:
            counts.update(fit.counts)
        checkpoints = max(len(s.blocked), 1)
        if counts:
            parts.append(
                "per checkpoint: " + ", ".join(f"{n / checkpoints:g} × {k}" for k, n in counts.most_common())
            )
        if parts:
            lines.append(
                f"- `{s.variant.name}` (medians per checkpoint, s unless noted): " + "; ".join(parts)
            )
    return lines


def verdict(summaries: list[Summary]) -> str:
    by_name = {s.variant.name: s for s in summaries}
    if (
        FLOOR not in by_name
        or "spot" not in by_name
        or not by_name[FLOOR].blocked
        or not by_name["spot"].blocked
    ):
        return f"{TARGET}: not measured in this run."
    ratio = med(by_name["spot"].blocked) / med(by_name[FLOOR].blocked)
    met = "MET" if ratio <= TARGET_RATIO and not by_name["spot"].flagged else "NOT MET"
    return f"{TARGET}: **{met}** ({ratio:.2f}×)."


def markdown_section(
    summaries: list[Summary],
    args: argparse.Namespace,
    depth: int,
    nbytes: int,
    env: tuple[str, str],
    wall_s: float,
    loadavg: tuple[str, str],
) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    flagged = [s.variant.name for s in summaries if s.flagged]
    lines = [
        f"## {BENCH_NAME}",
        "",
        f"- Date: {now}",
        f"- Machine: {env[0]}",
        f"- Versions: {env[1]}",
        f"- Command: `python benchmarks/stall.py --size-mb {args.size_mb:g} --width {args.width} "
        f"--batch {args.batch} --every-n {args.every_n} --ckpts {args.ckpts} --rounds {args.rounds} "
        f"--quiet-cores {args.quiet_cores:g} --quiet-timeout {args.quiet_timeout:g} "
        + (f"--threads {args.threads} " if args.threads else "")
        + f"--variants {','.join(args.variants)}` ({wall_s:.0f}s); torch threads {torch.get_num_threads()}",
        f"- State: {depth} × Linear({args.width}, {args.width}) fp32 + AdamW moments = {nbytes / 1e6:.0f} MB; "
        f"CPU, batch {args.batch}; a checkpoint every {args.every_n} steps, {args.ckpts} per fit, "
        f"{args.rounds} rounds (order reversed on odd rounds) → {args.ckpts * args.rounds} checkpoints per variant. "
        "S3 is moto on loopback.",
        "- Blocked = wall time inside the checkpoint callback's `on_train_batch_end` on checkpoint steps "
        "(hook wrapped on the instance). Each interval ends with two quiet steps and the checkpoint step: "
        "before them the previous checkpoint's background work is waited for, dirty pages are synced and "
        f"other processes are waited on until they use < {args.quiet_cores:g} cores (up to {args.quiet_timeout:g} s; "
        "all untimed). "
        "Step excess = checkpoint step period − median quiet step period. Others' CPU = CPU other "
        "processes used during the hook (/proc/stat, 10 ms ticks: coarse for short hooks), in cores. "
        "Min × floor = best sample / best floor sample (the least disturbed pair). "
        "First ckpt = first of each fit (pays one-off allocations).",
        f"- Load average (1/5/15 min) at start: {loadavg[0]}; at end: {loadavg[1]}.",
        *([f"- Note: {args.note}"] if args.note else []),
        "",
        *markdown_table(HEADERS, rows_for(summaries, args.ckpts)),
        "",
        "Where the time goes:",
        "",
        *breakdown_lines(summaries),
        "",
    ]
    if flagged:
        lines += [f"**Flagged (error or checkpoints missing in the bucket): {', '.join(flagged)}**", ""]
    lines += [verdict(summaries), ""]
    return "\n".join(lines) + "\n"


HF_BENCH_NAME = "stall: training-loop time blocked per checkpoint (Hugging Face Trainer, moto S3)"
HF_HEADERS = (
    "variant",
    "landed",
    "blocked s (median)",
    f"× {HF_REFERENCE}",
    "min–max s",
    "first ckpt s",
    "later ckpts s",
    "Trainer save s",
    "on_save callbacks s",
    "engine.last_stall_s",
    "to next step s",
    "step excess s",
    "quiet step s",
    "step during bg work s",
)
HF_BREAKDOWN_KEYS = (
    "hook: process CPU s",
    "hook: others' CPU (cores)",
    "s3fs put",
    "settle: background",
    "settle: sync",
    "settle: quiet wait",
    "others' load before (cores)",
    "settle: at checkpoint",
    "bg upload_s",
)


def hf_rows_for(summaries: list[Summary], ckpts: int) -> list[list[str]]:
    ref = next((s for s in summaries if s.variant.name == HF_REFERENCE), None)
    ref_median = med(ref.blocked) if ref else None
    rows = []
    for s in summaries:
        blocked = med(s.blocked)
        rows.append(
            [
                s.variant.name,
                s.landed_cell(ckpts),
                fmt(blocked),
                f"{blocked / ref_median:.2f}×" if blocked is not None and ref_median else "–",
                f"{min(s.blocked):.3f}–{max(s.blocked):.3f}" if s.blocked else "–",
                fmt(med(s.first_blocked)),
                fmt(med(s.later_blocked)),
                fmt(med(s.part("Trainer save"))),
                fmt(med(s.part("on_save callbacks"))),
                fmt(med(s.part("engine.last_stall_s"))),
                fmt(med(s.part("to next step"))),
                fmt(med(s.values("step_excess_s"))),
                fmt(med([f.quiet_step_s for f in s.fits if f.quiet_step_s is not None])),
                fmt(med([f.busy_step_s for f in s.fits if f.busy_step_s is not None])),
            ]
        )
    return rows


def hf_breakdown_lines(summaries: list[Summary]) -> list[str]:
    lines = []
    for s in summaries:
        parts = [f"{key} {fmt(med(s.part(key)))}" for key in HF_BREAKDOWN_KEYS if s.part(key)]
        if parts:
            lines.append(
                f"- `{s.variant.name}` (medians per checkpoint, s unless noted): " + "; ".join(parts)
            )
    return lines


def hf_markdown_section(
    summaries: list[Summary],
    args: argparse.Namespace,
    depth: int,
    nbytes: int,
    env: tuple[str, str],
    wall_s: float,
    loadavg: tuple[str, str],
) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    flagged = [s.variant.name for s in summaries if s.flagged]
    lines = [
        f"## {HF_BENCH_NAME}",
        "",
        f"- Date: {now}",
        f"- Machine: {env[0]}",
        f"- Versions: {env[1]}",
        f"- Command: `python benchmarks/stall.py --size-mb {args.size_mb:g} --width {args.width} "
        f"--batch {args.batch} --every-n {args.every_n} --ckpts {args.ckpts} --rounds {args.rounds} "
        f"--quiet-cores {args.quiet_cores:g} --quiet-timeout {args.quiet_timeout:g} "
        + (f"--threads {args.threads} " if args.threads else "")
        + f"--variants {','.join(args.variants)}` ({wall_s:.0f}s); torch threads {torch.get_num_threads()}",
        f"- State: {depth} × Linear({args.width}, {args.width}) fp32 in a plain `nn.Module` "
        '(`forward(x=None, ...)` returns `{"loss": ...}`) + the Trainer\'s AdamW moments = '
        f"{nbytes / 1e6:.0f} MB; `Trainer(use_cpu=True, report_to=[], dataloader_num_workers=0)`, batch "
        f"{args.batch}; a checkpoint every {args.every_n} steps, {args.ckpts} per fit, {args.rounds} round(s) "
        f"→ {args.ckpts * args.rounds} checkpoints per variant. The Trainer writes `checkpoint-N/` "
        "(model.safetensors + optimizer.pt + scheduler/RNG/trainer state) to a local output_dir. S3 is moto on loopback.",
        "- Variants: " + "; ".join(f"`{s.variant.name}` = {s.variant.description}" for s in summaries) + ".",
        "- Blocked = wall time from the first callback's `on_step_end` on a checkpoint step to the end of "
        "the last callback's `on_save`: the save request, the Trainer's `_save_checkpoint` and every "
        "`on_save` (for `hf-sync`, the upload). Trainer save = end of the last `on_step_end` → first "
        "`on_save`; on_save callbacks = first → end of last `on_save`. To next step = first `on_step_end` → "
        "next `on_step_begin` (or `on_train_end`), i.e. blocked + the Trainer's own work after the save. "
        "Step excess = checkpoint step period (`on_step_begin` → next) − median quiet step period. "
        "As in the Lightning section, each interval ends with two quiet steps and the checkpoint step; before "
        "them the previous background upload is waited for, dirty pages are synced and other processes are "
        f"waited on until they use < {args.quiet_cores:g} cores (up to {args.quiet_timeout:g} s; all untimed). "
        "engine.last_stall_s = SpotCheckpointCallback's own measure (save request → its on_save).",
        f"- Load average (1/5/15 min) at start: {loadavg[0]}; at end: {loadavg[1]}.",
        *([f"- Note: {args.note}"] if args.note else []),
        "",
        *markdown_table(HF_HEADERS, hf_rows_for(summaries, args.ckpts)),
        "",
        "Where the time goes:",
        "",
        *hf_breakdown_lines(summaries),
        "",
    ]
    if flagged:
        lines += [f"**Flagged (error or checkpoints missing in the bucket): {', '.join(flagged)}**", ""]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size-mb", type=float, default=600.0, help="training state size in MB (default 600)"
    )
    parser.add_argument("--width", type=int, default=1024, help="Linear layer width (default 1024)")
    parser.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    parser.add_argument("--every-n", type=int, default=5, help="steps between checkpoints (default 5)")
    parser.add_argument("--ckpts", type=int, default=3, help="checkpoints per fit (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the variants (default 2)")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"subset of {','.join(VARIANTS)} (Lightning, the default) or of {','.join(HF_VARIANTS)} "
        "(Hugging Face Trainer; needs transformers); the two groups are not mixed",
    )
    parser.add_argument(
        "--quiet-cores",
        type=float,
        default=0.3,
        help="before each checkpoint, wait until other processes use fewer cores than this (default 0.3)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads (default: torch's choice). On a box other processes load, use 1: "
        "multi-threaded copies then wait on their slowest thread and vary 10-50×",
    )
    parser.add_argument("--note", default="", help="a line added to the BENCHMARKS.md section")
    parser.add_argument(
        "--quiet-timeout", type=float, default=5.0, help="longest wait for a quiet machine, s (default 5)"
    )
    parser.add_argument("--scratch", default=tempfile.gettempdir(), help="where the temp folder goes")
    parser.add_argument("--no-append", action="store_true", help="print only; do not append to BENCHMARKS.md")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(args.variants) - set(ALL_VARIANTS)
    if unknown or not args.variants:
        parser.error(
            f"--variants must be a subset of {','.join(ALL_VARIANTS)} (unknown: {', '.join(sorted(unknown))})"
        )
    if args.size_mb <= 0 or min(args.width, args.batch, args.every_n, args.ckpts, args.rounds) < 1:
        parser.error("sizes and counts must be positive")
    args.hf = set(args.variants) <= set(HF_VARIANTS)
    if not args.hf and set(args.variants) & set(HF_VARIANTS):
        parser.error("--variants: run the Lightning and the Hugging Face variants separately")
    if args.every_n < 5:
        parser.error(
            "--every-n must be >= 5 (two quiet baseline steps and steps overlapping background work)"
        )
    return args


def quiet_lightning() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*Checkpoint directory .* exists and is not empty.*")
    warnings.filterwarnings("ignore", message=".*`training_step` returned `None`.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*")


def check_resources(scratch: Path, nbytes: int, args: argparse.Namespace) -> None:
    need = (2 * args.ckpts + 2) * nbytes + 512 * 2**20  # moto's spill files + multipart parts + spot scratch
    free = shutil.disk_usage(scratch).free
    if free < need:
        raise SystemExit(
            f"not enough free disk under {scratch}: {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed"
        )
    avail = mem_info_bytes("MemAvailable")
    if avail is not None and avail < 6 * nbytes:
        print(
            f"warning: only {avail / 1e9:.1f} GB of RAM available for a {nbytes / 1e9:.1f} GB state",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_lightning()
    if args.threads:
        torch.set_num_threads(args.threads)
    dists = ("torch", "transformers" if args.hf else "lightning", "fsspec", "s3fs", "moto", "xxhash")
    env = (machine_line(), versions_line(dists))
    depth = depth_for(int(args.size_mb * 1e6), args.width)
    nbytes = state_bytes(args.width, depth)
    scratch_root = Path(args.scratch)
    check_resources(scratch_root, nbytes, args)
    scratch = Path(tempfile.mkdtemp(prefix="spot-bench-stall-", dir=scratch_root))
    began = time.perf_counter()
    load_start = load_average()
    fits: dict[str, list[FitResult]] = {name: [] for name in args.variants}
    try:
        with moto_server(scratch) as endpoint:
            # ModelCheckpoint's s3fs takes its credentials and endpoint from the environment.
            os.environ.update(
                {
                    "AWS_ACCESS_KEY_ID": S3_KEY,
                    "AWS_SECRET_ACCESS_KEY": S3_SECRET,
                    "AWS_ENDPOINT_URL": endpoint,
                }
            )
            options = {"key": S3_KEY, "secret": S3_SECRET, "endpoint_url": endpoint}
            fsspec.filesystem("s3", **options).mkdir(BUCKET)
            print(
                f"state: {depth} × Linear({args.width}) + AdamW = {nbytes / 1e6:.0f} MB; "
                f"{args.rounds} rounds × {len(args.variants)} variants × {args.ckpts} checkpoints",
                flush=True,
            )
            for rnd in range(args.rounds):
                order = args.variants if rnd % 2 == 0 else list(reversed(args.variants))
                for name in order:
                    ctx = Context(
                        args,
                        endpoint,
                        options,
                        scratch,
                        f"{BUCKET}/{name}-r{rnd}-{uuid.uuid4().hex[:6]}",
                        depth,
                        nbytes,
                    )
                    started = time.perf_counter()
                    result = ALL_VARIANTS[name].run(ctx)
                    fits[name].append(result)
                    with contextlib.suppress(FileNotFoundError):
                        ctx.fs().rm(ctx.prefix, recursive=True)
                    landed = (
                        ""
                        if result.landed is None
                        else f", landed {result.landed.found}/{result.landed.expected}"
                    )
                    print(
                        f"  round {rnd + 1}/{args.rounds} {name:<11} blocked "
                        + " ".join(f"{v:.3f}" for v in result.blocked_s)
                        + f" s{landed}{' ' + result.landed.note if result.landed and result.landed.note else ''}"
                        + (f" ERROR {result.error}" if result.error else "")
                        + f" ({time.perf_counter() - started:.0f}s)",
                        flush=True,
                    )
        summaries = [Summary(ALL_VARIANTS[name], fits[name]) for name in args.variants]
        wall_s = time.perf_counter() - began
        loadavg = (load_start, load_average())
        print(f"load average at start {loadavg[0]}, at end {loadavg[1]}")
        name = HF_BENCH_NAME if args.hf else BENCH_NAME
        title = f"{name} ({nbytes / 1e6:.0f} MB state, {args.ckpts * args.rounds} checkpoints per variant)"
        headers, rows = (HF_HEADERS, hf_rows_for) if args.hf else (HEADERS, rows_for)
        print_rich_table(headers, rows(summaries, args.ckpts), title, left=("variant", "landed"), width=220)
        for line in (hf_breakdown_lines if args.hf else breakdown_lines)(summaries):
            print(line)
        flagged = [s.variant.name for s in summaries if s.flagged]
        if flagged:
            print(f"FLAGGED (error or checkpoints missing in the bucket): {', '.join(flagged)}")
        if not args.hf:
            print(verdict(summaries).replace("**", ""))
        print(f"total time {wall_s:.0f}s")
        if not args.no_append:
            section = hf_markdown_section if args.hf else markdown_section
            path = append_markdown(section(summaries, args, depth, nbytes, env, wall_s, loadavg))
            print(f"appended to {path}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if any(Summary(ALL_VARIANTS[n], fits[n]).flagged for n in args.variants if fits[n]) else 0


if __name__ == "__main__":
    sys.exit(main())
