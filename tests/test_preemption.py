"""Preemption notices: signals, the clouds' metadata services, cross-rank agreement, the emergency path.

The clouds are loopback servers that implement the documented endpoints (tests/helpers/metadata_servers.py);
the endpoint variables point the pollers at them, and at a closed port for the clouds a test does
not use, so nothing here ever talks to a real metadata service.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import transformers
from helpers.faultfs import FaultyFileSystem
from helpers.metadata_servers import AwsImds, iso_utc
from lightning.pytorch.demos.boring_classes import BoringModel

from spot_callbacks import CheckpointStore, SpotConfig
from spot_callbacks.engine import SpotEngine
from spot_callbacks.hf import SpotCheckpointCallback
from spot_callbacks.lightning import SpotCheckpoint
from spot_callbacks.persist import Persister, PersistJob, plan_emergency
from spot_callbacks.preemption import PreemptionWatcher

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = REPO_ROOT / "tests" / "scripts"
FAST = {"poll_interval_s": 0.05, "request_timeout_s": 0.3}

_spec = importlib.util.spec_from_file_location("hf_run", SCRIPTS / "hf_run.py")
hf_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_run)


@pytest.fixture
def watch():
    """``watch(sources, **kwargs)``: a started PreemptionWatcher that polls fast, stopped after the test."""
    started: list[PreemptionWatcher] = []

    def make(sources: list[str], **kwargs: Any) -> PreemptionWatcher:
        watcher = PreemptionWatcher(sources, **{**FAST, **kwargs})
        watcher.start()
        started.append(watcher)
        return watcher

    yield make
    for watcher in started:
        watcher.stop()


def engine_for(tmp_path: Path, **kwargs: Any) -> SpotEngine:
    config = SpotConfig(
        dirpath=str(tmp_path / "run"), scratch_dir=str(tmp_path / "scratch"), interval=None, **kwargs
    )
    return SpotEngine(config, framework="test")


def spot_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "spot-notices" and t.is_alive()]


# ------------------------------------------------------------------------------------ signals


def test_signal_handlers_chain_to_the_one_installed_before_and_are_restored():
    calls: list[int] = []

    def framework_handler(signum: int, frame: Any) -> None:
        calls.append(signum)

    original = signal.signal(signal.SIGUSR1, framework_handler)
    try:
        watcher = PreemptionWatcher(["SIGUSR1"])
        watcher.start()
        assert signal.getsignal(signal.SIGUSR1) is not framework_handler
        os.kill(os.getpid(), signal.SIGUSR1)
        notice = watcher.wait(timeout=5)
        assert notice is not None and notice.source == "SIGUSR1"
        assert calls == [signal.SIGUSR1]  # the handler installed before still ran
        watcher.stop()
        assert signal.getsignal(signal.SIGUSR1) is framework_handler
    finally:
        signal.signal(signal.SIGUSR1, original)


# ---------------------------------------------------------------------------------------- AWS


def test_aws_spot_interruption_is_a_notice_with_the_deadline_it_announces(aws_imds, watch):
    watcher = watch(["aws"])
    assert aws_imds.wait_for_requests(3, "instance-action")  # polled: 404, nothing yet
    assert watcher.notice is None
    interruption_at = aws_imds.announce(seconds_ahead=120)
    notice = watcher.wait(timeout=5)
    assert notice is not None and notice.source == "aws" and notice.deadline == interruption_at
    assert "terminate" in notice.detail
    gets = [r for r in aws_imds.requests if r.method == "GET"]
    assert gets and all(r.headers["x-aws-ec2-metadata-token"].startswith(AwsImds.TOKEN_PREFIX) for r in gets)
    assert aws_imds.tokens_issued == 1  # IMDSv2 token fetched once and reused, not once per poll


@pytest.mark.parametrize("fault", ["500", "garbage", "hang", "no-token"])
def test_a_broken_imds_is_no_notice_and_logs_one_line(aws_imds, watch, caplog, fault):
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    aws_imds.fault = fault
    aws_imds.announce()  # an interruption is posted, but no answer that says so is usable
    watcher = watch(["aws"])
    assert aws_imds.wait_for_requests(5)  # several polls, each failing
    assert watcher.notice is None
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(problems) == 1 and "gave no usable answer" in problems[0], problems


def test_rebalance_recommendation_takes_a_normal_checkpoint_and_does_not_stop(aws_imds, tmp_path):
    engine = engine_for(tmp_path, preemption=["aws"])
    engine.start()
    try:
        assert engine.decide(1).reason is None
        aws_imds.rebalance = {"noticeTime": iso_utc(time.time())}
        polled = len(aws_imds.matching("rebalance"))
        # One poller thread: the second request comes after the first answer was handled.
        assert aws_imds.wait_for_requests(polled + 2, "rebalance")
        decision = engine.decide(2)
        assert decision.reason == "interval" and decision.notice is None
        engine.save_state(2, 0, {"w": torch.ones(2)}, reason=decision.reason)
        assert engine.decide(3).reason is None  # one hint, one checkpoint
        assert engine.watcher.notice is None
    finally:
        engine.finish()
    latest = engine.store.latest()
    assert latest.step == 2 and latest.reason == "interval"


# ---------------------------------------------------------------------------------------- GCP


def test_gcp_preempted_arrives_through_the_long_poll_at_once(gcp_metadata, watch):
    watcher = watch(["gcp"], poll_interval_s=5.0)
    assert gcp_metadata.wait_for_requests(2, "preempted")  # a first read, then a long poll, waiting
    assert gcp_metadata.matching("preempted")[-1].query["wait_for_change"] == ["true"]
    posted = time.time()
    gcp_metadata.set_preempted(True)
    notice = watcher.wait(timeout=3)
    assert notice is not None and notice.source == "gcp"
    assert notice.received_at - posted < 1.0  # not a 5 s poll interval later
    assert notice.deadline == pytest.approx(notice.received_at + 30)


def test_stop_aborts_a_gcp_long_poll_and_leaves_no_thread(gcp_metadata, watch):
    watcher = watch(["gcp"], poll_interval_s=60.0)
    assert gcp_metadata.wait_for_requests(2, "preempted")  # held by the server for up to 60 s
    started = time.monotonic()
    watcher.stop()
    assert time.monotonic() - started < 1.0
    assert not watcher.polling and not spot_threads()


def test_gcp_garbage_is_no_notice(gcp_metadata, watch, caplog):
    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    gcp_metadata.fault = "garbage"
    gcp_metadata.set_preempted(True)
    watcher = watch(["gcp"])
    assert gcp_metadata.wait_for_requests(4, "preempted")
    assert watcher.notice is None and len(caplog.records) == 1


# -------------------------------------------------------------------------------------- Azure


def test_azure_preempt_event_sets_the_deadline_and_is_acknowledged_after_the_commit(azure_events, tmp_path):
    engine = engine_for(tmp_path, preemption=["azure"])
    azure_events.on_acknowledge = engine.store.latest  # what was committed when the POST arrived
    engine.start()
    try:
        azure_events.add_event("Freeze")  # a pause, not a reclaim
        azure_events.add_event("Preempt", resources=["another-vm"])  # a neighbour in the scale set
        event_id, not_before = azure_events.add_event("Preempt", not_before_s=60)
        notice = engine.watcher.wait(timeout=5)
        assert notice is not None and notice.source == "azure" and notice.deadline == not_before
        assert event_id in notice.detail
        decision = engine.decide(7)
        assert decision.reason == "preemption" and decision.notice == notice
        engine.save_state(7, 0, {"w": torch.ones(4)}, reason="preemption")
        assert azure_events.acknowledged == []  # not before the commit
        assert engine.wait_for_commit(decision.notice)
    finally:
        engine.finish()
    assert azure_events.acknowledged == [{"StartRequests": [{"EventId": event_id}]}]
    [committed_at_ack] = azure_events.seen_at_acknowledge
    assert committed_at_ack.step == 7 and committed_at_ack.reason == "preemption"
    assert committed_at_ack.extra["preemption"]["source"] == "azure"


# --------------------------------------------------------------------------------------- auto


def test_auto_off_cloud_detects_nothing_within_a_second_and_leaves_no_thread(
    azure_events, metadata_env, caplog, monkeypatch
):
    caplog.set_level(logging.DEBUG, logger="spot_callbacks")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    # Something answers at the AWS and GCP addresses, but it is neither; nothing listens at Azure's.
    metadata_env(aws=azure_events.url, gcp=azure_events.url)
    started = time.monotonic()
    watcher = PreemptionWatcher.from_setting("auto", request_timeout_s=0.3)
    watcher.start()
    try:
        assert time.monotonic() - started < 0.25  # start() never waits for detection
        assert watcher.detected(timeout=5) == []
        assert time.monotonic() - started < 1.0
        for thread in spot_threads():
            thread.join(timeout=1)
        assert not spot_threads()
        assert watcher.sources[0] == "SIGTERM" and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        watcher.stop()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []


def test_auto_inside_slurm_also_watches_sigusr1(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert PreemptionWatcher.from_setting("auto").sources[:2] == ["SIGTERM", "SIGUSR1"]


# ------------------------------------------------------------------------ the emergency path


def test_plan_finishes_the_upload_in_flight_only_if_both_fit():
    fits = plan_emergency(10e6, 0.5, 10e6, bytes_per_s=10e6, seconds_left=30)
    assert fits.finish_in_flight and fits.in_flight_left_s == pytest.approx(0.5)
    too_big = plan_emergency(400e6, 1.0, 400e6, bytes_per_s=10e6, seconds_left=30)
    assert not too_big.finish_in_flight
    assert "in-flight step 3 needs ~39.0s more" in too_big.describe(3, 5)
    stalled = plan_emergency(10e6, 60.0, 10e6, bytes_per_s=10e6, seconds_left=30)
    assert stalled.stalled and not stalled.finish_in_flight
    assert not plan_emergency(10e6, 0.5, 10e6, bytes_per_s=None, seconds_left=30).finish_in_flight


def _job(tmp_path: Path, step: int, size: int, **kwargs: Any) -> PersistJob:
    folder = tmp_path / "scratch" / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "state.ckpt").write_bytes(bytes([step]) * size)
    return PersistJob(step=step, reason="interval", framework="test", local_dir=folder, **kwargs)


@pytest.mark.parametrize("seconds_left", [5.0, 60.0], ids=["upload-alongside", "finish-in-flight-first"])
def test_an_emergency_checkpoint_goes_ahead_of_older_uploads(tmp_path, caplog, seconds_left):
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    store = CheckpointStore(str(tmp_path / "run"))
    faulty = FaultyFileSystem(store.fs)
    store.fs = faulty
    persister = Persister(store, keep_last=0)
    persister.submit(_job(tmp_path, 1, 1000))
    assert persister.wait(timeout=30)
    # As if the first upload had gone at 1 MB/s: 4 MB then take ~4 s each.
    persister.records[-1] = dataclasses.replace(persister.records[-1], bytes=1_000_000, upload_s=1.0)
    faulty.gate, faulty.gate_only = threading.Event(), "step-000000002"
    persister.submit(_job(tmp_path, 2, 4_000_000))
    assert faulty.held.wait(timeout=30)  # step 2 is uploading, held mid-put
    persister.submit(_job(tmp_path, 3, 4_000_000))  # waits behind it
    emergency = _job(tmp_path, 4, 4_000_000, deadline=time.time() + seconds_left)
    persister.submit(dataclasses.replace(emergency, reason="preemption"))

    if seconds_left < 8:  # 4 s for step 2, then 4 s for step 4: does not fit, step 4 goes now
        assert persister.wait_for_step(4, timeout=30)
        assert store.latest().step == 4 and persister.in_flight_step == 2
    else:  # fits: step 2 first, then step 4
        assert not persister.wait_for_step(4, timeout=0.2)
    faulty.gate.set()
    assert persister.wait_for_step(4, timeout=30) and persister.close(timeout=30)
    messages = [r.getMessage() for r in caplog.records]
    [plan] = [m for m in messages if "in-flight step 2" in m]
    action = "uploading step 4 now" if seconds_left < 8 else "finishing step 2 first"
    assert action in plan and "the emergency checkpoint of step 4 ~4.0s, deadline in" in plan
    assert any("dropping checkpoint of step 3" in m for m in messages)
    assert not any("step-000000003" in path for _, path in faulty.calls)  # never started
    assert [info.step for info in store.committed()] == [1, 2, 4] and persister.last_committed.step == 4


@pytest.mark.slow
def test_a_notice_on_one_rank_is_one_decision_with_the_earliest_deadline_on_all(tmp_path):
    base_time = 2_000_000_000.0
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(SCRIPTS / "notice_agreement.py"), "--out", str(tmp_path), "--dirpath", str(tmp_path / "run"),
        "--base-time", str(base_time),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["nothing"] is None
        assert result["hint"] == "interval" and result["after_hint"] is None  # rank 1's hint, on both
        assert result["notice"] == ["preemption", "aws", base_time + 10]  # rank 1's, the earliest


# -------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_lightning_run_stops_on_an_aws_interruption_and_resumes(aws_imds, tmp_path):
    """'auto' finds the (loopback) IMDS, the notice mid-run makes an emergency checkpoint, exit 143."""
    url, out = str(tmp_path / "run"), str(tmp_path / "w.pt")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def run(*extra: str, scratch: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(SCRIPTS / "lightning_run.py"), "--dirpath", url, "--out", out, *extra],
            env={**env, "SPOT_SCRATCH": str(tmp_path / scratch)}, capture_output=True, text=True, timeout=240,
        )  # fmt: skip

    stopped = run("--announce-at-step", "6", "--announce-url", f"{aws_imds.url}/_test/announce", scratch="a")
    assert stopped.returncode == 143, stopped.stderr[-4000:]
    assert (
        "preemption notice from aws" in stopped.stderr and "emergency checkpoint committed" in stopped.stderr
    )
    latest = CheckpointStore(url).latest()
    assert latest.step == 7 and latest.reason == "preemption"
    assert latest.extra["preemption"]["source"] == "aws"

    aws_imds.reset()  # the next machine has no notice
    resumed = run(scratch="b")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resuming from" in resumed.stderr and "step-000000007" in resumed.stderr
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["global_step"] == 30


class _Announce(pl.Callback):
    def __init__(self, step: int, announce: Any, watcher: PreemptionWatcher) -> None:
        self.step, self.announce, self.watcher = step, announce, watcher

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self.watcher.notice is None:
            self.announce()
            assert self.watcher.wait(timeout=10) is not None


CLOUD_SERVERS = {"aws": "aws_imds", "gcp": "gcp_metadata", "azure": "azure_events"}


def cloud_announcer(request: pytest.FixtureRequest, cloud: str) -> tuple[Any, Any]:
    """The cloud's loopback metadata server and a function that makes it announce a preemption."""
    server = request.getfixturevalue(CLOUD_SERVERS[cloud])
    event_ids: list[str] = []
    announce = {
        "aws": lambda: server.announce(seconds_ahead=120),
        "gcp": lambda: server.set_preempted(),
        "azure": lambda: event_ids.append(server.add_event("Preempt")[0]),
    }[cloud]
    return server, (announce, event_ids)


