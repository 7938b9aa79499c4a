"""SpotCheckpoint on real Lightning trainers: emergency saves, bit-identical resume, DDP, YAML."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from spot_callbacks import CheckpointStore, ConfigError, PersistError, StoreUnavailableError
from spot_callbacks.accounting.report import RunHistory
from spot_callbacks.lightning import SpotCheckpoint

SCRIPT = Path(__file__).parent / "scripts" / "lightning_run.py"
RUN_TIMEOUT_S = 240


def run_training(tmp_path: Path, *args: str, scratch: str) -> subprocess.CompletedProcess:
    """One training process with its own, initially empty, scratch disk (a fresh machine)."""
    env = {**os.environ, "SPOT_SCRATCH": str(tmp_path / f"scratch-{scratch}"), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


def final_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_bit_identical(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    different = [name for name in expected if not torch.equal(expected[name], actual[name])]
    assert not different, f"tensors differ from the uninterrupted run: {different}"


def interrupted_then_resumed(tmp_path, url, options, sigterm_steps, extra=()) -> dict[str, torch.Tensor]:
    """SIGTERM at each step in turn (each run on a fresh machine), then a run to the end."""
    out = tmp_path / "resumed.pt"
    common = ["--dirpath", url, "--storage-options", json.dumps(options), "--out", str(out), *extra]
    for index, step in enumerate(sigterm_steps):
        seed = "1" if index == 0 else str(100 + index)  # resumed runs get another seed_everything
        done = run_training(
            tmp_path, *common, "--seed", seed, "--sigterm-at-step", str(step), scratch=f"i{index}"
        )
        assert done.returncode == 143, done.stdout[-2000:] + done.stderr[-4000:]
        assert "emergency checkpoint committed" in done.stderr
        assert "checkpoint costs of" in done.stderr  # the summary of a preempted run too
        assert '"global_step"' not in done.stdout  # fit() ended the process (SystemExit 143)
        newest = CheckpointStore(url, storage_options=options).latest()
        assert newest is not None and newest.reason == "preemption" and newest.step == step + 1
    done = run_training(tmp_path, *common, "--seed", "999", scratch="final")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "resuming from" in done.stderr
    assert_interruptions_accounted(CheckpointStore(url, storage_options=options), sigterm_steps)
    assert "checkpoint costs of" in done.stderr  # the summary at the end of fit
    return final_weights(out)


def assert_interruptions_accounted(store: CheckpointStore, sigterm_steps: list[int]) -> None:
    """What `spot-callbacks report` reads: each SIGTERM an interruption, resumed, with no work lost."""
    history = RunHistory.from_checkpoints(store.url, store.committed())
    ledger = history.ledger
    assert history.interruptions == ledger.resumes == len(sigterm_steps)
    assert ledger.checkpoints.get("preemption") == len(sigterm_steps)
    # The emergency checkpoint holds the step the signal landed in: no step is redone.
    assert [(r.from_step, r.from_reason) for r in ledger.recent_resumes] == [
        (step + 1, "preemption") for step in sigterm_steps
    ]
    assert ledger.lost_work_s == 0.0 and all(r.lost_work_measured for r in ledger.recent_resumes)
    assert all(r.pull_s > 0 and r.downtime_s is not None and r.downtime_s >= 0 for r in ledger.recent_resumes)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Uninterrupted runs, computed once per configuration."""
    cache: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}

    def get(*extra: str) -> dict[str, torch.Tensor]:
        if extra not in cache:
            folder = tmp_path_factory.mktemp("baseline")
            out = folder / "final.pt"
            done = run_training(
                folder, "--dirpath", str(folder / "run"), "--out", str(out), *extra, scratch="b"
            )
            assert done.returncode == 0, done.stderr[-4000:]
            cache[extra] = final_weights(out)
        return cache[extra]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "sigterm_steps",
    [pytest.param([7], id="mid-epoch"), pytest.param([9], id="last-batch-of-epoch"),
     pytest.param([5, 19, 22], id="three-interruptions")],
)  # fmt: skip
def test_sigterm_to_s3_and_resume_on_a_fresh_machine_is_bit_identical(
    tmp_path, s3_server, baseline, sigterm_steps
):
    url = f"s3://{s3_server.bucket}/lightning-{tmp_path.name}"
    resumed = interrupted_then_resumed(tmp_path, url, s3_server.storage_options, sigterm_steps)
    assert_bit_identical(baseline(), resumed)


