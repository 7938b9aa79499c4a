"""Odd values inside what a resume reads back from a store besides manifests (issue 21 item 11):
the ledger, the engine's state in a checkpoint, the run lock's fields. A value no run writes
(NaN, infinity, negative, huge, the wrong type, deep nesting, a giant string) is ignored with one
warning, or makes the lock one of an unknown run; never a crash, a hang or a nonsense figure.

The checkpoint files themselves (Lightning's SpotCheckpoint state, HF's ``trainer_state.json``)
are covered where their other damage is: ``tests/test_hostile.py`` and ``tests/test_release_lineage_and_refusals.py``."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from spot_callbacks import CheckpointStore, SpotConfig
from spot_callbacks.accounting.ledger import RunLedger
from spot_callbacks.cli import main as cli_main
from spot_callbacks.engine import SpotEngine
from spot_callbacks.store.runlock import LOCK_NAME, RunLock
from spot_callbacks.store.writer import CommitWriter

INF = float("inf")


def _good_ledger() -> dict[str, Any]:
    return RunLedger().add_checkpoint("interval", stall_s=0.5, train_s=100.0).to_json()


# key -> the value a writer of the bucket (or a torch.save'd meta.pt: inf and NaN) puts there
ODD_LEDGERS = {
    "stall_s negative": ("stall_s", -1e300),
    "train_s huge": ("train_s", 1e308),
    "stall_s a bool": ("stall_s", True),
    "stall_s a numeric string": ("stall_s", "1e308"),
    "resumes infinite": ("resumes", INF),
    "pull_s NaN": ("pull_s", float("nan")),
    "downtime_unknown past 10**12": ("downtime_unknown", 10**19),
    "a checkpoint count infinite": ("checkpoints", {"interval": 1, "preemption": INF}),
    "a reason of 10 MB": ("checkpoints", {"interval": 1, "x" * 10_000_000: 1}),
    "checkpoints a string": ("checkpoints", "interval"),
    "a resume record that is not one": ("recent_resumes", [{"from_step": 1}]),
    "recent_resumes deeply nested": ("recent_resumes", json.loads("[" * 500 + "]" * 500)),
}


@pytest.mark.parametrize("case", list(ODD_LEDGERS))
def test_a_ledger_value_no_run_writes_is_ignored_with_one_warning(case: str, caplog) -> None:
    key, value = ODD_LEDGERS[case]
    doc = {**_good_ledger(), key: value}
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        ledger = RunLedger.from_json(doc, "s3://b/run/step-000000005")
    warned = [r.getMessage() for r in caplog.records if "run ledger" in r.getMessage()]
    assert len(warned) == 1 and key in warned[0] and "step-000000005" in warned[0], warned
    assert ledger is not None  # before: the whole ledger was dropped, or an OverflowError escaped
    good = RunLedger.from_json(_good_ledger())
    for field in ("stall_s", "train_s", "resumes", "pull_s", "downtime_unknown", "checkpoints"):
        expected = getattr(good, field) if field != key else getattr(RunLedger(), field)
        if field == "checkpoints" and key == "checkpoints" and isinstance(value, dict):
            expected = {"interval": 1}  # the sane entry stays
        assert getattr(ledger, field) == expected, (field, getattr(ledger, field))
    assert ledger.goodput is None or 0.0 <= ledger.goodput <= 1.0
    assert math.isfinite(ledger.billed_s)


def test_report_of_a_store_whose_ledger_lies_prints_no_absurd_figures(tmp_path: Path, capsys) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "state.ckpt").write_bytes(b"x" * 10)
    lying = {**_good_ledger(), "stall_s": -1e300, "train_s": 1e308, "lost_work_estimated_s": 1e300}
    CommitWriter(store).write_checkpoint(
        3, src, reason="interval", framework="lightning", extra={"ledger": lying}
    )
    assert cli_main(["report", store.url]) == 0
    out = capsys.readouterr().out
    longest = max(len(digits) for digits in re.findall(r"\d[\d.]*", out))
    assert longest < 25 and "e+" not in out, out  # before: goodput 1e+298, a 300-digit lost work


ODD_ENGINE_STATES = {
    "not a mapping": "x",
    "a list": [1, 2],
    "trigger not a mapping": {"trigger": "x"},
    "ledger and clock": {"ledger": {**_good_ledger(), "stall_s": INF}, "train_s": -1e300},
    "train_s huge": {"ledger": _good_ledger(), "train_s": 1e308},
}


@pytest.mark.parametrize("case", list(ODD_ENGINE_STATES))
def test_the_engine_state_of_a_checkpoint_with_odd_values_never_crashes_a_resume(
    case: str, tmp_path: Path, caplog
) -> None:
    engine = SpotEngine(SpotConfig(dirpath=str(tmp_path / "run"), interval=None, preemption=[]), "test")
    with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
        engine.load_state_dict(ODD_ENGINE_STATES[case])  # before: AttributeError/TypeError for some
    seconds = engine.train_seconds()
    assert math.isfinite(seconds) and 0.0 <= seconds < 1e12, seconds
    assert math.isfinite(engine.accounts.ledger.stall_s) and engine.accounts.ledger.stall_s >= 0
    if case in ("not a mapping", "a list", "trigger not a mapping", "ledger and clock"):
        assert any(r.levelno == logging.WARNING for r in caplog.records)


# ------------------------------------------------------------------ the run lock
HOST = socket.gethostname()
ODD_LOCKS = {
    "not JSON": b"\x00\xff garbage",
    "nested 10,000 deep": b"[" * 10_000 + b"]" * 10_000,
    "a JSON list": b"[1, 2]",
    "a pid past any pid, on this host": json.dumps({"host": HOST, "pid": 10**30, "run_id": "r"}).encode(),
}


@pytest.mark.parametrize("case", list(ODD_LOCKS))
def test_a_lock_no_run_wrote_is_taken_over_once_unchanged_never_crashing_or_blocking(
    case: str, tmp_path: Path, caplog
) -> None:
    store = CheckpointStore(str(tmp_path / "run"))
    os.makedirs(store.root)
    (Path(store.root) / LOCK_NAME).write_bytes(ODD_LOCKS[case])
    lock = RunLock(store, stale_s=0.4)
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(_attempt(lock.acquire)), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "acquire hung on the lock"
    # Before: OverflowError (the pid), RecursionError (the nesting), or refused forever (the others:
    # read as no lock, which a local disk would not let it create).
    assert outcome == [None], outcome
    assert lock.holder()["run_id"] == lock.run_id
    assert any("taking over the run lock" in r.getMessage() for r in caplog.records)
    lock.release()


def _attempt(call: Any) -> Exception | None:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the test reports it
        return err
    return None
