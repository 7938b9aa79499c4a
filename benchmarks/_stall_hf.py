"""The Hugging Face adapter of ``benchmarks/stall.py``: the model, the two probe callbacks, four variants.

``hf-floor`` (the floor: ``copy_`` of every model and optimizer tensor into buffers kept between
checkpoints, allocated at the first), ``hf-spot`` (SpotCheckpointCallback: a RAM snapshot, ``checkpoint-N`` written and uploaded in the
background; with ``SPOT_HF_SAVE=trainer`` in the environment, the Trainer's save then a background
upload), ``hf-local`` (the Trainer's own save, local only) and ``hf-sync`` (the Trainer's save + an
``on_save`` that ``fs.put``'s the folder to S3). Imported only when those variants are asked for, so
the Lightning variants run without transformers.

Blocked time ("hook") = from ``Head.on_step_end`` of a checkpoint step to the end of
``Tail.on_save``: every callback's ``on_step_end`` (the save request), the Trainer's own
``_save_checkpoint`` and every ``on_save`` (an upload, for ``hf-sync``). A staged checkpoint has no
``on_save``: its blocked time is ``Head.on_step_end`` → ``Tail.on_step_end`` (the floor's copy; the
spot callback's snapshot) plus, for the spot callback, its submission at the next hook (once every
callback's flags for the step are final), timed around ``StagedSaves.submit``. Split into "Trainer
save" (``Tail.on_step_end`` end → ``Head.on_save``) and "on_save callbacks". "to next step" =
from ``Head.on_step_end`` to the next ``on_step_begin`` (or ``on_train_end``).
"""

from __future__ import annotations

import functools
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers
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
    landed_folders,
    record_stall,
    run_guarded,
    spot_options,
    spot_setup,
)

from spot_callbacks.hf import SpotCheckpointCallback
from spot_callbacks.hf.checkpoint import SAVE_PATH_ENV

FLOOR = "hf-floor"
LOCAL = "hf-local"


class HFStallModel(torch.nn.Module):
    """The benchmark's layer stack in the Trainer's calling convention."""

    def __init__(self, net: torch.nn.Sequential) -> None:
        super().__init__()
        self.net = net

    def forward(
        self, x: torch.Tensor | None = None, input_ids: Any = None, labels: Any = None
    ) -> dict[str, torch.Tensor]:
        return {"loss": self.net(x).square().mean()}


class Marks:
    """What :class:`Head` and :class:`Tail` share: the clock, the meter, and when each phase ended."""

    def __init__(self, clock: StepClock, recorder: Recorder) -> None:
        self.clock = clock
        self.recorder = recorder
        self.meter = HookMeter(recorder)
        self.step_end_done_at: float | None = None  # every on_step_end has run
        self.on_save_at: float | None = None  # the first on_save starts
        self.staged_steps: Callable[[], list[int]] = list  # the steps checkpointed without on_save
        self.pending_steps: Callable[[], list[int]] = list  # a snapshot taken, submitted at a later hook


