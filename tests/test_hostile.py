"""Damaged and hostile checkpoints behind a valid-looking store, resumed through a real Lightning Trainer.

- a payload swapped for another file of the same size: only its checksum sees it;
- a checkpoint written by a different model: the error names the parameter and the way out;
- a payload whose pickle would run code, committed with a valid manifest: nothing runs.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.reliability_counts import DAMAGED, record
from lightning.pytorch.demos.boring_classes import BoringModel

from spot_callbacks import (
    CheckpointStore,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsafeCheckpointError,
    load_state,
)
from spot_callbacks.engine import STATE_FILE
from spot_callbacks.lightning import SpotCheckpoint
from spot_callbacks.store import step_dirname
from spot_callbacks.store.writer import CommitWriter


class _Exploit:
    """Unpickling this calls ``open(marker, "w")``: the file appears if a loader ran the pickle's code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.marker, "w"))


def fit(
    dirpath: Path, scratch: Path, model: pl.LightningModule, max_steps: int, **fit_kwargs
) -> SpotCheckpoint:
    spot = SpotCheckpoint(
        dirpath=str(dirpath), interval=None, preemption=[], keep_last=0, scratch_dir=str(scratch)
    )
    trainer = pl.Trainer(callbacks=[spot], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         max_steps=max_steps)  # fmt: skip
    trainer.fit(model, **fit_kwargs)
    return spot


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A run folder with two committed Lightning checkpoints, steps 2 and 4 (each test gets a copy)."""
    folder = tmp_path_factory.mktemp("trained")
    fit(folder / "run", folder / "scratch-a", BoringModel(), max_steps=2)
    fit(folder / "run", folder / "scratch-b", BoringModel(), max_steps=4, ckpt_path="latest")
    assert [info.step for info in CheckpointStore(str(folder / "run")).committed()] == [2, 4]
    return folder / "run"


@pytest.fixture
def run(trained_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy)
    return copy


def state_path(run: Path, step: int) -> Path:
    return run / step_dirname(step) / STATE_FILE


def test_a_same_size_file_in_place_of_the_payload_is_caught_and_resume_falls_back(run, tmp_path, caplog):
    # Step 2's state file, a loadable Lightning checkpoint, padded to the size step 4's manifest records.
    expected_size = state_path(run, 4).stat().st_size
    other = state_path(run, 2).read_bytes()
    assert len(other) <= expected_size
    state_path(run, 4).write_bytes(other + bytes(expected_size - len(other)))
    store = CheckpointStore(str(run))
    assert store.latest().step == 4 and store.verify(4, deep=False)  # sizes alone cannot see it
    with pytest.raises(
        CorruptCheckpointError, match=rf"{step_dirname(4)}/{STATE_FILE} does not match its manifest"
    ):
        store.verify(4)
    with pytest.raises(CorruptCheckpointError, match="downloaded as"):
        store.pull(4, tmp_path / "pulled")
    assert not (tmp_path / "pulled").exists()

    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        spot = fit(run, tmp_path / "scratch", BoringModel(), max_steps=6, ckpt_path="latest")
    assert spot.engine.resumed.info.step == 2  # the previous valid checkpoint
    assert any("skipping" in r.getMessage() and step_dirname(4) in r.getMessage() for r in caplog.records)
    assert store.latest().step == 6 and store.verify(6)
    assert 4 in [info.step for info in store.committed()]  # skipped, never deleted
    record(DAMAGED)


def test_a_checkpoint_of_a_different_model_fails_naming_the_parameter_and_the_fix(run, tmp_path):
    class Wider(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(32, 3)  # BoringModel's is Linear(32, 2)

    with pytest.raises(IncompatibleCheckpointError) as failure:
        fit(run, tmp_path / "scratch", Wider(), max_steps=6, ckpt_path="latest")
    message = str(failure.value)
    assert "size mismatch for layer.weight" in message and "torch.Size([2, 32])" in message
    assert str(tmp_path / "scratch") in message and step_dirname(4) in message
    assert "ckpt_path='latest'" in message and "new dirpath" in message
    # The failed resume left the store as it was: no checkpoint of the wrong model at step 0.
    assert [(info.step, info.reason) for info in CheckpointStore(str(run)).committed()] == [
        (2, "end"),
        (4, "end"),
    ]
    record(DAMAGED)


def test_a_pickle_that_would_run_code_behind_a_valid_manifest_is_refused_and_nothing_runs(
    run, tmp_path, monkeypatch
):
    marker = tmp_path / "pwned"
    checkpoint = torch.load(state_path(run, 4), weights_only=True)
    checkpoint["hostile"] = _Exploit(str(marker))
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    torch.save(checkpoint, hostile / STATE_FILE)
    store = CheckpointStore(str(run))
    CommitWriter(store).write_checkpoint(5, hostile, reason="manual", framework="lightning")
    assert store.latest().step == 5 and store.verify(5)  # a valid manifest: every byte as committed

    # Even where the environment makes torch.load unpickle whole by default...
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    control = tmp_path / "control"
    torch.save({"x": _Exploit(str(control))}, tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt")
    assert control.exists()  # (the payload is real: a default load runs it)

    # ...a resume through Lightning refuses it, names the file and how to allow it.
    with pytest.raises(UnsafeCheckpointError) as failure:
        fit(run, tmp_path / "scratch", BoringModel(), max_steps=6, ckpt_path="latest")
    message = str(failure.value)
    pulled = next((tmp_path / "scratch").rglob(f"{step_dirname(5)}/{STATE_FILE}"))
    assert str(pulled) in message and "nothing from it was executed" in message
    assert "add_safe_globals" in message and "weights_only=False" in message
    assert not marker.exists()
    assert [info.step for info in store.committed()] == [2, 4, 5]  # nothing written by the failed resume

    # So does spot_callbacks' own loader.
    with pytest.raises(UnsafeCheckpointError, match="safe_globals"):
        load_state(pulled)
    assert not marker.exists()
    record(DAMAGED, 2)


def test_a_checkpoint_cannot_set_environment_variables_on_resume(run, tmp_path, monkeypatch, caplog):
    """The attack: a committed checkpoint whose seed environment carries LD_PRELOAD and friends."""
    for name in ("LD_PRELOAD", "HTTPS_PROXY", "AWS_ENDPOINT_URL", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    planted = tmp_path / "evil.so"
    planted.write_bytes(b"\x7fELF")
    checkpoint = torch.load(state_path(run, 4), weights_only=True)
    (spot_state,) = [s for s in checkpoint["callbacks"].values() if "seed_environment" in s]
    spot_state["seed_environment"] = {
        "LD_PRELOAD": str(planted),
        "HTTPS_PROXY": "http://attacker.invalid:8080",
        "AWS_ENDPOINT_URL": "http://attacker.invalid",
        "PL_GLOBAL_SEED": "7; rm -rf ~",  # a seed name with a value Lightning never writes
        "PL_SEED_WORKERS": "1",  # the one legitimate entry: restored
    }
    spot_state["engine"]["trigger"] = {"elapsed_s": float("inf"), "interval_s": -1.0, "costs_s": ["x"]}
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    torch.save(checkpoint, hostile / STATE_FILE)
    store = CheckpointStore(str(run))
    CommitWriter(store).write_checkpoint(5, hostile, reason="interval", framework="lightning")
    assert store.latest().step == 5 and store.verify(5)  # committed with a valid manifest

    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        spot = fit(run, tmp_path / "scratch", BoringModel(), max_steps=7, ckpt_path="latest")
    assert spot.engine.resumed.info.step == 5
    for name in ("LD_PRELOAD", "HTTPS_PROXY", "AWS_ENDPOINT_URL", "PL_GLOBAL_SEED"):
        assert name not in os.environ, name
    assert os.environ.get("PL_SEED_WORKERS") == "1"
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('LD_PRELOAD'), os.environ.get('HTTPS_PROXY'))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert child.stdout.strip() == "None None"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("'LD_PRELOAD'" in w and "'HTTPS_PROXY'" in w and "'AWS_ENDPOINT_URL'" in w for w in warnings)
    assert any("PL_GLOBAL_SEED" in w and "not a value Lightning writes" in w for w in warnings)
    assert not any(str(planted) in w for w in warnings if "restored" in w)
    # The damaged clock values were dropped, not used: the run trained and ended with a checkpoint.
    assert store.latest().step == 7
    record(DAMAGED)


def commit_as_step_5(run: Path, tmp_path: Path, payload: bytes) -> CheckpointStore:
    """Commit ``payload`` as step 5's state file with a valid manifest (sizes and checksums match)."""
    folder = tmp_path / "payload"
    folder.mkdir()
    (folder / STATE_FILE).write_bytes(payload)
    store = CheckpointStore(str(run))
    CommitWriter(store).write_checkpoint(5, folder, reason="interval", framework="lightning")
    assert store.latest().step == 5 and store.verify(5)
    return store


