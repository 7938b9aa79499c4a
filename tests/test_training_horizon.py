"""A finished run resumed with a larger horizon trains on, as the uninterrupted longer run would.

Lightning: ``fit(max_steps=N)`` to the end, then a new Trainer with ``max_steps=M > N`` (or a larger
``max_epochs``) and ``ckpt_path="latest"``. HF: ``train()`` to ``max_steps=N``, then
``max_steps=M`` from ``ckpt.latest()``. And one warning line when the horizon changed.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

from spot_callbacks.hf import SpotCheckpointCallback
from spot_callbacks.lightning import SpotCheckpoint
from spot_callbacks.training_horizon import Horizon, limit_changes

BATCHES_PER_EPOCH = 10
HF_STEPS_PER_EPOCH = 32  # tests/scripts/hf_run.py: 256 samples, batch 8

_spec = importlib.util.spec_from_file_location("hf_run", Path(__file__).parent / "scripts" / "hf_run.py")
hf_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_run)


class ShuffledNet(pl.LightningModule):
    """Dropout, a shuffled loader and a per-step LR schedule: a resume off by one batch shows in the weights."""

    def __init__(self, scheduler: str = "step", total_steps: int = 0) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
        )
        self.scheduler, self.total_steps = scheduler, total_steps

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        if self.scheduler == "onecycle":
            scheduler: Any = torch.optim.lr_scheduler.OneCycleLR(
                optimizer, 0.05, total_steps=self.total_steps
            )
        elif self.scheduler == "cosine":
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.total_steps)
        else:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class OptimizerSteps(pl.Callback):
    """The optimizer steps this fit ran and the (epoch, batch index) of each batch."""

    def __init__(self) -> None:
        self.steps = 0
        self.batches: list[tuple[int, int]] = []
        self.warnings_before_first_batch: list[str] | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.steps += 1

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.batches:
            self.warnings_before_first_batch = horizon_warnings()
        self.batches.append((trainer.current_epoch, batch_idx))


class Recorded(logging.Handler):
    """The spot_callbacks log lines of the test running now."""

    lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            Recorded.lines.append(record.getMessage())


def horizon_warnings() -> list[str]:
    return [line for line in Recorded.lines if "training horizon" in line]


@pytest.fixture(autouse=True)
def recorded_warnings():
    handler, logger = Recorded(), logging.getLogger("spot_callbacks")
    Recorded.lines = []
    logger.addHandler(handler)
    yield Recorded.lines
    logger.removeHandler(handler)


def loader() -> DataLoader:
    data = torch.Generator().manual_seed(1234)
    x = torch.randn(32 * BATCHES_PER_EPOCH, 16, generator=data)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32, shuffle=True)


def fit(
    dirpath: Path, seed: int = 1, scheduler: str = "step", total_steps: int = 0, **limits: int
) -> tuple[pl.Trainer, OptimizerSteps, dict[str, torch.Tensor]]:
    """One ``fit`` from "latest" of ``dirpath``, with its ``max_steps`` / ``max_epochs`` (default: unbounded)."""
    counted = OptimizerSteps()
    spot = SpotCheckpoint(dirpath=str(dirpath), interval=None, preemption=[])
    trainer = pl.Trainer(
        callbacks=[spot, counted], logger=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", **{"max_steps": -1, "max_epochs": -1, **limits},
    )  # fmt: skip
    torch.manual_seed(0)  # the same initial weights in every run
    model = ShuffledNet(scheduler, total_steps)
    torch.manual_seed(seed)  # a resumed run's own seed: the checkpoint's RNG must win
    trainer.fit(model, loader(), ckpt_path="latest")
    return trainer, counted, {name: value.clone() for name, value in model.state_dict().items()}


def assert_same_weights(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    different = [name for name in expected if not torch.equal(expected[name], actual[name])]
    assert not different, f"tensors differ from the uninterrupted run: {different}"


# ----------------------------------------------------------------------------- Lightning


@pytest.mark.parametrize(
    ("first", "second"),
    [pytest.param(6, 10, id="mid-epoch-to-epoch-end"), pytest.param(6, 14, id="mid-epoch-into-the-next"),
     pytest.param(10, 14, id="epoch-end-into-the-next"), pytest.param(13, 27, id="second-epoch-to-third")],
)  # fmt: skip
def test_lightning_larger_max_steps_trains_on_like_the_uninterrupted_run(tmp_path, first, second):
    uninterrupted, _, expected = fit(tmp_path / "uninterrupted", max_steps=second)
    finished, _, _ = fit(tmp_path / "run", max_steps=first)
    assert finished.global_step == first
    resumed, counted, weights = fit(tmp_path / "run", seed=7, max_steps=second)
    assert resumed.global_step == second
    assert counted.steps == second - first  # it trained on, and redid nothing
    # The epoch goes on where it stopped: the batches are those the longer run had after `first`.
    assert counted.batches[0] == divmod(first, BATCHES_PER_EPOCH)
    assert resumed.current_epoch == uninterrupted.current_epoch
    assert_same_weights(expected, weights)


@pytest.mark.parametrize(
    "first",
    [pytest.param({"max_epochs": 1}, id="max_epochs"), pytest.param({"max_steps": 6}, id="max_steps")],
)
def test_lightning_larger_max_epochs_trains_on_like_the_uninterrupted_run(tmp_path, first):
    uninterrupted, _, expected = fit(tmp_path / "uninterrupted", max_epochs=2)
    finished, _, _ = fit(tmp_path / "run", **first)
    resumed, counted, weights = fit(tmp_path / "run", seed=7, max_epochs=2)
    assert resumed.global_step == uninterrupted.global_step == 2 * BATCHES_PER_EPOCH
    assert counted.steps == 2 * BATCHES_PER_EPOCH - finished.global_step
    assert resumed.current_epoch == uninterrupted.current_epoch == 2
    assert_same_weights(expected, weights)


def test_lightning_the_same_max_steps_again_trains_nothing(tmp_path):
    fit(tmp_path / "run", max_steps=6)
    again, counted, _ = fit(tmp_path / "run", max_steps=6)
    assert (again.global_step, counted.steps) == (6, 0)
    bigger, counted, _ = fit(tmp_path / "run", max_steps=8)
    assert (bigger.global_step, counted.steps) == (8, 2)


def test_lightning_the_same_horizon_again_says_nothing(tmp_path):
    fit(tmp_path / "run", scheduler="cosine", total_steps=6, max_steps=6)
    assert horizon_warnings() == []
    fit(tmp_path / "run", scheduler="cosine", total_steps=6, max_steps=6)
    assert horizon_warnings() == []


def test_lightning_a_larger_max_steps_and_schedule_warns_once_before_the_first_step(tmp_path):
    fit(tmp_path / "run", scheduler="cosine", total_steps=6, max_steps=6)
    resumed, counted, _ = fit(tmp_path / "run", scheduler="cosine", total_steps=10, max_steps=10)
    assert resumed.global_step == 10 and counted.steps == 4
    (warning,) = horizon_warnings()
    assert counted.warnings_before_first_batch == [warning]
    assert "resuming at step 6" in warning
    assert "max_steps 6 -> 10 (training goes on to step 10)" in warning
    # Lightning loads the scheduler's whole state: the checkpoint's T_max wins, and the message says so.
    assert "CosineAnnealingLR T_max 6 -> 10 (the checkpoint's 6 is restored over it" in warning
    assert resumed.lr_scheduler_configs[0].scheduler.T_max == 6


def test_lightning_a_onecycle_schedule_restored_shorter_than_max_steps_is_named_before_it_raises(tmp_path):
    fit(tmp_path / "run", scheduler="onecycle", total_steps=6, max_steps=6)
    with pytest.raises(ValueError, match="Tried to step"):  # torch's OneCycleLR past its total_steps
        fit(tmp_path / "run", scheduler="onecycle", total_steps=10, max_steps=10)
    (warning,) = horizon_warnings()
    assert "OneCycleLR total_steps 6 -> 10" in warning and "OneCycleLR raises when stepped past it" in warning


def test_lightning_a_smaller_max_steps_or_max_epochs_says_it_stops_at_once(tmp_path):
    fit(tmp_path / "run", max_epochs=1)
    again, counted, _ = fit(tmp_path / "run", max_steps=4)
    assert (again.global_step, counted.steps) == (10, 0)
    (warning,) = horizon_warnings()
    assert "max_steps none -> 4 (the checkpoint is at step 10 already: training stops at once)" in warning
    assert "max_epochs 1 -> none (no epoch limit now)" in warning


def test_lightning_a_larger_max_epochs_warns_naming_the_epochs(tmp_path):
    fit(tmp_path / "run", max_epochs=1)
    fit(tmp_path / "run", max_epochs=3)
    (warning,) = horizon_warnings()
    assert "max_epochs 1 -> 3 (training goes on until 3 epochs are done)" in warning


def test_a_checkpoint_without_a_recorded_horizon_compares_no_limits():
    assert Horizon.from_dict(None) is None and Horizon.from_dict("6") is None
    assert limit_changes(None, Horizon(10, None), step=6, epochs_done=0) == []
    assert Horizon.from_dict({"max_steps": True, "max_epochs": float("nan")}) == Horizon(None, None)


# ----------------------------------------------------------------------------- Hugging Face


class HfSteps(transformers.TrainerCallback):
    """The optimizer steps this train() ran."""

    def __init__(self) -> None:
        self.steps = 0
        self.warnings_before_first_step: list[str] | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.warnings_before_first_step is None:
            self.warnings_before_first_step = horizon_warnings()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps += 1


def train(
    tmp_path: Path, run: str, schedule: str = "constant", **limits: Any
) -> tuple[transformers.Trainer, HfSteps, dict[str, torch.Tensor]]:
    """One ``train()`` from the newest committed checkpoint of ``run`` (tests/test_hf.py's tiny GPT-2)."""
    ckpt = SpotCheckpointCallback(dirpath=str(tmp_path / run), interval=None, preemption=[])
    counted = HfSteps()
    output_dir = tmp_path / f"out-{run}-{len(list(tmp_path.glob(f'out-{run}-*')))}"  # a fresh disk each time
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=8, learning_rate=5e-3,
        lr_scheduler_type=schedule, warmup_steps=0 if schedule == "constant" else 3, seed=1, data_seed=7,
        save_strategy="no", logging_steps=5, report_to=[], use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, **{"max_steps": -1, **limits},
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=hf_run.build_model(), args=args, train_dataset=hf_run.TokenData(), callbacks=[ckpt, counted]
    )
    trainer.train(resume_from_checkpoint=ckpt.latest())
    return (
        trainer,
        counted,
        {name: value.detach().clone() for name, value in trainer.model.state_dict().items()},
    )


