"""When a checkpoint is taken, in one place: each rule a pure function of what every rank agreed on.

- at a step boundary (:func:`decide`): a preemption notice > an early hint (AWS rebalance
  recommendation) > the interval > every N steps, and never the same step twice;
- at the end of training (:func:`end_reason`): a last checkpoint unless this step has one;
- on an exception (:func:`on_exception`): only between batches and only past the step resumed
  from (behind it the resume itself failed, and the model is not that run's);
- after an emergency checkpoint (:func:`after_emergency`): stop or continue;
- at the end, of the checkpoints that failed (:func:`end_verdict`): only the newest state counts,
  unless ``SPOT_STRICT=1``.

The engine feeds these the agreed flags and does what they answer; the adapters only translate
the answer into their framework's terms.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import spot_callbacks.settings as settings
from spot_callbacks.errors import PersistError
from spot_callbacks.preemption import INTERRUPT, Notice

FAILURE_CONTINUES = "training continues, the last committed checkpoint stands"
# Set to 1: any checkpoint that could not be persisted fails the run at its end, not only the newest.
STRICT_ENV = settings.STRICT.name


class Act(enum.Enum):
    """What a step boundary asks for."""

    NOTHING = "nothing"
    SAVE = "save"  # a normal checkpoint, persisted in the background
    # A preemption: checkpoint (unless this step has one), wait for it, then stop or go on.
    EMERGENCY = "emergency"


class AfterEmergency(enum.Enum):
    STOP = "stop"
    CONTINUE = "continue"


@dataclass(frozen=True)
class StepAction:
    """The answer at one step boundary, the same on every rank.

    Example:
        >>> action = decide(4, last_saved_step=2, notice=None, hint=None, interval_due=False, steps_due=True)
        >>> action.act, action.reason, action.save
        (<Act.SAVE: 'save'>, 'steps', True)
        >>> decide(4, last_saved_step=4, notice=None, hint=None, interval_due=True, steps_due=True).act
        <Act.NOTHING: 'nothing'>
    """

    act: Act
    reason: str | None = None  # the checkpoint's reason: interval, steps, preemption
    notice: Notice | None = None  # the agreed notice of an emergency
    already_saved: bool = False  # an emergency at a step that has its checkpoint: only wait for it
    warning: str | None = None  # a line to log on every rank

    @property
    def save(self) -> bool:
        """A checkpoint is to be taken at this step."""
        return self.act is Act.SAVE or (self.act is Act.EMERGENCY and not self.already_saved)

    @property
    def emergency(self) -> bool:
        return self.act is Act.EMERGENCY


NOTHING = StepAction(Act.NOTHING)


def decide(
    step: int,
    *,
    last_saved_step: int | None,
    notice: Notice | None,
    hint: str | None,
    interval_due: bool,
    steps_due: bool,
) -> StepAction:
    """The action at an optimizer-step boundary, from the flags every rank agreed on.

    Example:
        >>> sigterm = Notice("SIGTERM", None)
        >>> action = decide(7, last_saved_step=7, notice=sigterm, hint=None, interval_due=False, steps_due=False)
        >>> action.act, action.reason, action.save
        (<Act.EMERGENCY: 'emergency'>, 'preemption', False)
        >>> decide(8, last_saved_step=7, notice=None, hint="rebalance", interval_due=False, steps_due=False).reason
        'interval'
    """
    if notice is not None:
        return StepAction(Act.EMERGENCY, "preemption", notice, already_saved=step == last_saved_step)
    if not needs_checkpoint(step, last_saved_step):
        return NOTHING
    if hint is not None:
        return StepAction(
            Act.SAVE, "interval", warning=f"checkpointing step {step} now (reason 'interval'): {hint}"
        )
    if interval_due:
        return StepAction(Act.SAVE, "interval")
    if steps_due:
        return StepAction(Act.SAVE, "steps")
    return NOTHING


def needs_checkpoint(step: int, last_saved_step: int | None) -> bool:
    """Once per step: a step already checkpointed (or resumed from) is never written again.

    Example:
        >>> needs_checkpoint(5, None), needs_checkpoint(5, 5), needs_checkpoint(6, 5)
        (True, False, True)
    """
    return step != last_saved_step


def end_reason(step: int, last_saved_step: int | None) -> str | None:
    """``"end"`` when training ended at a step without a checkpoint, else None.

    Example:
        >>> end_reason(10, 8), end_reason(10, 10)
        ('end', None)
    """
    return "end" if needs_checkpoint(step, last_saved_step) else None


@dataclass(frozen=True)
class ExceptionAction:
    """What an exception out of training asks for: a checkpoint (reason ``"exception"``), a warning,
    and whether the run now counts as stopped for a preemption (exit 143)."""

    save: bool
    warning: str | None = None
    preempted: bool = False


def on_exception(
    error_name: str,
    *,
    late_signal: bool,
    preempted: bool,
    between_batches: bool,
    step: int,
    last_saved_step: int | None,
) -> ExceptionAction:
    """The save on exception: only between batches (a half-done step is no state to resume) and only
    when there is trained state newer than the newest committed (past the step resumed from, and
    past step 0: a run that fails in set-up, or is refused by a live run's lock, commits nothing). A termination signal the framework raised after the last step
    boundary (``late_signal``) takes no checkpoint: the newest committed one is the resume point.

    Example:
        >>> def ask(**kw):
        ...     return on_exception("ValueError", **{"late_signal": False, "preempted": False, **kw})
        >>> ask(between_batches=True, step=5, last_saved_step=3).save
        True
        >>> ask(between_batches=True, step=3, last_saved_step=3).save
        False
        >>> ask(between_batches=True, step=0, last_saved_step=None).save  # nothing trained yet
        False
        >>> ask(between_batches=False, step=5, last_saved_step=3).warning
        'ValueError inside a training step; no checkpoint of a half-done step is taken'
        >>> ask(late_signal=True, between_batches=True, step=5, last_saved_step=3).preempted
        True
    """
    if late_signal:
        warning = None
        if not preempted:
            warning = (
                "SIGTERM arrived after the last step boundary; the newest committed checkpoint "
                f"(step {last_saved_step}) is the resume point"
            )
        return ExceptionAction(False, warning, preempted=True)
    if not between_batches:
        return ExceptionAction(
            False, f"{error_name} inside a training step; no checkpoint of a half-done step is taken"
        )
    return ExceptionAction(step > (last_saved_step if last_saved_step is not None else 0))


def after_emergency(on_preemption: str, notice: Notice | None = None) -> AfterEmergency:
    """Once the emergency checkpoint is waited for: stop training gracefully, or keep going.

    Ctrl-C (a ``SIGINT`` notice) always stops: a person asked for it.

    Example:
        >>> after_emergency("stop"), after_emergency("continue")
        (<AfterEmergency.STOP: 'stop'>, <AfterEmergency.CONTINUE: 'continue'>)
        >>> after_emergency("continue", Notice("SIGINT", None, "Ctrl-C"))
        <AfterEmergency.STOP: 'stop'>
    """
    if on_preemption == "stop" or (notice is not None and notice.source == INTERRUPT):
        return AfterEmergency.STOP
    return AfterEmergency.CONTINUE


def failure_line(failure: BaseException) -> str:
    """The error line of a checkpoint that could not be made durable while training goes on.

    Example:
        >>> failure_line(OSError("bucket gone"))
        'bucket gone; training continues, the last committed checkpoint stands'
    """
    return f"{failure}; {FAILURE_CONTINUES}"


@dataclass(frozen=True)
class EndVerdict:
    """What the failed checkpoints of a run mean at its end: an error to raise, or a line to log.

    Example:
        >>> EndVerdict().error is None and EndVerdict().line is None
        True
    """

    error: PersistError | None = None
    line: str | None = None


def end_verdict(
    failures: list[PersistError], newest_committed_step: int | None, strict: bool | None = None
) -> EndVerdict:
    """At the end what matters is whether the newest state is durable.

    The run fails (the newest failure is raised) when a checkpoint newer than the newest commit
    failed, or any did and ``strict`` (default ``$SPOT_STRICT=1``); otherwise the dropped ones are said.

    Example:
        >>> late = PersistError(8, "memory://run/step-8", OSError("SlowDown"), None)
        >>> early = PersistError(4, "memory://run/step-4", OSError("SlowDown"), None)
        >>> end_verdict([early], 8).line
        'the newest state (step 8) is committed; 1 earlier checkpoint could not be persisted and was dropped (step 4)'
        >>> end_verdict([early, late], 6).error is late, end_verdict([early], 8, strict=True).error is early
        (True, True)
    """
    if not failures:
        return EndVerdict()
    if strict is None:
        strict = settings.STRICT.value()
    newest_failure = max(failures, key=lambda failure: failure.step)
    if strict or newest_committed_step is None or newest_failure.step >= newest_committed_step:
        return EndVerdict(error=failures[-1])
    steps = sorted({failure.step for failure in failures})
    count = f"{len(steps)} earlier checkpoint{'s' if len(steps) > 1 else ''}"
    return EndVerdict(
        line=f"the newest state (step {newest_committed_step}) is committed; {count} could not be "
        f"persisted and {'were' if len(steps) > 1 else 'was'} dropped (step{'s' if len(steps) > 1 else ''} "
        f"{', '.join(map(str, steps))})"
    )