def _spot_state_changed(run: Path, tmp_path: Path, change: Any) -> bytes:
    """Step 4's state file with SpotCheckpoint's state changed: what a writer of the bucket commits."""
    checkpoint = torch.load(state_path(run, 4), weights_only=True)
    (key,) = [key for key in checkpoint["callbacks"] if key.startswith("SpotCheckpoint")]
    checkpoint["callbacks"][key] = change(checkpoint["callbacks"][key])
    torch.save(checkpoint, tmp_path / "changed.ckpt")
    return (tmp_path / "changed.ckpt").read_bytes()


# Odd values in SpotCheckpoint's own state: applied after Lightning loaded the weights, they crashed
# the resume (a KeyError, random.setstate's TypeError) instead of falling back (issue 21 item 11).
ODD_SPOT_STATES = {
    "spot state not a mapping": (lambda state: [1, 2], "not a mapping"),
    "no RNG states": (lambda state: {**state, "rng": []}, "rng is an empty list"),
    "RNG state of strings": (
        lambda state: {**state, "rng": [{"python": "x", "numpy": 1, "torch": "y"}]},
        "rng[0]",
    ),
    "epoch RNG a huge number": (lambda state: {**state, "epoch_start_rng": [10**30]}, "epoch_start_rng[0]"),
}