def test_hf_larger_max_steps_trains_on_like_the_uninterrupted_run(tmp_path):
    # A constant learning rate: with a decaying one the uninterrupted run's schedule differs by design.
    _, _, expected = train(tmp_path, "uninterrupted", max_steps=10)
    finished, _, _ = train(tmp_path, "run", max_steps=6)
    assert finished.state.global_step == 6
    resumed, counted, weights = train(tmp_path, "run", max_steps=10)
    assert (resumed.state.global_step, counted.steps) == (10, 4)
    assert_same_weights(expected, weights)
    (warning,) = horizon_warnings()
    assert "max_steps 6 -> 10 (training goes on to step 10)" in warning and "learning rate" not in warning
    assert counted.warnings_before_first_step == [warning]


def test_hf_larger_num_train_epochs_trains_on_like_the_uninterrupted_run(tmp_path):
    _, _, expected = train(tmp_path, "uninterrupted", num_train_epochs=2)
    train(tmp_path, "run", num_train_epochs=1)
    resumed, counted, weights = train(tmp_path, "run", num_train_epochs=2)
    assert (resumed.state.global_step, counted.steps) == (2 * HF_STEPS_PER_EPOCH, HF_STEPS_PER_EPOCH)
    assert_same_weights(expected, weights)
    (warning,) = horizon_warnings()
    assert "num_train_epochs 1 -> 2 (training goes on until 2 epochs are done)" in warning


def test_hf_a_rebuilt_linear_schedule_names_the_learning_rate_jump(tmp_path):
    train(tmp_path, "run", schedule="linear", max_steps=6)
    assert horizon_warnings() == []
    resumed, counted, _ = train(tmp_path, "run", schedule="linear", max_steps=10)
    assert (resumed.state.global_step, counted.steps) == (10, 4)
    (warning,) = horizon_warnings()
    # The linear decay had reached 0 at step 6 of 6; rebuilt for 10 steps it is 5e-3 * 4/7 there.
    assert "max_steps 6 -> 10" in warning and "learning rate 0 -> 0.00286 at step 6" in warning


def test_hf_the_same_max_steps_again_says_nothing(tmp_path):
    train(tmp_path, "run", schedule="linear", max_steps=6)
    again, counted, _ = train(tmp_path, "run", schedule="linear", max_steps=6)
    # As HF's own train(resume_from_checkpoint=...) of a finished run (transformers 5.24): its loop
    # checks max_steps only after a step, so one more step runs. No callback event comes before it.
    assert (again.state.global_step, counted.steps) == (7, 1)
    assert horizon_warnings() == []
