"""spot/* metrics of the Hugging Face adapter reach every report_to integration and state.log_history.

TensorBoard is the integration read back here (its event files, through tensorboard's own reader);
the others (wandb, MLflow, ...) receive the same Trainer.log rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_hf import make_trainer

from spot_callbacks.hf import SpotCheckpointCallback
from spot_callbacks.hf.checkpoint import SAVE_PATH_ENV, STAGED, TRAINER

CHECKPOINT_EVERY = 4
MAX_STEPS = 12


@pytest.fixture(autouse=True)
def _tensorboard_logs_in_output_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)  # else HF writes the events there


def spot_callback(store: Path) -> SpotCheckpointCallback:
    return SpotCheckpointCallback(
        dirpath=str(store), interval=None, every_n_steps=CHECKPOINT_EVERY, preemption=[]
    )


def tensorboard_scalars(logging_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar the run's event files hold: tag -> [(step, value)]."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(logging_dir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return scalars


def tensorboard_trainer(tmp_path: Path, run: str, callbacks: list, max_steps: int) -> transformers.Trainer:
    return make_trainer(tmp_path / run, callbacks, max_steps=max_steps, report_to=["tensorboard"])


@pytest.mark.parametrize("save_path", [STAGED, TRAINER])
def test_every_checkpoint_metric_reaches_tensorboard_and_log_history_at_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save_path: str
) -> None:
    monkeypatch.setenv(SAVE_PATH_ENV, save_path)  # stall measured at the staging, or in on_save
    ckpt = spot_callback(tmp_path / "store")
    trainer = tensorboard_trainer(tmp_path, "a", [ckpt], MAX_STEPS)
    trainer.train()

    checkpoint_steps = [info.step for info in ckpt.store.committed()]
    assert checkpoint_steps == [4, 8, 12]
    assert {info.extra["hf_save"] for info in ckpt.store.committed()} == {save_path}
    scalars = tensorboard_scalars(tmp_path / "a")
    # HF's TensorBoardCallback files training logs under train/.
    assert [step for step, _ in scalars["train/spot/stall_s"]] == checkpoint_steps
    assert [step for step, _ in scalars["train/spot/persist_lag_s"]] == checkpoint_steps
    persist_steps = [step for step, _ in scalars["train/spot/persist_s"]]
    assert persist_steps and persist_steps[-1] == MAX_STEPS  # the last commit too, logged after training
    assert all(step >= CHECKPOINT_EVERY for step in persist_steps)
    assert [step for step, _ in scalars["train/spot/persist_MBps"]] == persist_steps
    recorded = [record.persist_s for record in ckpt.engine.saves.all_records()]
    assert all(
        any(value == pytest.approx(r, rel=1e-5) for r in recorded)
        for _, value in scalars["train/spot/persist_s"]
    )

    history = trainer.state.log_history
    assert [row["step"] for row in history if "spot/stall_s" in row] == checkpoint_steps
    assert [row["step"] for row in history if "spot/persist_s" in row] == persist_steps
    assert "train/loss" in scalars  # the Trainer's own rows are untouched


def test_a_resume_logs_its_pull_time_at_the_step_it_resumed_from(tmp_path: Path) -> None:
    first = spot_callback(tmp_path / "store")
    tensorboard_trainer(tmp_path, "a", [first], 8).train()
    ckpt = spot_callback(tmp_path / "store")
    trainer = tensorboard_trainer(tmp_path, "b", [ckpt], MAX_STEPS)
    trainer.train(resume_from_checkpoint=ckpt.latest())

    scalars = tensorboard_scalars(tmp_path / "b")
    assert [step for step, _ in scalars["train/spot/resume_s"]] == [8]
    assert [step for step, _ in scalars["train/spot/stall_s"]] == [12]
    # The copy pulled into output_dir goes once a newer checkpoint commits, as the run's own copies go.
    assert sorted(p.name for p in (tmp_path / "b").glob("checkpoint-*")) == ["checkpoint-12"]


def test_a_callback_added_after_the_trainer_was_built_still_reaches_tensorboard(tmp_path: Path) -> None:
    trainer = tensorboard_trainer(tmp_path, "a", [], 8)
    ckpt = spot_callback(tmp_path / "store")
    trainer.add_callback(ckpt)  # after __init__: on_init_end never reaches it
    trainer.train()
    scalars = tensorboard_scalars(tmp_path / "a")
    assert [step for step, _ in scalars["train/spot/stall_s"]] == [4, 8]
    assert [step for step, _ in scalars["train/spot/persist_s"]][-1] == 8