@pytest.mark.parametrize(
    "damage", ["truncated archive", "not a Lightning checkpoint", "decompression bomb", *ODD_SPOT_STATES]
)
def test_a_committed_payload_that_cannot_be_loaded_falls_back_to_the_previous_checkpoint(
    run, tmp_path, caplog, damage
):
    if damage in ODD_SPOT_STATES:
        change, expected = ODD_SPOT_STATES[damage]
        payload = _spot_state_changed(run, tmp_path, change)
    elif damage == "truncated archive":
        whole = state_path(run, 4).read_bytes()
        payload = whole[: len(whole) // 2]
        expected = "cannot be loaded"
    elif damage == "not a Lightning checkpoint":
        torch.save({"weights": torch.ones(3)}, tmp_path / "other.pt")
        payload = (tmp_path / "other.pt").read_bytes()
        expected = "is not a Lightning checkpoint"
    else:  # a few hundred kB on disk that would unpack to 64 MB
        with zipfile.ZipFile(tmp_path / "bomb.ckpt", "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("archive/data.pkl", bytes(64 * 2**20))
        payload = (tmp_path / "bomb.ckpt").read_bytes()
        expected = "unpacks to 67108864 bytes"
    store = commit_as_step_5(run, tmp_path, payload)
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        spot = fit(run, tmp_path / "scratch", BoringModel(), max_steps=6, ckpt_path="latest")
    assert spot.engine.resumed.info.step == 4  # the previous valid checkpoint
    lines = [r.getMessage() for r in caplog.records if step_dirname(5) in r.getMessage()]
    assert any("skipping damaged checkpoint" in line and expected in line for line in lines), lines
    assert 5 in [info.step for info in store.committed()]  # damaged, never deleted
    assert store.latest().step == 6
    record(DAMAGED)
