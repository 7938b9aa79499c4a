"""The step-cost benchmark's own arithmetic, and the replay's per-machine split (no training here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import replay  # noqa: E402
import step_cost  # noqa: E402
from _replay_outcome import Attempt, Outcome  # noqa: E402


def test_the_steady_part_leaves_out_the_warm_up_and_the_last_two_percent() -> None:
    # 101 steps, 20 ms apart except a slow first gap (warm-up) and a slow last one (the end's checkpoint)
    times = [0.0, 1.0, *(1.0 + 0.02 * i for i in range(1, 99)), 10.0]
    steps = [(i + 1, t) for i, t in enumerate(times)]
    gaps = step_cost.steady_step_s(steps, skip=1)
    assert len(gaps) == 100 - 1 - 2
    assert gaps == pytest.approx([0.02] * len(gaps))


def test_per_step_figures_come_from_the_window_between_the_two_marked_steps() -> None:
    # [step, wall, main thread CPU, process CPU, involuntary switches, minor faults]
    run = step_cost.Run(
        "spot", [0.02], 10.0,
        window={"from": [201.0, 100.0, 50.0, 60.0, 10.0, 1000.0], "to": [1201.0, 120.0, 68.0, 80.0, 110.0, 3000.0]},
        gc={"gen0 s": 0.001, "gen2 s": 0.009},
    )  # fmt: skip
    assert run.per_step_ms(1) == pytest.approx(20.0)  # wall
    assert run.per_step_ms(2) == pytest.approx(18.0)  # the main thread's CPU
    assert run.per_step_ms(3) == pytest.approx(20.0)  # the process's CPU
    assert run.switches_per_step() == pytest.approx(0.1)
    assert run.count_per_step(5) == pytest.approx(2.0)
    assert run.gc_ms_per_step() == pytest.approx(0.01)
    assert step_cost.Run("none", [0.02], 10.0).per_step_ms(1) is None  # no window: unknown, not zero


def test_each_variant_is_compared_with_the_runs_without_a_checkpoint() -> None:
    runs = [
        step_cost.Run("none", [0.020, 0.020, 0.020], 60.0),
        step_cost.Run("spot", [0.021, 0.022, 0.023], 60.0, threads={"spot-writer": 0.5}),
    ]
    rows = {row[0]: row for row in step_cost.summary_rows(runs, ["none", "spot"])}
    assert rows["none"][4] == "1.000"
    assert rows["spot"][4] == "1.100"  # median 22 ms against 20
    assert rows["spot"][-1] == "spot-writer 0.50"  # CPU seconds per training minute


def test_the_replay_splits_each_machines_billed_time_into_start_up_training_and_exit() -> None:
    first = Attempt(0.0, 30.0, 143, "SIGTERM@25.0s+5s", [(1, 5.0), (2, 5.02), (1001, 25.0)], False, 4.0)
    last = Attempt(33.0, 60.0, 0, "-", [(1001, 38.0), (1501, 50.0)], True, 36.0)
    line = replay.breakdown(Outcome("spot", "fixed", [first, last], 40.0, 0.02, 1501))
    assert line == (
        "spot (fixed): 5.0 + 1001 steps in 20.0 s (20.0 ms/step) + 5.0 s; "
        "5.0 + 501 steps in 12.0 s (24.0 ms/step) + 10.0 s"
    )