@pytest.mark.slow
def test_resume_with_two_loader_workers_is_bit_identical(tmp_path, baseline):
    resumed = interrupted_then_resumed(
        tmp_path, str(tmp_path / "run"), {}, [12], extra=["--num-workers", "2"]
    )
    assert_bit_identical(baseline("--num-workers", "2"), resumed)


@pytest.mark.slow
def test_resume_with_a_stateful_loader_is_bit_identical(tmp_path, baseline):
    resumed = interrupted_then_resumed(tmp_path, str(tmp_path / "run"), {}, [13], extra=["--stateful-loader"])
    assert_bit_identical(baseline("--stateful-loader"), resumed)


@pytest.mark.slow
def test_ddp_sigterm_to_one_rank_checkpoints_every_rank_at_the_same_step(tmp_path, baseline):
    url = str(tmp_path / "run")
    resumed = interrupted_then_resumed(
        tmp_path, url, {}, [7], extra=["--devices", "2", "--sigterm-rank", "1"]
    )
    assert_bit_identical(baseline("--devices", "2"), resumed)
    [info] = CheckpointStore(url).committed()[-1:]
    assert info.reason == "end" and info.step == 15  # 160 samples per rank, batch 32, 3 epochs


@pytest.mark.slow
def test_standalone_pytorch_lightning_package_gets_the_same_callback(tmp_path, baseline):
    resumed = interrupted_then_resumed(
        tmp_path, str(tmp_path / "run"), {}, [7], extra=["--package", "pytorch_lightning"]
    )
    assert_bit_identical(baseline(), resumed)  # same math, same weights as lightning.pytorch


@pytest.mark.slow
@pytest.mark.parametrize("ckpt_path", ["latest", "last"])
def test_nothing_committed_trains_from_scratch_like_a_run_without_the_callback(tmp_path, ckpt_path):
    plain = run_training(tmp_path, "--out", str(tmp_path / "plain.pt"), scratch="p")
    assert plain.returncode == 0, plain.stderr[-3000:]
    spot = run_training(
        tmp_path, "--dirpath", str(tmp_path / "run"), "--ckpt-path", ckpt_path, "--out", str(tmp_path / "spot.pt"),
        scratch="s",
    )  # fmt: skip
    assert spot.returncode == 0, spot.stderr[-3000:]
    assert "no committed checkpoint" in spot.stderr
    assert_bit_identical(final_weights(tmp_path / "plain.pt"), final_weights(tmp_path / "spot.pt"))


@pytest.mark.slow
def test_ckpt_path_last_resolves_to_the_newest_committed_remote_checkpoint(tmp_path, s3_server, baseline):
    url = f"s3://{s3_server.bucket}/last-{tmp_path.name}"
    options = json.dumps(s3_server.storage_options)
    first = run_training(
        tmp_path, "--dirpath", url, "--storage-options", options, "--out", str(tmp_path / "x.pt"),
        "--sigterm-at-step", "12", scratch="1",
    )  # fmt: skip
    assert first.returncode == 143
    second = run_training(
        tmp_path, "--dirpath", url, "--storage-options", options, "--out", str(tmp_path / "y.pt"),
        "--ckpt-path", "last", "--seed", "5", scratch="2",
    )  # fmt: skip
    assert second.returncode == 0 and "step-000000013" in second.stderr
    assert_bit_identical(baseline(), final_weights(tmp_path / "y.pt"))


