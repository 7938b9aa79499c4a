"""The saves the HF adapter asks of the Trainer, until ``on_save`` shows they happened.

The Trainer can drop a save a callback asked for: with ``save_strategy="best"`` it overwrites
``control.should_save`` on evaluation steps with "is this a new best metric". A request that
never reached ``on_save`` is dropped; it is asked for again at the next save point. With
``enable_jit_checkpoint`` the Trainer may also save on its own at SIGTERM (:func:`jit_checkpoint_to_persist`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import spot_callbacks.hf._compat as compat
from spot_callbacks._dist import gather_from_ranks, is_writer
from spot_callbacks.data_position import DataPosition, warn_if_changed
from spot_callbacks.preemption import PREEMPTED_EXIT_CODE, TERMINATION, Notice

log = logging.getLogger("spot_callbacks")


@dataclass(frozen=True)
class SaveRequest:
    step: int
    reason: str
    notice: Notice | None = None


class RequestedSaves:
    """The save asked of the Trainer (``pending``), and a dropped one to ask for again (``dropped``).

    Example:
        >>> saves = RequestedSaves()
        >>> saves.ask(SaveRequest(4, "interval"))
        >>> saves.check_dropped(step=5, save_strategy="best")  # no on_save came for step 4
        True
        >>> saves.take_dropped()
        SaveRequest(step=5, reason='interval', notice=None)
    """

    def __init__(self) -> None:
        self.pending: SaveRequest | None = None
        self.dropped: SaveRequest | None = None

    def clear(self) -> None:
        self.pending = self.dropped = None

    def ask(self, request: SaveRequest) -> None:
        self.pending = request

    def saved(self, step: int) -> SaveRequest | None:
        """``on_save`` at ``step``: the request it answers, if any (one for another step is spent)."""
        request, self.pending = self.pending, None
        return request if request is not None and request.step == step else None

    def take_dropped(self) -> SaveRequest | None:
        dropped, self.dropped = self.dropped, None
        return dropped

    def check_dropped(self, step: int, save_strategy: str) -> bool:
        """A request still pending at the next save point was dropped: keep it to ask again at ``step``."""
        request, self.pending = self.pending, None
        if request is None:
            return False
        log.warning(
            "spot_callbacks: the checkpoint requested at step %d (%s) was not saved by the Trainer "
            "(save_strategy=%r replaces the request when the evaluation finds no new best metric); "
            "saving at the next save point instead",
            request.step, request.reason, save_strategy,
        )  # fmt: skip
        self.dropped = SaveRequest(step, request.reason, request.notice)
        return True

    def give_up(self) -> None:
        """Training ended with a request pending: say so; the newest committed checkpoint stands."""
        if self.pending is not None:
            log.warning(
                "spot_callbacks: the checkpoint requested at step %d (%s) was not saved by the Trainer; "
                "the newest committed checkpoint is the resume point", self.pending.step, self.pending.reason,
            )  # fmt: skip
        self.clear()


def jit_checkpoint_to_persist(engine: Any, args: Any, state: Any) -> Path | None:
    """The folder of a Trainer JIT checkpoint to upload at the end of ``train()``, if one was saved.

    With ``enable_jit_checkpoint`` and SIGTERM not among the engine's notice sources, the Trainer
    saved on SIGTERM without calling ``on_save``. Collective: every rank calls it together.
    """
    if not compat.jit_checkpoint_enabled(args) or engine.watches(TERMINATION):
        return None
    step = state.global_step
    if step >= state.max_steps or not engine.needs_checkpoint(step):
        return None
    folder = compat.checkpoint_dir(args.output_dir, step)
    # With node-local output dirs each node sees its own copy, and the checkpoint is whole only if
    # every node's is (else one node would wait forever).
    return folder if all(gather_from_ranks(compat.jit_checkpoint_complete(folder))) else None


def persist_jit_checkpoint(engine: Any, args: Any, state: Any, persist: Callable[[], Any]) -> bool:
    """At the end of ``train()``: ``persist()`` a Trainer JIT checkpoint and wait for its commit.

    True when there was one (the run was preempted). Collective, like :func:`jit_checkpoint_to_persist`.
    """
    if (folder := jit_checkpoint_to_persist(engine, args, state)) is None:
        return False
    log.warning("spot_callbacks: persisting the Trainer's JIT checkpoint %s", folder)
    persist()
    engine.wait_for_commit()
    return True


def finish_after_last_commit(engine: Any) -> bool:
    """``engine.finish()``; True when a notice during the final upload made it an emergency.

    The engine then ends with ``SystemExit(143)``; under the Trainer the script decides the exit
    (``preempted``), as after any preemption, so it is not raised through ``train()``.
    """
    try:
        engine.finish()
    except SystemExit as stop:
        if stop.code != PREEMPTED_EXIT_CODE:
            raise
        return True
    return False


def data_position(args: Any, event_kwargs: dict[str, Any], resumed: Any, step: int) -> dict[str, Any]:
    """What this run's data position is counted in (for the manifest), warning once on a resume
    whose checkpoint counted it otherwise (see :mod:`spot_callbacks.data_position`).
    ``event_kwargs``: a Trainer event's keyword arguments (``train_dataloader`` among them)."""
    dataset = getattr(event_kwargs.get("train_dataloader"), "dataset", None)
    now = DataPosition(
        batch_size=(getattr(args, "per_device_train_batch_size", None),),
        world_size=int(getattr(args, "world_size", 1) or 1),
        accumulate_grad_batches=int(getattr(args, "gradient_accumulation_steps", 1) or 1),
        dataset_length=(len(dataset) if isinstance(dataset, Sized) else None,),
    )
    if resumed is not None and is_writer():
        warn_if_changed(resumed.info.extra.get("data_position"), now, f"step {step}")
    return now.to_dict()
