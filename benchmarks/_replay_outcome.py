"""What the goodput replay measures from outside the training process: attempts parsed, outcomes computed.

The child prints one marker line per event (``_replay_child.py``): ``REPLAY SPAWNED <t>`` before its
imports, ``REPLAY READY <t>`` once its imports and set-up are done and it calls ``fit``/``train``,
``REPLAY STEP <step> <t>`` after each optimizer step (``step`` counts the steps done), and
``REPLAY DONE <step> <t>`` when training reached its last step; ``t`` is ``time.time()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MARKER = "REPLAY"


@dataclass
class Attempt:
    """One machine's life: spawn and exit (the parent's clock), the interruption it got, the steps it trained."""

    spawned: float
    exited: float
    exit_code: int | None
    interruption: str  # what the schedule did to it: "-", "SIGTERM@35.0s+5s", "SIGKILL@55.0s"
    steps: list[tuple[int, float]] = field(default_factory=list)  # (step done, time)
    done: bool = False
    ready: float | None = None  # when the child called fit/train (imports and set-up done)

    @property
    def billed_s(self) -> float:
        return self.exited - self.spawned

    @property
    def first_step(self) -> int | None:
        return self.steps[0][0] if self.steps else None

    @property
    def last_step(self) -> int | None:
        return self.steps[-1][0] if self.steps else None

    @property
    def startup_s(self) -> float | None:
        """Spawn to the end of the first training step (the downtime of this machine)."""
        return self.steps[0][1] - self.spawned if self.steps else None

    @property
    def in_fit_s(self) -> float | None:
        """The call of fit/train to the end of the first step: the checkpointing's start-up (a preflight,
        a lock, a pull, a restore) and the framework's, without the interpreter's and the imports'."""
        return self.steps[0][1] - self.ready if self.steps and self.ready is not None else None


def parse_markers(lines: Iterable[str]) -> tuple[list[tuple[int, float]], bool]:
    """The ``(step, time)`` records and whether training finished, from a child's output lines."""
    steps: list[tuple[int, float]] = []
    done = False
    for line in lines:
        parts = line.split()
        if len(parts) < 2 or parts[0] != MARKER:
            continue
        try:
            if parts[1] == "STEP" and len(parts) == 4:
                steps.append((int(parts[2]), float(parts[3])))
            elif parts[1] == "DONE":
                done = True
        except ValueError:
            continue  # a line cut by SIGKILL
    return steps, done


def ready_at(lines: Iterable[str]) -> float | None:
    """The time of the ``REPLAY READY`` marker, if the child got that far."""
    for line in lines:
        parts = line.split()
        if parts[:2] == [MARKER, "READY"] and len(parts) == 3:
            try:
                return float(parts[2])
            except ValueError:
                return None
    return None


def per_step_s(baseline: Attempt) -> float:
    """The uninterrupted run's seconds per step, first to last recorded step."""
    if len(baseline.steps) < 2:
        raise ValueError("the baseline recorded fewer than two steps")
    (first, t_first), (last, t_last) = baseline.steps[0], baseline.steps[-1]
    return (t_last - t_first) / (last - first)


def interleaved(jobs: Sequence[str], every: int) -> list[str | None]:
    """``jobs`` with an uninterrupted baseline (``None``) before the first, after every ``every`` of them
    and after the last, so that each job is measured between two baselines of the same hour of the box.

    Example:
        >>> interleaved(["a", "b", "c"], 2)
        [None, 'a', 'b', None, 'c', None]
    """
    order: list[str | None] = [None]
    for index, job in enumerate(jobs, 1):
        order.append(job)
        if index % max(1, every) == 0 or index == len(jobs):
            order.append(None)
    return order


def round_order(variants: Sequence[str], rounds: int, abba: bool) -> list[tuple[int, str]]:
    """``(round, variant)`` in the order they run: every variant once per round, and with ``abba`` the
    order reversed in every other round (A B, B A, A B, ...), so that a slow stretch of the box falls
    on each variant alike instead of always on the one that runs second.

    Example:
        >>> round_order(["a", "b"], 2, abba=True)
        [(0, 'a'), (0, 'b'), (1, 'b'), (1, 'a')]
        >>> round_order(["a", "b"], 2, abba=False)
        [(0, 'a'), (0, 'b'), (1, 'a'), (1, 'b')]
    """
    order: list[tuple[int, str]] = []
    for round_ in range(max(1, rounds)):
        ordered = list(variants)[::-1] if abba and round_ % 2 else list(variants)
        order += [(round_, variant) for variant in ordered]
    return order


def around(baselines: Sequence[Attempt]) -> tuple[float, float]:
    """The mean spawn-to-exit and seconds per step of the baselines run before and after a job."""
    if not baselines:
        raise ValueError("no baseline around the job")
    return (
        sum(b.billed_s for b in baselines) / len(baselines),
        sum(per_step_s(b) for b in baselines) / len(baselines),
    )