class Head(transformers.TrainerCallback):
    """First in the callback list."""

    def __init__(self, marks: Marks) -> None:
        self.marks = marks

    def on_step_begin(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.marks.clock.step_begins(state.global_step)

    def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.marks.meter.start()
        self.marks.clock.step_ended_at = self.marks.meter.started

    def on_save(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
        marks = self.marks
        marks.on_save_at = time.perf_counter()
        if marks.step_end_done_at is not None:
            marks.recorder.record(
                "Trainer save", marks.on_save_at - marks.step_end_done_at, state.global_step
            )

    def on_train_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.marks.clock.close_period(state.global_step)


class Tail(transformers.TrainerCallback):
    """Last in the callback list."""

    def __init__(self, marks: Marks) -> None:
        self.marks = marks

    def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.marks.step_end_done_at = time.perf_counter()
        if state.global_step in self.marks.staged_steps():
            self.marks.meter.stop(state.global_step)
        elif state.global_step in self.marks.pending_steps():
            self.marks.meter.pause()  # the snapshot is taken; its submission at the next hook counts too

    def on_save(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
        marks = self.marks
        marks.meter.stop(state.global_step)
        if marks.on_save_at is not None:
            on_save_s = time.perf_counter() - marks.on_save_at
            marks.recorder.record("on_save callbacks", on_save_s, state.global_step)


def run(ctx: Context, variant: Variant) -> FitResult:
    """One ``Trainer.train`` of ``variant`` that takes ``ctx.ckpts`` checkpoints."""
    args = ctx.args
    net, rows = ctx.model_and_data()
    model = HFStallModel(net)
    data = [{"x": row} for row in rows]
    recorder = Recorder()
    setup = variant.make_setup(ctx, recorder)
    clock = StepClock(args, recorder, setup.settle)
    marks = Marks(clock, recorder)
    if isinstance(setup.timed, SpotCheckpointCallback):
        staged = setup.timed._staged
        marks.staged_steps = lambda: staged.submitted_steps
        marks.pending_steps = lambda: [staged.pending.request.step] if staged.pending is not None else []
        time_the_submission(setup.timed, marks.meter, recorder)
    elif isinstance(setup.timed, FloorCopy):
        marks.staged_steps = lambda: setup.timed.copied_steps
    output_dir = ctx.scratch / f"hf-{uuid.uuid4().hex[:6]}"
    targs = transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=ctx.max_steps,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-5,
        save_strategy=setup.trainer_options["save_strategy"],
        save_steps=args.every_n,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=0,
    )

    beside = [FloorBeside(args.every_n, recorder)] if isinstance(setup.timed, SpotCheckpointCallback) else []
    rss = RssPeak()
    first_ckpt = ctx.ckpt_steps[0]

    def mark_rss(targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == first_ckpt:
            rss.mark()  # the model, its optimizer state (and the floor's buffers) are in

    def train() -> None:
        head = Head(marks)
        head.on_step_end = _before(mark_rss, head.on_step_end)
        callbacks = [*beside, head, *setup.callbacks, Tail(marks)]
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        trainer.train()

    with rss:
        error = run_guarded(setup, train)
    result = fit_result(ctx, recorder, clock, setup, error)
    result.add("extra RSS ÷ state", rss.extra_ratio(ctx.state_bytes))
    if beside:
        ratios = [
            hook / floor
            for step, hook in recorder.by_name.get("hook", {}).items()
            if (floor := recorder.by_name.get("floor beside", {}).get(step))
        ]
        for ratio in ratios:
            result.add("hook ÷ floor beside", ratio)
        print("  hook ÷ floor beside per checkpoint: " + " ".join(f"{r:.2f}" for r in ratios), flush=True)
    shutil.rmtree(output_dir, ignore_errors=True)
    return result


# ---------------------------------------------------------------------------------- variants
def tensors_of(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples, in a fixed order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_of(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from tensors_of(item)


class FloorCopy(transformers.TrainerCallback):
    """At checkpoint steps, ``copy_`` the model and optimizer state into buffers kept between checkpoints."""

    def __init__(self, every_n: int) -> None:
        self.every_n = every_n
        self.buffers: list[torch.Tensor] | None = None  # allocated at the first checkpoint
        self.copied_steps: list[int] = []

    def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.every_n:
            return
        sources = [
            *tensors_of(kwargs["model"].state_dict()),
            *tensors_of(kwargs["optimizer"].state_dict()),
        ]
        if self.buffers is None:
            self.buffers = [torch.empty_like(t) for t in sources]
        for dst, src in zip(self.buffers, sources, strict=True):
            dst.copy_(src.detach())
        self.copied_steps.append(state.global_step)


class FloorBeside(FloorCopy):
    """The floor timed beside each checkpoint of the same run, before the timed window opens."""

    def __init__(self, every_n: int, recorder: Recorder) -> None:
        super().__init__(every_n)
        self.recorder = recorder

    def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        super().on_step_end(targs, state, control, **kwargs)
        if state.global_step % self.every_n == 0:
            self.recorder.record("floor beside", time.perf_counter() - started, state.global_step)


def _before(first: Callable[..., None], then: Callable[..., None]) -> Callable[..., None]:
    def both(*args: Any, **kwargs: Any) -> None:
        first(*args, **kwargs)
        then(*args, **kwargs)

    return both


def hf_floor_setup(ctx: Context, recorder: Recorder) -> Setup:
    floor = FloorCopy(ctx.args.every_n)
    return Setup(callbacks=[floor], timed=floor, trainer_options={"save_strategy": "no"})


def hf_spot_setup(ctx: Context, recorder: Recorder) -> Setup:
    ckpt = SpotCheckpointCallback(**spot_options(ctx))
    record_stall(ckpt.engine, "save_folder", recorder)
    setup = spot_setup(ctx, ckpt, landed_folders)
    setup.trainer_options["save_strategy"] = "no"  # the callback asks for the saves
    return setup


def time_the_submission(ckpt: SpotCheckpointCallback, meter: HookMeter, recorder: Recorder) -> None:
    """The staged snapshot's submission blocks the loop too: the meter runs again while it runs. After
    each, the engine's ``last_stall_s`` is recorded (as ``record_stall`` does for a Trainer save)."""
    staged = ckpt._staged
    submit = staged.submit

    @functools.wraps(submit)
    def timed(*args: Any, **kwargs: Any) -> Any:
        step = staged.pending.request.step
        meter.resume()
        try:
            return submit(*args, **kwargs)
        finally:
            meter.stop(step)
            recorder.record("engine.last_stall_s", ckpt.engine.last_stall_s)

    staged.submit = timed


def hf_local_setup(ctx: Context, recorder: Recorder) -> Setup:
    return Setup(callbacks=[], trainer_options={"save_strategy": "steps"})


class SyncUpload(transformers.TrainerCallback):
    """``on_save``: ``fs.put`` the Trainer's ``checkpoint-N`` folder to the fit's prefix, timed."""

    def __init__(self, ctx: Context, recorder: Recorder) -> None:
        self.fs = ctx.fs()
        self.prefix = ctx.prefix
        self.recorder = recorder

    def on_save(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
        name = f"checkpoint-{state.global_step}"
        started = time.perf_counter()
        self.fs.put(os.path.join(targs.output_dir, name), f"{self.prefix}/{name}", recursive=True)
        self.recorder.record("s3fs put", time.perf_counter() - started, state.global_step)


def hf_sync_setup(ctx: Context, recorder: Recorder) -> Setup:
    return Setup(
        callbacks=[SyncUpload(ctx, recorder)],
        trainer_options={"save_strategy": "steps"},
        landed=functools.partial(landed_folders, ctx),
    )


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            FLOOR,
            "copy_ of every model state_dict and optimizer state tensor into buffers kept between "
            "checkpoints (allocated at the first), in on_step_end; nothing is written",
            hf_floor_setup,
            kept="RAM",
        ),
        Variant(
            "hf-spot",
            "SpotCheckpointCallback(every_n_steps=N, dirpath=s3://…): "
            + (
                "Trainer save + background upload (SPOT_HF_SAVE=trainer)"
                if os.environ.get(SAVE_PATH_ENV) == "trainer"
                else "RAM snapshot; checkpoint-N written and uploaded in the background"
            ),
            hf_spot_setup,
        ),
        Variant(
            LOCAL,
            'Trainer\'s own save (save_strategy="steps", save_steps=N), local only',
            hf_local_setup,
            kept="local",
        ),
        Variant(
            "hf-sync",
            "Trainer save + a TrainerCallback whose on_save fs.put's checkpoint-N to S3 (s3fs)",
            hf_sync_setup,
        ),
    )
}
