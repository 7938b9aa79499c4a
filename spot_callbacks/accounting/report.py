"""A run's checkpoint and interruption costs as people read them: ``spot-callbacks report``,
``spot-callbacks plan`` and the summary the adapters log at the end of training.

The numbers come from :mod:`spot_callbacks.accounting.costs` (the ledger in the manifests, the model); this
module only arranges them into (label, value) rows that the command line renders as a table.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from spot_callbacks._format import format_money, format_seconds, human_size, printable
from spot_callbacks.accounting.attempts import AttemptsSummary
from spot_callbacks.accounting.costs import SECONDS_PER_HOUR, SpotPlan
from spot_callbacks.accounting.ledger import EMERGENCY_REASONS, RunLedger, finite_number


@dataclass(frozen=True)
class RunHistory:
    """A run's costs as far as its store (or a live engine) tells: the lineage's ledger and the checkpoints at hand.

    ``checkpoints``: the checkpoints whose manifests are at hand (retention keeps only the newest),
    oldest first; ``ledger``: the totals of the newest one's lineage.
    """

    url: str
    ledger: RunLedger
    checkpoints: tuple[Any, ...] = ()  # CheckpointInfo
    from_ledger: bool = True
    at_hand: str = "kept in the store"  # what ``checkpoints`` are, in the report's words

    @classmethod
    def from_checkpoints(cls, url: str, infos: Sequence[Any]) -> RunHistory:
        """From the manifests alone; the most recently committed one speaks for the run.

        The newest by commit time, not by step: a run resumed from an older checkpoint (after a
        damaged newer one was skipped) writes the history that is alive.
        """
        infos = tuple(infos)
        if not infos:
            return cls(url, RunLedger(), infos)
        newest = max(infos, key=lambda info: (info.created, info.step))
        ledger = RunLedger.from_json(newest.extra.get("ledger"), newest.url)
        if ledger is None:
            return cls(url, RunLedger.from_manifests(infos), infos, from_ledger=False)
        return cls(url, ledger, infos)

    @property
    def newest(self) -> Any:
        return max(self.checkpoints, key=lambda info: (info.created, info.step)) if self.checkpoints else None

    @property
    def awaiting_resume(self) -> bool:
        """The newest checkpoint is an emergency one: that run was interrupted and not resumed yet."""
        newest = self.newest
        return newest is not None and newest.reason in EMERGENCY_REASONS

    @property
    def interruptions(self) -> int:
        return self.ledger.interruptions + int(self.awaiting_resume)


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "n/a"


def _by_reason(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def history_rows(
    history: RunHistory,
    spot_price: float | None = None,
    on_demand_price: float | None = None,
    records: Sequence[Any] = (),
    attempts: AttemptsSummary | None = None,
) -> list[tuple[str, str]]:
    """The run's costs as (label, value) rows: what ``spot-callbacks report`` and the end-of-training summary show.

    ``records``: this process's :class:`~spot_callbacks.persist.PersistRecord` (the summary);
    without them, persist times come from the manifests at hand. ``attempts``: the processes'
    records (:mod:`~spot_callbacks.accounting.attempts`); with them, billed time, lost work and
    goodput count every process from its start to its exit, else they come from the ledger.
    """
    ledger = history.ledger
    rows: list[tuple[str, str]] = [("checkpoints", _checkpoints_row(history))]
    runs = ledger.resumes + 1
    rows.append(("training time", f"{format_seconds(ledger.train_s)} in {runs} run{'s' if runs > 1 else ''}"))
    rows.append(("training stall", _stall_row(history)))
    persist = _persist_row(history, records)
    if persist:
        rows.append(("persist (background)", persist))
    rows.append(("interruptions", _interruptions_row(history)))
    if attempts is not None and not attempts.outcomes:
        attempts = None  # no process left a record: the ledger's figures, as before records
    if attempts is not None:
        rows.extend(_attempt_summary_rows(attempts))
    else:
        lost = f"{format_seconds(ledger.lost_work_measured_s)} measured"
        if ledger.lost_work_estimated_s > 0 or any(not r.lost_work_measured for r in ledger.recent_resumes):
            lost += (
                f" + up to {format_seconds(ledger.lost_work_estimated_s)} estimated (resumes after a crash)"
            )
        rows.append(("lost work", lost))
    if ledger.resumes:
        rows.append(("resumes", _resumes_row(history)))
    if attempts is None:
        goodput = ledger.goodput
        rows.append(
            (
                "goodput",
                "n/a"
                if goodput is None
                else f"{100 * goodput:.1f}% of {format_seconds(ledger.billed_s)} billed was productive training",
            )
        )
    billed_s = attempts.billed_s if attempts is not None else ledger.billed_s
    if spot_price is not None:
        rows.extend(_price_rows(history, spot_price, on_demand_price, billed_s))
    if not history.from_ledger:
        rows.append(("note", "these manifests carry no ledger: totals cover the checkpoints at hand only"))
    return rows


def _checkpoints_row(history: RunHistory) -> str:
    ledger = history.ledger
    kept = len(history.checkpoints)
    taken = ledger.checkpoint_count
    newest = history.newest
    what = f"{taken} taken" + (f" ({_by_reason(ledger.checkpoints)})" if ledger.checkpoints else "")
    if kept and kept != taken:
        what += f"; {kept} {history.at_hand}"
    if newest is not None:
        what += f"; newest step {newest.step} ({human_size(newest.size_bytes)})"
    return what


def _stall_row(history: RunHistory) -> str:
    ledger = history.ledger
    stall = f"{format_seconds(ledger.stall_s)} total ({_percent(ledger.stall_s, ledger.train_s)} of training)"
    stalls = [finite_number(info.metrics.get("stall_s")) for info in history.checkpoints]
    if _median(stalls) is not None:
        stall += f", median {format_seconds(_median(stalls))} per checkpoint"
    if ledger.slowdown_s >= 0.005:
        stall += f"; + {format_seconds(ledger.slowdown_s)} background slowdown (estimated)"
    return stall


def _interruptions_row(history: RunHistory) -> str:
    ledger = history.ledger
    interruptions = f"{history.interruptions}"
    if history.interruptions:
        parts = [f"{ledger.interruptions} resumed"] if ledger.interruptions else []
        if history.awaiting_resume:
            newest = history.newest
            parts.append(f"1 awaiting resume from step {newest.step} ({newest.reason})")
        interruptions += f" ({', '.join(parts)})"
    continued = ledger.resumes - ledger.interruptions
    if continued:
        interruptions += f"; {continued} finished run{'s' if continued > 1 else ''} continued"
    return interruptions


def _resumes_row(history: RunHistory) -> str:
    ledger = history.ledger
    n = ledger.resumes
    resume = (
        f"{n}: pull {format_seconds(ledger.pull_s / n)}, load {format_seconds(ledger.load_s / n)} on average"
    )
    downtime = f"downtime {format_seconds(ledger.downtime_s)} total"
    if ledger.downtime_unknown:
        downtime += f" ({ledger.downtime_unknown} unknown)"
    return f"{resume}; {downtime}"


def _attempt_summary_rows(attempts: AttemptsSummary) -> list[tuple[str, str]]:
    processes = len(attempts.outcomes)
    hard = sum(outcome.hard_loss for outcome in attempts.outcomes[:-1])  # the last may still be running
    waits = [
        outcome.record.lock_wait_s for outcome in attempts.outcomes if outcome.record.lock_wait_s is not None
    ]
    lock = f"; waiting for the run lock {format_seconds(sum(waits))} in all" if waits else ""
    goodput = attempts.goodput
    return [
        ("billed time", f"{format_seconds(attempts.billed_s)} in {processes} process{'es' if processes > 1 else ''}, "
                        f"each from its start to its exit (imports, lock, pull and uploads included){lock}"),
        ("lost work", f"{format_seconds(attempts.lost_s)}: steps trained past the point the next process "
                      f"resumed from ({hard} hard loss{'es' if hard != 1 else ''} without a notice)"),
        ("goodput", "n/a" if goodput is None else
                    f"{100 * goodput:.1f}% of {format_seconds(attempts.billed_s)} billed was training kept"),
    ]  # fmt: skip


def attempt_table_rows(attempts: AttemptsSummary) -> list[tuple[str, ...]]:
    """The processes as table rows (:data:`ATTEMPT_HEADERS`), oldest first."""
    rows: list[tuple[str, ...]] = []
    for outcome in attempts.outcomes:
        record = outcome.record
        when = datetime.fromtimestamp(record.started, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        resumed = "fresh" if record.resumed_from is None else str(record.resumed_from)
        wait = "-" if record.lock_wait_s is None else format_seconds(record.lock_wait_s)
        if record.lock_cause and record.lock_cause != "free":
            wait += f" ({record.lock_cause})"
        end = record.end or "no end (killed, or running)"
        rows.append(
            (
                when, record.host, resumed, wait,
                "-" if outcome.downtime_s is None else format_seconds(outcome.downtime_s),
                format_seconds(outcome.trained_s), format_seconds(outcome.lost_s),
                format_seconds(outcome.billed_s), end,
            )
        )  # fmt: skip
    return rows


ATTEMPT_HEADERS = (
    "STARTED (UTC)",
    "HOST",
    "FROM STEP",
    "LOCK WAIT",
    "TO FIRST STEP",
    "TRAINED",
    "LOST",
    "BILLED",
    "END",
)


def attempt_json(attempts: AttemptsSummary) -> list[dict[str, Any]]:
    """The processes for ``report --json`` (the schema in docs/cli.md)."""
    return [
        {
            "run_id": outcome.record.run_id, "host": outcome.record.host, "started": outcome.record.started,
            "resumed_from": outcome.record.resumed_from, "lock_wait_s": outcome.record.lock_wait_s,
            "lock_cause": outcome.record.lock_cause, "first_step": outcome.record.first_step,
            "last_step": outcome.record.last_step, "to_first_step_s": outcome.downtime_s,
            "trained_s": round(outcome.trained_s, 3), "lost_s": round(outcome.lost_s, 3),
            "lost_steps": outcome.lost_steps, "billed_s": round(outcome.billed_s, 3),
            "end": outcome.record.end, "hard_loss": outcome.hard_loss,
        }
        for outcome in attempts.outcomes
    ]  # fmt: skip


def _price_rows(
    history: RunHistory, spot_price: float, on_demand_price: float | None, billed_s: float
) -> list[tuple[str, str]]:
    ledger = history.ledger
    billed_h = billed_s / SECONDS_PER_HOUR
    spot_cost = billed_h * spot_price
    rows = [
        ("spot cost", f"{format_money(spot_cost)} ({billed_h:.2f} h billed x {format_money(spot_price)}/h)")
    ]
    if on_demand_price is not None:
        on_demand_cost = ledger.train_s / SECONDS_PER_HOUR * on_demand_price
        saved = on_demand_cost - spot_cost
        verdict = (
            f"spot saved {format_money(saved)} ({_percent(saved, on_demand_cost)})"
            if saved >= 0
            else f"spot cost {format_money(-saved)} more"
        )
        rows.append(
            (
                "on-demand cost",
                f"{format_money(on_demand_cost)} for the training time, uninterrupted: {verdict}",
            )
        )
    return rows


def _persist_row(history: RunHistory, records: Sequence[Any]) -> str:
    if records:
        persist = [r.persist_s for r in records]
        speeds = [r.mb_per_s for r in records if math.isfinite(r.mb_per_s)]
        text = f"median {format_seconds(statistics.median(persist))} per checkpoint"
        text += f" over {len(records)} committed by this run"
        if speeds:
            text += f", {statistics.median(speeds):.0f} MB/s"
        return text
    uploads = [finite_number(info.metrics.get("upload_s")) for info in history.checkpoints]
    writes = [finite_number(info.metrics.get("write_s")) for info in history.checkpoints]
    if _median(uploads) is None:
        return ""
    text = f"median upload {format_seconds(_median(uploads))}"
    if _median(writes) is not None:
        text += f" + write {format_seconds(_median(writes))}"
    rates = [
        info.size_bytes / 1e6 / upload
        for info, upload in zip(history.checkpoints, uploads, strict=True)
        if upload
    ]
    if rates:
        text += f", {statistics.median(rates):.0f} MB/s"
    return text + f" (over the {len(uploads)} checkpoints kept)"


def resume_rows(history: RunHistory) -> list[tuple[str, ...]]:
    """The recent resumes as table rows: resumed (UTC), from step, after, pull, load, lost work, downtime."""
    rows: list[tuple[str, ...]] = []
    for record in history.ledger.recent_resumes:
        when = datetime.fromtimestamp(record.resumed_at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        lost = format_seconds(record.lost_work_s)
        if not record.lost_work_measured:
            lost = f"<= {lost} (est.)"
        rows.append(
            (
                when,
                str(record.from_step),
                record.from_reason,
                format_seconds(record.pull_s),
                format_seconds(record.load_s),
                lost if record.interrupted else "-",
                format_seconds(record.downtime_s) if record.interrupted else "-",
            )
        )
    return rows


RESUME_HEADERS = ("RESUMED (UTC)", "FROM STEP", "AFTER", "PULL", "LOAD", "LOST WORK", "DOWNTIME")


def format_rows(rows: Sequence[tuple[str, str]], indent: str = "  ") -> str:
    """Label/value rows as aligned plain-text lines, every cell through ``printable`` (a value may
    quote a manifest's ``reason``)."""
    rows = [(printable(label), printable(value)) for label, value in rows]
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join(f"{indent}{label.ljust(width)}  {value}" for label, value in rows)


def plan_rows(plan: SpotPlan) -> list[tuple[str, str]]:
    """A :class:`SpotPlan` as (label, value) rows, as ``spot-callbacks plan`` prints them."""
    rate = plan.interruptions_per_hour
    mtbf = "no interruptions" if rate == 0 else f"one every {format_seconds(SECONDS_PER_HOUR / rate)}"
    if never_finishes(plan):
        spot = (
            f"this job effectively never finishes on spot: an interruption comes every "
            f"{format_seconds(SECONDS_PER_HOUR / rate)} on average, and a checkpoint "
            f"({format_seconds(plan.checkpoint_s)}) plus a resume ({format_seconds(plan.resume_s)}) leave almost no "
            f"interval that completes ({_expected_hours(plan.spot_hours)} expected); make checkpoints and resumes "
            "faster, or run on demand"
        )
    else:
        spot = (
            f"{format_money(plan.spot_cost)}, {plan.spot_hours:.2f} h expected "
            f"({plan.expected_interruptions:.1f} interruptions) at {format_money(plan.spot_price)}/h"
        )
    rows = [
        ("job", f"{plan.work_hours:g} h of training; checkpoint {format_seconds(plan.checkpoint_s)}, "
                f"resume {format_seconds(plan.resume_s)}; {rate:g} interruptions/h ({mtbf})"),
        ("optimal interval", f"{format_seconds(plan.interval_s)} (Daly; Young: {format_seconds(plan.young_interval_s)})"),
        ("spot", spot),
        ("on demand", f"{format_money(plan.on_demand_cost)}, {plan.on_demand_hours:.2f} h "
                      f"at {format_money(plan.on_demand_price)}/h"),
    ]  # fmt: skip
    if plan.savings >= 0:
        verdict = f"spot saves {format_money(plan.savings)} ({_percent(plan.savings, plan.on_demand_cost)})"
    else:
        verdict = f"on demand saves {format_money(-plan.savings)} ({_percent(-plan.savings, plan.spot_cost)})"
    rows.append(("verdict", verdict))
    break_even = plan.break_even_interruptions_per_hour
    if break_even == 0:
        text = "spot is not cheaper per hour: on demand wins at any interruption rate"
    elif math.isinf(break_even):
        text = "spot stays cheaper at any interruption rate"
    else:
        text = (
            f"{break_even:.3g} interruptions/h (one every {format_seconds(SECONDS_PER_HOUR / break_even)}): "
            "above it on demand is cheaper"
        )
    rows.append(("break-even rate", text))
    return rows


NEVER_FINISHES_FACTOR = 100.0  # expected spot time over the work itself past which "cost" means nothing


def never_finishes(plan: SpotPlan) -> bool:
    """The expected time on spot is unbounded, or so many times the work that no one would wait for it.

    Example:
        >>> from spot_callbacks.accounting.costs import plan_job
        >>> never_finishes(plan_job(work_hours=100, spot_price=1, on_demand_price=3,
        ...     interruptions_per_hour=20, checkpoint_s=300, resume_s=600))
        True
    """
    return not math.isfinite(plan.spot_hours) or plan.spot_hours > NEVER_FINISHES_FACTOR * plan.work_hours


def _expected_hours(hours: float) -> str:
    if not math.isfinite(hours):
        return "an unbounded time"
    return f"{hours:,.0f} h" if hours < 1e9 else f"{hours:.1e} h"


def write_plan_plot(plan: SpotPlan, path: str | Any, points: int = 400) -> None:
    """Write a PNG of the expected cost against the checkpoint interval: the spot curve, the
    on-demand line and the optimum marked (matplotlib's Agg canvas: no display needed).

    Raises ImportError when matplotlib is not installed.
    """
    # A bare Figure renders with the Agg canvas: no pyplot, no display, no global backend switch.
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def text(label: str) -> str:  # a bare "$" starts matplotlib's math mode
        return label.replace("$", r"\$")

    optimum_s = plan.interval_s
    if math.isfinite(optimum_s) and optimum_s > 0:
        low_s, high_s = optimum_s / 30.0, optimum_s * 30.0
    else:  # nothing interrupts: every interval is fine, longer ones a little cheaper
        low_s, high_s = max(plan.checkpoint_s, 1.0), max(plan.checkpoint_s, 1.0) * 1000.0
    intervals_s = [low_s * (high_s / low_s) ** (i / (points - 1)) for i in range(points)]
    costs = [plan.spot_cost_at(interval) for interval in intervals_s]
    minutes = [interval / 60.0 for interval in intervals_s]

    figure = Figure(figsize=(8, 5), dpi=120, layout="constrained")
    axes = figure.add_subplot()
    axes.plot(
        minutes, costs, color="tab:blue", linewidth=2,
        label=text(f"spot at {format_money(plan.spot_price)}/h, {plan.interruptions_per_hour:g} interruptions/h"),
    )  # fmt: skip
    axes.axhline(
        plan.on_demand_cost, color="tab:red", linestyle="--", linewidth=1.5,
        label=text(f"on demand at {format_money(plan.on_demand_price)}/h: {format_money(plan.on_demand_cost)}"),
    )  # fmt: skip
    if math.isfinite(optimum_s) and optimum_s > 0:
        axes.plot(
            [optimum_s / 60.0], [plan.spot_cost], marker="o", markersize=9, color="black", linestyle="none",
            label=text(f"optimum: every {format_seconds(optimum_s)}, {format_money(plan.spot_cost)}"),
        )  # fmt: skip
        axes.axvline(optimum_s / 60.0, color="black", linewidth=0.8, alpha=0.4)
    finite_costs = [cost for cost in costs if math.isfinite(cost)]
    top = max(plan.on_demand_cost, plan.spot_cost) * 1.6
    if finite_costs:
        top = min(top, max(finite_costs) * 1.05) if max(finite_costs) > plan.on_demand_cost else top
    axes.set_ylim(0, top if top > 0 else 1.0)
    axes.set_xscale("log")
    axes.set_xlim(minutes[0], minutes[-1])
    axes.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: text(f"${value:,.0f}")))
    axes.set_xlabel("checkpoint interval (minutes, log scale)")
    axes.set_ylabel("expected cost of the job")
    axes.set_title(
        f"{plan.work_hours:g} h of training; checkpoint {format_seconds(plan.checkpoint_s)}, "
        f"resume {format_seconds(plan.resume_s)}"
    )
    axes.grid(True, which="both", alpha=0.25)
    axes.legend(loc="best", framealpha=0.95)
    figure.savefig(path, format="png")