def lost_steps(attempts: Sequence[Attempt]) -> list[int]:
    """Per restart (attempt 2 onwards), the steps trained before it that it trains again.

    An attempt resumes at ``first_step - 1``; what the previous attempts had reached (the last step
    of the newest one that trained) past that point is redone. An attempt that trained nothing
    reaches what the one before it reached; its restart loses nothing it did. Their sum is every
    step trained minus the steps the final lineage kept (the identity the tests check).
    """
    lost: list[int] = []
    reached: int | None = None
    for index, attempt in enumerate(attempts):
        if index > 0:
            resumed_at = attempt.first_step - 1 if attempt.first_step is not None else reached
            lost.append(max(0, (reached or 0) - (resumed_at or 0)))
        if attempt.last_step is not None:
            reached = attempt.last_step
    return lost


def marks_s(marks: Sequence[tuple[int, float]]) -> float:
    """The seconds a run of consecutive step marks took: first to last, plus one step at their pace
    (0 for fewer than two marks: no pace to time them by)."""
    if len(marks) < 2:
        return 0.0
    span = marks[-1][1] - marks[0][1]
    return span + span / (len(marks) - 1)


def lost_own_s(attempts: Sequence[Attempt]) -> list[float]:
    """Per restart, the seconds the machine that reached the furthest step spent on the steps the
    restart trains again, timed by that machine's own step marks (first redone to last, plus one
    step): the billed time the interruption threw away, which ``spot-callbacks report`` estimates.
    ``lost_steps × the baseline's s/step`` prices the same steps at the uninterrupted run's speed."""
    lost: list[float] = []
    reached: Attempt | None = None
    for index, attempt in enumerate(attempts):
        if index > 0:
            last = reached.last_step if reached is not None else None
            resumed_at = attempt.first_step - 1 if attempt.first_step is not None else last
            redone = [] if reached is None else [(s, t) for s, t in reached.steps if s > (resumed_at or 0)]
            if len(redone) == 1 and reached is not None and len(reached.steps) >= 2:
                lost.append(per_step_s(reached))  # one step redone: timed at its machine's pace
            else:
                lost.append(marks_s(redone))
        if attempt.last_step is not None:
            reached = attempt
    return lost


@dataclass
class Outcome:
    """A variant's figures over one schedule, against the uninterrupted baseline."""

    variant: str
    schedule: str
    attempts: list[Attempt]
    baseline_s: float  # the uninterrupted run's spawn to exit
    step_s: float  # the uninterrupted run's seconds per step
    total_steps: int
    weights_equal: bool | None = None
    report: dict[str, str] = field(default_factory=dict)  # the library's own figures (report --json, plan)

    @property
    def billed_s(self) -> float:
        return sum(attempt.billed_s for attempt in self.attempts)

    @property
    def finished(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].done

    @property
    def interruptions(self) -> int:
        return sum(1 for attempt in self.attempts if attempt.interruption != "-" and not attempt.done)

    @property
    def goodput(self) -> float:
        """Uninterrupted run time / billed time."""
        return self.baseline_s / self.billed_s if self.billed_s > 0 else 0.0

    @property
    def useful_share(self) -> float:
        """Steps needed × the baseline's seconds per step / billed time (training only, no start-up)."""
        return self.total_steps * self.step_s / self.billed_s if self.finished and self.billed_s > 0 else 0.0

    @property
    def kept_training_s(self) -> float:
        """Seconds each attempt spent on the steps no later attempt trained again, each timed at its own
        attempt's speed (first to last kept step, plus one step)."""
        total = 0.0
        for index, attempt in enumerate(self.attempts):
            later = [a.first_step for a in self.attempts[index + 1 :] if a.first_step is not None]
            total += marks_s([(step, t) for step, t in attempt.steps if not later or step < later[0]])
        return total

    @property
    def kept_share(self) -> float:
        """:attr:`kept_training_s` / billed: the share of billed time that trained what was kept. Unlike
        goodput, it needs no baseline, so a box whose speed changes under other work moves it less."""
        return self.kept_training_s / self.billed_s if self.billed_s > 0 else 0.0

    @property
    def steps_trained(self) -> int:
        return sum(len(attempt.steps) for attempt in self.attempts)

    @property
    def lost_steps(self) -> list[int]:
        return lost_steps(self.attempts)

    @property
    def lost_s(self) -> list[float]:
        return [steps * self.step_s for steps in self.lost_steps]

    @property
    def lost_own_s(self) -> list[float]:
        return lost_own_s(self.attempts)

    @property
    def restart_downtimes_s(self) -> list[float]:
        """Spawn to first step of every attempt after the first that trained at all."""
        return [a.startup_s for a in self.attempts[1:] if a.startup_s is not None]

    @property
    def restart_in_fit_s(self) -> list[float]:
        """Of each restart's downtime, the part inside fit/train (see :attr:`Attempt.in_fit_s`)."""
        return [a.in_fit_s for a in self.attempts[1:] if a.startup_s is not None and a.in_fit_s is not None]