@pytest.mark.slow
def test_checkpoint_metrics_reach_the_trainer_logger(tmp_path):
    args = [
        "--dirpath",
        str(tmp_path / "run"),
        "--every-n-steps",
        "5",
        "--logger-dir",
        str(tmp_path / "logs"),
    ]
    first = run_training(
        tmp_path, *args, "--out", str(tmp_path / "a.pt"), "--sigterm-at-step", "12", scratch="1"
    )
    assert first.returncode == 143
    summary = first.stderr[first.stderr.index("checkpoint costs of") :]  # logged on the preempted run too
    assert "1 preemption" in summary, summary[:2000]
    second = run_training(tmp_path, *args, "--out", str(tmp_path / "b.pt"), scratch="2")
    assert second.returncode == 0
    columns: set[str] = set()
    values: dict[str, list[float]] = {}
    for metrics in (tmp_path / "logs").rglob("metrics.csv"):
        header, *rows = [line.split(",") for line in metrics.read_text().splitlines()]
        columns |= set(header)
        for row in rows:
            for name, value in zip(header, row, strict=False):
                if name.startswith("spot/") and value:
                    values.setdefault(name, []).append(float(value))
    expected = {"spot/stall_s", "spot/persist_s", "spot/persist_MBps", "spot/resume_s", "spot/persist_lag_s"}
    assert expected <= columns
    assert all(v >= 0 for v in values["spot/stall_s"]) and len(values["spot/stall_s"]) >= 4
    assert values["spot/persist_MBps"] and min(values["spot/persist_MBps"]) > 0


# ----------------------------------------------------------------------------- in-process tests


def boring_trainer(callback, **kwargs) -> pl.Trainer:
    defaults = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "max_steps": 6}
    return pl.Trainer(callbacks=[callback], **{**defaults, **kwargs})


