"""The Lightning adapter of ``benchmarks/stall.py``: the model, the probe callback, the five variants.

``floor-clone`` / ``floor-copy`` (in-RAM references), ``spot`` (SpotCheckpoint), ``mc-sync`` /
``mc-async`` (ModelCheckpoint to S3, without and with AsyncCheckpointIO). Blocked time = wall
time inside the checkpointing callback's ``on_train_batch_end`` on checkpoint steps (the hook is
wrapped on the instance, so it is timed where Lightning calls it).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from _stall import (
    Context,
    FitResult,
    HookMeter,
    Recorder,
    RssPeak,
    Setup,
    StepClock,
    Variant,
    fit_result,
    landed_objects,
    record_stall,
    run_guarded,
    spot_options,
    spot_setup,
    time_method,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from spot_callbacks import staging
from spot_callbacks.lightning import SpotCheckpoint

FLOOR = "floor-clone"


class StallModel(pl.LightningModule):
    """The benchmark's layer stack; AdamW."""

    def __init__(self, net: torch.nn.Sequential) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


class Probe(pl.Callback):
    """First in the callback list: feeds the :class:`StepClock`, times the Lightning save calls and the hook."""

    def __init__(self, clock: StepClock, recorder: Recorder, rss: RssPeak, first_ckpt: int) -> None:
        self.clock = clock
        self.recorder = recorder
        self.rss = rss
        self.first_ckpt = first_ckpt

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Every Lightning checkpoint path goes through these two; instance attributes win.
        time_method(trainer._checkpoint_connector, "dump_checkpoint", self.recorder, "dump_checkpoint")
        time_method(trainer.strategy.checkpoint_io, "save_checkpoint", self.recorder, "checkpoint_io.save")

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.clock.step_begins(trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock.close_period(trainer.global_step)

    def time_hook(self, callback: pl.Callback) -> None:
        """Time ``callback.on_train_batch_end`` as Lightning calls it (the blocked time)."""
        original = callback.on_train_batch_end
        meter = HookMeter(self.recorder)

        def on_train_batch_end(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
            if trainer.global_step == self.first_ckpt:
                self.rss.mark()  # the model, its optimizer state (and the floor's buffers) are in
            meter.start()
            try:
                original(trainer, *args, **kwargs)
            finally:
                meter.stop(trainer.global_step)

        callback.on_train_batch_end = on_train_batch_end


def run(ctx: Context, variant: Variant) -> FitResult:
    """One ``Trainer.fit`` of ``variant`` that takes ``ctx.ckpts`` checkpoints."""
    net, rows = ctx.model_and_data()
    model = StallModel(net)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(rows), batch_size=ctx.args.batch, shuffle=False, num_workers=0
    )
    recorder = Recorder()
    setup = variant.make_setup(ctx, recorder)
    clock = StepClock(ctx.args, recorder, setup.settle)
    rss = RssPeak()
    probe = Probe(clock, recorder, rss, ctx.ckpt_steps[0])
    probe.time_hook(setup.timed)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=ctx.max_steps,
        max_epochs=1,
        callbacks=[probe, *setup.callbacks],
        plugins=setup.trainer_options.get("plugins") or None,
        enable_checkpointing=setup.trainer_options.get("enable_checkpointing", True),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(ctx.scratch / "lightning"),
    )
    with rss:
        error = run_guarded(setup, functools.partial(trainer.fit, model, loader))
    result = fit_result(ctx, recorder, clock, setup, error)
    result.add("extra RSS ÷ state", rss.extra_ratio(ctx.state_bytes))
    return result


# ---------------------------------------------------------------------------------- variants
def train_state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """The tensors a checkpoint must hold: model ``state_dict`` + every optimizer's state."""
    return {"model": pl_module.state_dict(), "optimizers": [opt.state_dict() for opt in trainer.optimizers]}


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
        flat_src: list[torch.Tensor] = []
        flat_dst: list[torch.Tensor] = []
        apply_to_collection(state, torch.Tensor, flat_src.append)
        apply_to_collection(self.snapshot, torch.Tensor, flat_dst.append)
        for dst, src in zip(flat_dst, flat_src, strict=True):
            dst.copy_(src)


class FloorBeside(FloorCallback):
    """The floor timed beside each checkpoint of the same fit: ``copy_`` into kept buffers just before the hook."""

    def __init__(self, every_n: int, recorder: Recorder) -> None:
        super().__init__(every_n, reuse_buffers=True)
        self.recorder = recorder

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        started = time.perf_counter()
        super().on_train_batch_end(trainer, pl_module, *args)
        if trainer.global_step % self.every_n == 0:
            self.recorder.record("floor beside", time.perf_counter() - started, trainer.global_step)


def floor_setup(reuse_buffers: bool, ctx: Context, recorder: Recorder) -> Setup:
    floor = FloorCallback(ctx.args.every_n, reuse_buffers)
    return Setup(callbacks=[floor], timed=floor, trainer_options={"enable_checkpointing": False})


