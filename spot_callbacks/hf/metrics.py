"""The ``spot/*`` metrics of a Hugging Face run, logged through the Trainer so that every ``report_to``
integration (TensorBoard, wandb, MLflow, ...) and ``state.log_history`` get them at the step they describe.

A checkpoint's ``spot/stall_s`` and ``spot/persist_lag_s`` are logged at its step, ``spot/persist_s`` and
``spot/persist_MBps`` at the first step boundary after its commit (the last one's after training, before
the integrations close), ``spot/resume_s`` at the step resumed from: each as its own row, like eval rows.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import transformers

from spot_callbacks.persist import PersistRecord


class SpotMetrics:
    """The ``spot/*`` values not logged yet, and the Trainer that logs them.

    Without a Trainer to log through (an unknown loop), :meth:`merge_into` adds them to its next logs.

    Example:
        >>> metrics = SpotMetrics()
        >>> metrics.add({"spot/stall_s": 0.05}); metrics.flush()  # no Trainer: kept for the next logs
        >>> from transformers import TrainerState
        >>> logs, state = {"loss": 2.0}, TrainerState(global_step=7, log_history=[{"loss": 2.0, "step": 7}])
        >>> metrics.merge_into(logs, state); logs, state.log_history
        ({'loss': 2.0, 'spot/stall_s': 0.05}, [{'loss': 2.0, 'step': 7, 'spot/stall_s': 0.05}])
    """

    def __init__(self) -> None:
        self.pending: dict[str, float] = {}
        self._trainer: Callable[[], transformers.Trainer | None] = lambda: None
        self.logging = False  # a row of ours is going through Trainer.log now

    def attach(self, trainer: transformers.Trainer | None) -> None:
        """At ``on_train_begin``: log through ``trainer`` from now on (``None``: merge into its logs)."""
        self._trainer = weakref.ref(trainer) if trainer is not None else (lambda: None)

    def add(self, values: dict[str, float]) -> None:
        self.pending.update(values)

    def add_records(self, records: Iterable[PersistRecord]) -> None:
        for record in records:
            self.pending["spot/persist_s"] = record.persist_s
            self.pending["spot/persist_MBps"] = record.mb_per_s

    def flush(self) -> None:
        """Log what is pending now, at the Trainer's current step (every rank, as the Trainer logs)."""
        if not self.pending:
            return
        trainer = self._trainer()
        if trainer is None:
            return
        row, self.pending = self.pending, {}
        self.logging = True
        try:
            # The base method: a subclass's log (TRL's) may flush its own running averages into our row.
            transformers.Trainer.log(trainer, row)
        finally:
            self.logging = False

    def merge_into(self, logs: dict[str, Any] | None, state: Any) -> None:
        """No Trainer to log through: add what is pending to ``logs`` (and their row of ``state.log_history``)."""
        if logs is None or not self.pending or self._trainer() is not None:
            return
        logs.update(self.pending)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self.pending)
        self.pending = {}