@pytest.mark.parametrize("cloud", sorted(CLOUD_SERVERS))
def test_lightning_stops_on_a_cloud_preemption_in_process(request, cloud, tmp_path):
    server, (announce_now, event_ids) = cloud_announcer(request, cloud)
    ckpt = SpotCheckpoint(
        dirpath=str(tmp_path / "run"), interval=None, preemption=[cloud], scratch_dir=str(tmp_path)
    )
    announce = _Announce(3, announce_now, ckpt.engine.watcher)
    trainer = pl.Trainer(
        callbacks=[ckpt, announce], max_steps=20, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        trainer.fit(BoringModel())
    assert stopped.value.code == 143 and ckpt.preempted and trainer.global_step == 4
    latest = ckpt.store.latest()
    assert latest.step == 4 and latest.reason == "preemption"
    assert latest.extra["preemption"]["source"] == cloud
    assert not ckpt.engine.watcher.polling
    if cloud == "azure":
        assert server.acknowledged == [{"StartRequests": [{"EventId": event_ids[0]}]}]


class _AnnounceHf(transformers.TrainerCallback):
    def __init__(self, step: int, announce: Any, watcher: PreemptionWatcher) -> None:
        self.step, self.announce, self.watcher = step, announce, watcher

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.watcher.notice is None:
            self.announce()
            assert self.watcher.wait(timeout=10) is not None


@pytest.mark.parametrize("cloud", sorted(CLOUD_SERVERS))
def test_hf_trainer_stops_on_a_cloud_preemption_and_resumes(request, cloud, tmp_path):
    server, (announce_now, event_ids) = cloud_announcer(request, cloud)

    def trainer_for(callbacks: list, output_dir: str) -> transformers.Trainer:
        args = transformers.TrainingArguments(
            output_dir=output_dir, max_steps=20, per_device_train_batch_size=8, save_strategy="no",
            report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=50,
        )  # fmt: skip
        return transformers.Trainer(
            model=hf_run.build_model(), args=args, train_dataset=hf_run.TokenData(), callbacks=callbacks
        )

    ckpt = SpotCheckpointCallback(
        dirpath=str(tmp_path / "run"), interval=None, preemption=[cloud], scratch_dir=str(tmp_path / "s1")
    )
    trainer = trainer_for([ckpt, _AnnounceHf(5, announce_now, ckpt.engine.watcher)], str(tmp_path / "out"))
    trainer.train(resume_from_checkpoint=ckpt.latest())
    assert ckpt.preempted and trainer.state.global_step == 6
    latest = ckpt.store.latest()
    assert latest.step == 6 and latest.reason == "preemption"
    assert latest.extra["preemption"]["source"] == cloud
    if cloud == "azure":
        assert server.acknowledged == [{"StartRequests": [{"EventId": event_ids[0]}]}]

    # The resume from it continues: a fresh machine (empty output_dir and scratch), no notice source.
    again = SpotCheckpointCallback(
        dirpath=str(tmp_path / "run"), interval=None, preemption=[], scratch_dir=str(tmp_path / "s2")
    )
    resumed = trainer_for([again], str(tmp_path / "out2"))
    resumed.train(resume_from_checkpoint=again.latest())
    assert not again.preempted and resumed.state.global_step == 20
    assert [(i.step, i.reason) for i in again.store.committed()][-2:] == [(6, "preemption"), (20, "end")]