def lightning_spot_setup(ctx: Context, recorder: Recorder) -> Setup:
    ckpt = SpotCheckpoint(**spot_options(ctx))
    engine = ckpt.engine
    time_method(engine, "save_state", recorder, "engine.save_state")
    time_method(engine.staging, "stage", recorder, "staging.stage")
    record_stall(engine, "save_state", recorder)
    original_stage = engine.staging.stage

    def stage(*args: Any, **kwargs: Any) -> Any:
        try:
            return original_stage(*args, **kwargs)
        finally:
            recorder.record("staging lock wait", engine.staging.last_wait_s)

    engine.staging.stage = stage

    def hook_rest(result: FitResult) -> None:
        ratios = []
        for step in ctx.ckpt_steps:
            keys = ("hook", "dump_checkpoint", "engine.save_state", "floor beside")
            hook, dump, save, floor = (recorder.by_name.get(key, {}).get(step) for key in keys)
            if hook is not None and dump is not None and save is not None:
                result.add("hook − dump − save_state", hook - dump - save)
            if hook is not None and floor:
                ratios.append(hook / floor)
                result.add("hook ÷ floor beside", hook / floor)
        print("  hook ÷ floor beside per checkpoint: " + " ".join(f"{r:.2f}" for r in ratios), flush=True)

    floor_beside = FloorBeside(ctx.args.every_n, recorder)
    setup = spot_setup(ctx, ckpt, landed_objects)
    setup.callbacks.insert(0, floor_beside)
    setup.after_fit.append(hook_rest)
    setup.around_fit = functools.partial(profile_staging, recorder)
    return setup


@contextlib.contextmanager
def profile_staging(recorder: Recorder) -> Iterator[None]:
    """Split ``StagingArea.stage`` into its walk over the tensors, the copies (``finish``: CPU tensors are
    copied together there) and deep copies of other leaves (patched while a fit runs).

    A diagnostic over staging's internals: where they moved, the fit runs without the split.
    """
    context_cls = getattr(staging, "_StageContext", None)
    copy_module = getattr(staging, "copy", None)
    parts = ("copy_tensor", "finish")
    if context_cls is None or copy_module is None or not all(hasattr(context_cls, p) for p in parts):
        print("note: staging internals moved; no walk / copy / deepcopy split", file=sys.stderr)
        yield
        return
    originals = {name: getattr(context_cls, name) for name in parts}

    def timed(name: str, label: str) -> Any:
        original = originals[name]

        def wrapper(self: Any, *args: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(self, *args)
            finally:
                recorder.accumulate(label, time.perf_counter() - started)

        return wrapper

    def timed_deepcopy(value: Any, memo: Any = None) -> Any:
        started = time.perf_counter()
        try:
            return copy_module.deepcopy(value, memo)
        finally:
            recorder.accumulate("stage: deepcopy of other leaves", time.perf_counter() - started)
            recorder.counts[f"deepcopy {type(value).__name__}"] += 1

    context_cls.copy_tensor = timed("copy_tensor", "stage: per-tensor walk")
    context_cls.finish = timed("finish", "stage: copies (finish)")
    staging.copy = types.SimpleNamespace(deepcopy=timed_deepcopy, copy=copy_module.copy)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(context_cls, name, original)
        staging.copy = copy_module


def model_checkpoint_setup(asynchronous: bool, ctx: Context, recorder: Recorder) -> Setup:
    plugin = AsyncCheckpointIO() if asynchronous else None

    def settle() -> None:
        # AsyncCheckpointIO has one worker thread: a no-op queued behind the save finishes after it.
        executor = getattr(plugin, "_executor", None)
        if executor is not None:
            executor.submit(lambda: None).result()

    ckpt = ModelCheckpoint(dirpath=ctx.url, every_n_train_steps=ctx.args.every_n, save_top_k=-1)
    return Setup(
        callbacks=[ckpt],
        timed=ckpt,
        trainer_options={"plugins": [plugin] if plugin else []},
        settle=settle,
        landed=lambda: landed_objects(ctx),
    )


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            FLOOR,
            "clone() of model state_dict + optimizer state, in RAM",
            functools.partial(floor_setup, False),
            kept="RAM",
        ),
        Variant(
            "floor-copy",
            "copy_ into buffers kept across checkpoints (reference)",
            functools.partial(floor_setup, True),
            kept="RAM",
        ),
        Variant("spot", "SpotCheckpoint(every_n_steps=N), background persist", lightning_spot_setup),
        Variant(
            "mc-sync",
            "ModelCheckpoint(dirpath=s3://…, every_n_train_steps=N)",
            functools.partial(model_checkpoint_setup, False),
        ),
        Variant(
            "mc-async",
            "ModelCheckpoint + AsyncCheckpointIO()",
            functools.partial(model_checkpoint_setup, True),
        ),
    )
}
