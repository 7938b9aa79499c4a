"""`spot-callbacks ls --json` and `report --json`: one JSON object a script parses (schema: docs/cli.md)."""

from __future__ import annotations

import json
from pathlib import Path

from test_cli import FAST_RETRY, a_run_with_two_resumes_and_a_pending_preemption, commit

from spot_callbacks import CheckpointStore
from spot_callbacks.cli import main


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_ls_json_lists_every_checkpoint_with_its_verdict(tmp_path: Path, capsys) -> None:
    store = CheckpointStore(str(tmp_path / "run"), retry=FAST_RETRY)
    for step in (10, 20, 30):
        commit(store, tmp_path, step)
    (Path(store.step_path(30)) / "state.pt").write_bytes(b"cut")  # truncated: damaged
    code, out = _run(capsys, "ls", str(tmp_path / "run"), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["newest_valid_step"] == 20
    by_step = {entry["step"]: entry for entry in doc["checkpoints"]}
    assert sorted(by_step) == [10, 20, 30]
    assert by_step[20]["valid"] and by_step[20]["newest_valid"] and by_step[20]["problem"] is None
    assert not by_step[30]["valid"] and "state.pt" in by_step[30]["problem"]
    assert by_step[10]["reason"] == "interval" and by_step[10]["framework"] == "test"
    assert by_step[10]["size_bytes"] > 0 and by_step[10]["created"].endswith("Z")


def test_ls_json_with_nothing_committed_is_an_empty_list(tmp_path: Path, capsys) -> None:
    (tmp_path / "run" / "step-000000005").mkdir(parents=True)  # an upload that never committed
    (tmp_path / "run" / "step-000000005" / "state.pt").write_bytes(b"partial")
    code, out = _run(capsys, "ls", str(tmp_path / "run"), "--json")
    assert code == 0 and json.loads(out)["checkpoints"] == []


def test_report_json_carries_the_figures_and_the_resumes(tmp_path: Path, capsys) -> None:
    store = CheckpointStore(str(tmp_path / "run"), retry=FAST_RETRY)
    ledger = a_run_with_two_resumes_and_a_pending_preemption(store, tmp_path)
    code, out = _run(capsys, "report", str(tmp_path / "run"), "--json", "--spot-price", "1.5")
    assert code == 0
    doc = json.loads(out)
    assert doc["newest_step"] == 300 and doc["framework"] == "test"
    assert doc["billed_s"] == ledger.billed_s and doc["interruptions"] == 3
    assert abs(doc["goodput"] - ledger.goodput) < 1e-9
    assert [r["from_step"] for r in doc["recent_resumes"]] == [150, 200]
    assert doc["summary"]["training time"] == "2.00 h in 3 runs" and "spot cost" in doc["summary"]
    assert doc["ledger"]["resumes"] == 2