def test_lightning_cli_yaml_config_builds_the_callback(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
trainer:
  max_steps: 6
  logger: false
  enable_progress_bar: false
  callbacks:
    - class_path: spot_callbacks.lightning.SpotCheckpoint
      init_args:
        dirpath: {tmp_path / "run"}
        interval: 1h30min
        every_n_steps: 3
        keep_last: 1
        preemption: [SIGTERM, SIGUSR1]
"""
    )
    cli = LightningCLI(BoringModel, args=["--config", str(config)], run=False, save_config_callback=None)
    [spot] = [cb for cb in cli.trainer.callbacks if isinstance(cb, SpotCheckpoint)]
    assert spot.config.interval_seconds == 5400 and spot.config.preemption == ["SIGTERM", "SIGUSR1"]
    cli.trainer.fit(cli.model)
    assert [info.step for info in spot.store.committed()] == [6]  # keep_last=1 after steps 3 and 6

    bad = tmp_path / "bad.yaml"
    bad.write_text(config.read_text().replace("keep_last: 1", "keep_last: -2"))
    with pytest.raises(ValueError, match=r"keep_last=-2 must be an integer >= 0"):
        LightningCLI(BoringModel, args=["--config", str(bad)], run=False, save_config_callback=None)


def test_from_yaml_and_a_bad_key(tmp_path):
    good = tmp_path / "spot.yaml"
    good.write_text(f"dirpath: {tmp_path / 'run'}\ninterval: 15min\nkeep_last: 2\n")
    spot = SpotCheckpoint.from_yaml(good)
    assert spot.config.interval_seconds == 900 and spot.config.keep_last == 2
    (tmp_path / "typo.yaml").write_text("dirpath: x\nintervall: 1h\n")
    with pytest.raises(ConfigError, match="did you mean 'interval'"):
        SpotCheckpoint.from_yaml(tmp_path / "typo.yaml")


def test_exception_between_batches_is_checkpointed_and_reraised(tmp_path):
    class FailsAtEpochEnd(BoringModel):
        def on_train_epoch_end(self):
            raise RuntimeError("boom at epoch end")

    spot = SpotCheckpoint(dirpath=str(tmp_path / "run"), interval=None, preemption=[])
    with pytest.raises(RuntimeError, match="boom at epoch end"):
        boring_trainer(spot, max_steps=-1, max_epochs=2, limit_train_batches=4).fit(FailsAtEpochEnd())
    [info] = spot.store.committed()
    assert (info.reason, info.step) == ("exception", 4)
    assert spot.store.verify(4)


def test_exception_inside_a_step_takes_no_half_done_checkpoint(tmp_path):
    class FailsAtStep5(BoringModel):
        def training_step(self, batch, batch_idx):
            if self.global_step == 5:
                raise RuntimeError("boom in step")
            return super().training_step(batch, batch_idx)

    spot = SpotCheckpoint(dirpath=str(tmp_path / "run"), interval=None, every_n_steps=2, preemption=[])
    with pytest.raises(RuntimeError, match="boom in step"):
        boring_trainer(spot, max_steps=10).fit(FailsAtStep5())
    committed = [(i.step, i.reason) for i in spot.store.committed()]
    # Step 2 may be dropped for the newer step 4 if its upload is slow (newest wins); nothing else.
    assert committed[-1] == (4, "steps") and set(committed) <= {(2, "steps"), (4, "steps")}


def test_a_missing_bucket_stops_fit_before_the_first_step_naming_dirpath(tmp_path, s3_server, caplog):
    url = "s3://no-such-bucket-spot/run"
    spot = SpotCheckpoint(dirpath=url, interval=None, every_n_steps=3, storage_options=s3_server.storage_options,
                          preemption=[], scratch_dir=str(tmp_path / "scratch"))  # fmt: skip
    steps_started: list[int] = []

    class FirstStep(pl.Callback):
        def on_train_batch_start(self, trainer, *args) -> None:  # noqa: ANN002
            steps_started.append(trainer.global_step)

    trainer = pl.Trainer(callbacks=[spot, FirstStep()], max_steps=6, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    with (
        caplog.at_level(logging.INFO, logger="spot_callbacks"),
        pytest.raises(StoreUnavailableError) as failure,
    ):
        trainer.fit(BoringModel())
    assert steps_started == []  # found before the first training step
    message = str(failure.value)
    assert f"dirpath={url!r}" in message and "does not exist" in message and "Fix:" in message
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None  # one line, no backend traceback
    assert not (tmp_path / "scratch").exists() or not any((tmp_path / "scratch").rglob("step-*"))


def test_a_permanent_storage_failure_fails_fit_with_the_url_and_keeps_training_state(
    tmp_path, s3_server, monkeypatch, caplog
):
    # SPOT_PREFLIGHT=0 is the documented "train anyway, keep local copies" of an unusable store.
    monkeypatch.setenv("SPOT_PREFLIGHT", "0")
    url = "s3://no-such-bucket-spot/run"
    spot = SpotCheckpoint(dirpath=url, interval=None, every_n_steps=3, storage_options=s3_server.storage_options,
                          preemption=[], scratch_dir=str(tmp_path / "scratch"))  # fmt: skip
    model = BoringModel()
    with (
        caplog.at_level(logging.WARNING, logger="spot_callbacks"),
        pytest.raises(PersistError, match="no-such-bucket-spot/run/step-000000006"),
    ):
        boring_trainer(spot).fit(model)
    kept = sorted(p.name for p in (tmp_path / "scratch").rglob("step-*"))
    assert "step-000000006" in kept  # the local copy is kept for the user
    assert any("NOT checking" in r.getMessage() for r in caplog.records)  # said loudly


def test_the_cost_summary_is_logged_once_at_the_end_of_fit(tmp_path, caplog):
    spot = SpotCheckpoint(dirpath=str(tmp_path / "run"), interval=None, every_n_steps=3, preemption=[])
    with caplog.at_level(logging.INFO, logger="spot_callbacks"):
        boring_trainer(spot).fit(BoringModel())
    summaries = [r.getMessage() for r in caplog.records if "checkpoint costs of" in r.getMessage()]
    assert len(summaries) == 1 and "2 taken (2 steps)" in summaries[0]


def test_callback_state_survives_in_the_checkpoint_and_the_clock_restarts_with_it(tmp_path):
    spot = SpotCheckpoint(dirpath=str(tmp_path / "run"), interval="1h", every_n_steps=3, preemption=[])
    boring_trainer(spot).fit(BoringModel())
    checkpoint = torch.load(spot.engine.scratch_root / "step-000000006" / "state.ckpt", weights_only=True)
    [state] = [v for k, v in checkpoint["callbacks"].items() if k.startswith("SpotCheckpoint")]
    assert state["engine"]["trigger"]["elapsed_s"] == 0.0
    assert state["batches_done_in_epoch"] == 6 and len(state["rng"]) == 1
