"""SpotEngine and its trigger: decisions, the interval clock, resume fallbacks."""

from __future__ import annotations

import logging
import posixpath
import threading
import time
import uuid

import pytest
import torch
from helpers.faultfs import FaultyFileSystem
from helpers.reliability_counts import DAMAGED, record
from helpers.s3_engines import committed_s3_run, s3_engine

from spot_callbacks import SpotConfig
from spot_callbacks.engine import STATE_FILE, SpotEngine
from spot_callbacks.preemption import Notice
from spot_callbacks.trigger import CheckpointTrigger


def engine_for(tmp_path, **kw) -> SpotEngine:
    config = SpotConfig(
        dirpath=str(tmp_path / "run"), scratch_dir=str(tmp_path / "scratch"), preemption=[], **kw
    )
    return SpotEngine(config, framework="test")


def test_interval_clock_survives_a_resume_and_steps_trigger():
    now = [100.0]
    trigger = CheckpointTrigger(interval_s=60, every_n_steps=5, clock=lambda: now[0])
    now[0] = 140.0
    assert trigger.due(step=3) is None and trigger.due(step=5) == "steps"
    state = trigger.state_dict()
    resumed = CheckpointTrigger(interval_s=60, every_n_steps=None, clock=lambda: now[0])
    resumed.load_state_dict(state)  # 40 s were already spent before the interruption
    now[0] = 161.0
    assert resumed.due(step=7) == "interval"


def test_auto_interval_follows_the_measured_cost_and_rate():
    trigger = CheckpointTrigger(None, None, auto=True, interruptions_per_hour=1.0, clock=lambda: 0.0)
    trigger.mark_checkpoint(cost_s=8.0)
    young = (2 * 8.0 * 3600) ** 0.5  # 240 s; Daly adds a small correction below it
    assert young - 10 < trigger.interval_s < young
    cheap = CheckpointTrigger(None, None, auto=True, interruptions_per_hour=1.0, clock=lambda: 0.0)
    cheap.mark_checkpoint(cost_s=0.001)
    assert cheap.interval_s == 60.0  # clamped to the minimum


def test_decide_save_and_preemption(tmp_path):
    engine = engine_for(tmp_path, interval=None, every_n_steps=2)
    engine.start()
    assert not engine.decide(1).save and engine.decide(2).reason == "steps"
    engine.save_state(2, 0, {"w": torch.ones(3)}, reason="steps")
    assert not engine.decide(2).save  # never twice for one step
    decision = engine.decide(3, extra_notice=Notice("SIGTERM", None))
    assert decision.reason == "preemption" and decision.notice.source == "SIGTERM"
    engine.finish()
    assert engine.store.latest().step == 2


def test_pull_latest_skips_a_checkpoint_whose_bytes_fail_their_checksums(tmp_path, caplog):
    engine = engine_for(tmp_path, interval=None)
    engine.start()
    for step in (10, 20):
        engine.save_state(step, 0, {"w": torch.full((1000,), float(step))}, reason="steps")
        engine.wait_for_commit()
    engine.finish()
    store = engine.store
    path = posixpath.join(store.step_path(20), STATE_FILE)
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF  # same size, different bytes: only a checksum sees it
    store.fs.pipe_file(path, bytes(data))

    fresh = engine_for(tmp_path / "other-machine", interval=None)
    fresh.store = store
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        local = fresh.pull_latest()
    assert local is not None and local.name == "step-000000010"
    assert torch.load(local / STATE_FILE, weights_only=True)["w"][0].item() == 10.0
    assert any("skipping" in r.message and "step-000000020" in r.message for r in caplog.records)
    record(DAMAGED)


def test_a_second_fit_gets_a_fresh_persister(tmp_path):
    engine = engine_for(tmp_path, interval=None)
    for round_step in (1, 2):
        engine.start()
        engine.save_state(round_step, 0, {"w": torch.zeros(1)}, reason="end")
        engine.finish()
    assert [i.step for i in engine.store.committed()] == [1, 2]


def _preempt_after(engine: SpotEngine, step: int) -> None:
    """A SIGTERM with 30 s of grace agreed at ``step``: the emergency checkpoint, its commit, the end."""
    action = engine.decide(step, extra_notice=Notice("SIGTERM", time.time() + 30))
    assert action.emergency and action.reason == "preemption"
    engine.save_state(step, 0, {"w": torch.full((3,), float(step))}, reason="preemption")
    engine.finish_emergency(action.notice)
    engine.finish()


