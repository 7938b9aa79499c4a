"""What users read of SpotCheckpoint: its metrics in a real CSVLogger, its argument errors."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from spot_callbacks.lightning import SpotCheckpoint


class LoggingModel(BoringModel):
    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        self.log("train_loss", output["loss"], on_step=True, on_epoch=False)
        return output


class WaitForCommits(pl.Callback):
    """Each checkpoint has committed before the next step boundary (Lightning runs Checkpoint
    callbacks last, so SpotCheckpoint sees the commit at that boundary)."""

    def __init__(self, spot: SpotCheckpoint) -> None:
        self.spot = spot

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        assert self.spot.engine.wait_for_commit(timeout=60)


def metric_steps(metrics_csv: Path) -> dict[str, list[int]]:
    steps: dict[str, list[int]] = {}
    with metrics_csv.open() as handle:
        for row in csv.DictReader(handle):
            for name, value in row.items():
                if name != "step" and value:
                    steps.setdefault(name, []).append(int(row["step"]))
    return steps


def test_each_persist_time_is_logged_when_it_commits_at_the_loggers_step_numbering(tmp_path):
    spot = SpotCheckpoint(dirpath=str(tmp_path / "run"), every_n_steps=5, interval=None, preemption=[])
    logger = CSVLogger(tmp_path / "logs", name="", version=0)
    trainer = pl.Trainer(
        callbacks=[spot, WaitForCommits(spot)], max_steps=20, logger=logger, log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(LoggingModel())
    assert [info.step for info in spot.store.committed()] == [10, 15, 20]  # keep_last=3
    steps = metric_steps(Path(logger.log_dir) / "metrics.csv")
    assert steps["train_loss"] == list(range(20))
    # The checkpoint of global_step 5 is taken after the batch Lightning logs as step 4.
    assert steps["spot/stall_s"] == [4, 9, 14, 19] == steps["spot/persist_lag_s"]
    # Each commit at the next boundary (the step 20 one once fit waited for it), not all at the end.
    assert steps["spot/persist_s"] == [5, 10, 15, 20] == steps["spot/persist_MBps"]


def test_a_mistyped_argument_names_spot_checkpoint_and_the_closest_accepted_one(tmp_path):
    with pytest.raises(TypeError) as raised:
        SpotCheckpoint(dirpath=str(tmp_path), intervall="1h")
    message = str(raised.value)
    assert message.startswith(
        "SpotCheckpoint() got an unexpected keyword argument 'intervall' (did you mean 'interval'?)"
    )
    assert "_SpotCheckpointHooks" not in message and "every_n_steps" in message
    with pytest.raises(TypeError, match=r"^SpotCheckpoint\(\) missing a required argument: 'dirpath'"):
        SpotCheckpoint(interval="1h")


def test_the_pytorch_lightning_package_names_spot_checkpoint_too(tmp_path):
    from spot_callbacks.pytorch_lightning import SpotCheckpoint as PLSpotCheckpoint

    with pytest.raises(TypeError, match=r"did you mean 'keep_last'"):
        PLSpotCheckpoint(dirpath=str(tmp_path), keep_lst=2)


class BatchSizeModel(BoringModel):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        from lightning.pytorch.demos.boring_classes import RandomDataset
        from torch.utils.data import DataLoader

        return DataLoader(RandomDataset(32, 512), batch_size=self.batch_size)


def fit_with_batch_size(dirpath: Path, batch_size: int, max_steps: int) -> SpotCheckpoint:
    spot = SpotCheckpoint(dirpath=str(dirpath), interval=None, every_n_steps=3, preemption=[])
    trainer = pl.Trainer(
        callbacks=[spot], max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(BatchSizeModel(batch_size), ckpt_path="latest")
    return spot


def data_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "other data settings" in r.getMessage()]


def test_a_resume_with_another_batch_size_warns_once_naming_old_and_new(tmp_path, caplog):
    first = fit_with_batch_size(tmp_path / "run", batch_size=64, max_steps=3)
    assert first.store.latest().step == 3
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        fit_with_batch_size(tmp_path / "run", batch_size=64, max_steps=6)  # same settings: silent
        assert data_warnings(caplog) == []
        fit_with_batch_size(tmp_path / "run", batch_size=32, max_steps=9)
    [warning] = data_warnings(caplog)
    assert (
        "per-device batch size 64 -> 32" in warning
        and "resuming at step 6, 6 batches into epoch 0" in warning
    )
    assert "not exact" in warning and "learning-rate schedule" in warning
    assert "dataset length" not in warning and "world size" not in warning  # only what changed
