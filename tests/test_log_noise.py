"""The log says only what matters, once, and what happened: one rank speaks for the run, the cost
summary follows a run that committed, short waits are not news, an endpoint is shown, messages are true."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from spot_callbacks import SpotConfig
from spot_callbacks.data_position import DataPosition, warn_if_changed
from spot_callbacks.engine import SpotEngine
from spot_callbacks.preemption import Notice
from spot_callbacks.preemption.emergency import Emergency, _log_outcome

LOGGER = "spot_callbacks"


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == LOGGER]


# ----------------------------------------------------------------- one rank speaks
def test_info_lines_come_from_rank_0_only_warnings_from_every_rank(monkeypatch, caplog) -> None:
    log = logging.getLogger(LOGGER)
    monkeypatch.setenv("RANK", "1")  # torchrun's, before (or without) a process group
    with caplog.at_level(logging.INFO, logger=LOGGER):
        log.info("spot_callbacks: checkpoints are staged in RAM")
        log.warning("spot_callbacks: this rank's own trouble")
        log.info("spot_callbacks: node 1 pulled step 5", extra={"every_rank": True})
    assert lines(caplog) == [
        "spot_callbacks: this rank's own trouble",
        "spot_callbacks: node 1 pulled step 5",
    ]
    monkeypatch.setenv("RANK", "0")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        log.info("spot_callbacks: checkpoints are staged in RAM")
    assert lines(caplog) == ["spot_callbacks: checkpoints are staged in RAM"]


def test_a_signal_notice_is_said_by_rank_0_alone_a_cloud_notice_by_the_rank_that_saw_it(
    monkeypatch, caplog
) -> None:
    from spot_callbacks.preemption.watcher import PreemptionWatcher

    said = {}
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)  # torchrun's, before (or without) a process group
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            PreemptionWatcher.from_setting([]).report(Notice("SIGTERM", None))
            PreemptionWatcher.from_setting([]).report(Notice("aws", time.time() + 120, "spot interruption"))
        said[rank] = lines(caplog)
    assert said["0"][0] == "spot_callbacks: preemption notice from SIGTERM" and len(said["0"]) == 2
    assert len(said["1"]) == 1 and said["1"][0].startswith("spot_callbacks: preemption notice from aws")


def test_a_changed_data_setting_is_said_by_rank_0_alone(monkeypatch, caplog) -> None:
    old = {"batch_size": [16], "world_size": 2, "accumulate_grad_batches": 1, "dataset_length": [512]}
    monkeypatch.setattr("spot_callbacks.data_position.rank", lambda: 1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert warn_if_changed(old, DataPosition((8,), 2, 1, (512,)), "step 4")
    assert lines(caplog) == []


# ----------------------------------------------------------------- true messages
def test_fsdp_2_to_1_with_the_same_global_batch_is_not_called_skipped_samples(caplog) -> None:
    old = {"batch_size": [16], "world_size": 2, "accumulate_grad_batches": 1, "dataset_length": [512]}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert warn_if_changed(old, DataPosition((32,), 1, 1, (512,)), "step 4")
        assert warn_if_changed(old, DataPosition((16,), 1, 1, (512,)), "step 4")  # half the samples per step
    same, halved = lines(caplog)
    assert "same 32 samples per optimizer step" in same and "skipped or trained on twice" not in same
    assert "processes (world size) 2 -> 1" in same and "per-device batch size 16 -> 32" in same
    assert "skipped or trained on twice" in halved


def test_a_ctrl_c_that_stopped_the_wait_does_not_speak_of_a_deadline_or_a_resume_point(caplog) -> None:
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        _log_outcome(12, Notice("SIGINT", None, "Ctrl-C"), committed=False, waited_s=0.1)
        _log_outcome(12, Notice("SIGINT", None, "Ctrl-C"), committed=False, waited_s=0.1, newest_committed=8)
        _log_outcome(12, Notice("aws", time.time() + 5), committed=False, waited_s=3.0, newest_committed=8)
    nothing, earlier, deadline = lines(caplog)
    assert "deadline" not in nothing and "stays the resume point" not in nothing
    assert "Ctrl-C again stopped the wait" in nothing and "committed no checkpoint" in nothing
    assert "step 8, committed earlier, is the resume point" in earlier
    assert "did not commit before the deadline" in deadline and "aws notice" in deadline


def test_an_endpoint_url_is_shown_without_its_credentials() -> None:
    config = SpotConfig(
        dirpath="s3://bucket/run", interval=None, preemption=[],
        storage_options={"endpoint_url": "http://minio-user:pw-d3adb33f@minio:9000/?X-Amz-Security-Token=t0k3n&x=1",
                         "secret": "hunter2-hunter2"},
    )  # fmt: skip
    text = repr(config)
    assert "'endpoint_url': 'http://minio:9000/?x=1'" in text and "'secret': '***'" in text
    assert "pw-d3adb33f" not in text and "t0k3n" not in text and "hunter2" not in text


# ----------------------------------------------------------------- the cost summary
def engine_for(tmp_path: Path) -> SpotEngine:
    config = SpotConfig(
        dirpath=str(tmp_path / "run"), interval=None, preemption=[], scratch_dir=str(tmp_path / "s")
    )
    return SpotEngine(config, "test")


def test_the_cost_summary_follows_a_run_that_committed_only(tmp_path, caplog) -> None:
    engine = engine_for(tmp_path)
    engine.start()
    engine.finish()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine.log_cost_summary()  # nothing committed: "0 taken ... goodput n/a" is not a summary
    assert not any("checkpoint" in line and "taken" in line for line in lines(caplog))

    engine = engine_for(tmp_path / "second")
    engine.start()
    engine.save_state(step=3, epoch=0, state={"w": torch.ones(2)}, reason="steps")
    engine.finish()
    engine.watcher._signals.interrupts = 2  # a second Ctrl-C: stop at once, say nothing more
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine.log_cost_summary()
    assert lines(caplog) == []
    engine.watcher._signals.interrupts = 0
    with caplog.at_level(logging.INFO, logger=LOGGER):
        engine.log_cost_summary()
    assert any("1 taken" in line for line in lines(caplog)), lines(caplog)


# ----------------------------------------------------------------- short waits are not news
class SlowUpload:
    """A persister whose last upload ends ``busy_s`` after it was made (each wait waits, as the real one)."""

    def __init__(self, busy_s: float) -> None:
        self.ends = time.monotonic() + busy_s

    @property
    def idle(self) -> bool:
        return time.monotonic() >= self.ends

    def upload_meter(self, step: int | None = None) -> None:
        return None  # nothing tells how far it got

    def wait(self, timeout: float | None = None) -> bool:
        left = self.ends - time.monotonic()
        if timeout is not None and left > timeout:
            time.sleep(timeout)  # the real persister blocks on its condition for as long
            return False
        time.sleep(max(left, 0))
        return True


class NoNotice:
    notice = None
    interrupted_twice = False


def test_the_end_of_fit_wait_is_said_only_once_it_passes_2s(caplog) -> None:
    emergency = Emergency(NoNotice())  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert emergency.wait_at_exit(SlowUpload(0.3), 4, None, say=True)
    assert not any("waiting for the upload" in line for line in lines(caplog))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert emergency.wait_at_exit(SlowUpload(2.6), 5, None, say=True)
    assert [line for line in lines(caplog) if "waiting for the upload" in line][0].startswith(
        "spot_callbacks: waiting for the upload of the checkpoint of step 5"
    )