def test_the_end_of_a_preemption_names_the_older_uploads_it_does_not_wait_for(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    engine = engine_for(tmp_path, interval=None)
    engine.start()
    faulty = FaultyFileSystem(engine.store.fs)
    engine.store.fs = faulty
    faulty.gate, faulty.gate_only = threading.Event(), "step-000000002"
    try:
        engine.save_state(2, 0, {"w": torch.ones(3)}, reason="steps")
        assert faulty.held.wait(timeout=30)  # step 2 is uploading, held mid-put
        _preempt_after(engine, 3)
    finally:
        faulty.gate.set()
    assert engine.store.latest().step == 3
    lines = [r.getMessage() for r in caplog.records if "not waiting for" in r.getMessage()]
    assert lines == ["spot_callbacks: not waiting for the upload of step 2 still in flight at the preemption"]


def test_the_end_of_a_preemption_with_nothing_else_in_flight_says_nothing_about_older_uploads(
    tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="spot_callbacks")
    engine = engine_for(tmp_path, interval=None)
    engine.start()
    engine.save_state(2, 0, {"w": torch.ones(3)}, reason="steps")
    assert engine.wait_for_commit()
    _preempt_after(engine, 3)
    assert [info.step for info in engine.store.committed()] == [2, 3]
    messages = [r.getMessage() for r in caplog.records]
    assert any("emergency checkpoint committed" in m for m in messages)
    assert not any("not waiting for" in m for m in messages)


def _counting(monkeypatch, fs, name: str, calls: list[str], root: str, fail_first: bool = False) -> None:
    """Count ``fs.<name>`` calls on the run folder ``root`` itself (not on a step folder under it)."""
    real = getattr(fs, name)

    def counted(path, *args, **kwargs):
        if path.rstrip("/") != root:
            return real(path, *args, **kwargs)
        calls.append(name)
        if fail_first and calls.count(name) == 1:
            raise ConnectionResetError("the side listing's connection was reset")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(fs, name, counted)


@pytest.mark.parametrize("side_listing_fails", [False, True], ids=["side-listing", "side-listing-fails"])
def test_a_resume_before_the_start_lists_the_run_folder_once_with_its_probe(
    s3_server, tmp_path, monkeypatch, side_listing_fails
):
    """Issue 28: HF's latest() probes the store, then resumes. The probe's listing of the run folder, and
    the listing of its objects taken beside it, are the resume's: one LIST of each, where a probe and the
    resume's own listings took two round trips. When the side listing fails, the resume takes it itself."""
    run = uuid.uuid4().hex
    committed_s3_run(s3_server, run, tmp_path / "a", (10, 20), numel=8)

    fresh = s3_engine(s3_server, run, tmp_path / "b")
    calls: list[str] = []
    _counting(monkeypatch, fresh.store.fs, "ls", calls, fresh.store.root)
    _counting(monkeypatch, fresh.store.fs, "find", calls, fresh.store.root, fail_first=side_listing_fails)
    local = fresh.pull_latest()
    assert local is not None and local.name == "step-000000020"
    assert torch.load(local / STATE_FILE, weights_only=True)["w"][0].item() == 20.0
    assert calls.count("ls") == 1
    assert calls.count("find") == (2 if side_listing_fails else 1)


def test_a_fresh_store_probed_before_the_start_is_not_listed_again(s3_server, tmp_path, monkeypatch):
    fresh = s3_engine(s3_server, uuid.uuid4().hex, tmp_path / "s")
    calls: list[str] = []
    _counting(monkeypatch, fresh.store.fs, "ls", calls, fresh.store.root)
    _counting(monkeypatch, fresh.store.fs, "find", calls, fresh.store.root)
    assert fresh.pull_latest() is None
    assert calls == ["ls", "find"] or calls == ["find", "ls"]  # the probe's two, at once


def test_small_objects_are_read_in_one_request_each(s3_server, tmp_path, monkeypatch):
    """Issue 28: s3fs given a max_concurrency over 1 (set for uploads) asks an object's size (a HEAD)
    before reading it whole; a manifest, the preflight's probe and the run lock are read by one GET."""
    import s3fs.core

    run = uuid.uuid4().hex
    writer = s3_engine(s3_server, run, tmp_path / "a")
    writer.start()
    writer.save_state(10, 0, {"w": torch.ones(8)}, reason="steps")
    writer.wait_for_commit()
    requests: list[tuple[str, str]] = []
    call_s3 = s3fs.core.S3FileSystem._call_s3

    async def recorded(self, method, *args, **kwargs):
        requests.append((getattr(method, "__name__", method), kwargs.get("Key", "")))
        return await call_s3(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", recorded)
    assert writer.lease.lock is not None and writer.lease.lock.holder() is not None  # the live lock, read
    writer.finish()
    fresh = s3_engine(s3_server, run, tmp_path / "b")
    assert fresh.pull_latest() is not None
    fresh.start()
    fresh.finish()
    gets = [key for method, key in requests if method == "get_object"]
    heads = [key for method, key in requests if method == "head_object"]
    assert any(key.endswith("/manifest.json") for key in gets)
    assert any("/.spot-preflight-" in key for key in gets)
    assert any(key.endswith("/.spot-lock.json") for key in gets)
    assert not [key for key in heads if key.endswith("/manifest.json") or "/.spot-preflight-" in key]
    on_lock = [method for method, key in requests if key.endswith("/.spot-lock.json")]
    triples = list(zip(on_lock, on_lock[1:], on_lock[2:], strict=False))
    assert ("head_object", "head_object", "get_object") not in triples  # its ETag's HEAD, then one GET
