"""`spot-callbacks` ls / verify / pull / rm / report / plan, run in-process against file://, memory://, s3://, az:// and gs://."""

from __future__ import annotations

import io
import json
import logging
import posixpath
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from spot_callbacks import CheckpointStore
from spot_callbacks.accounting import report
from spot_callbacks.accounting.costs import break_even_interruptions_per_hour, daly_interval_s, plan_job
from spot_callbacks.accounting.ledger import RunLedger, measure_resume
from spot_callbacks.cli import commands as cli
from spot_callbacks.cli import main
from spot_callbacks.store import MANIFEST_NAME, step_dirname
from spot_callbacks.store.layout import is_local_fs
from spot_callbacks.store.retry import RetryPolicy
from spot_callbacks.store.writer import CommitWriter

FAST_RETRY = RetryPolicy(attempts=2, initial_backoff_s=0.01, max_backoff_s=0.05)
FAKE_SECRET = "FAKE-SECRET-d3adb33f-spot-cli"


class FakeTerminal(io.StringIO):
    """A stdin that says it is a terminal, with the user's answer already typed."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def store(store_url):
    return CheckpointStore(store_url.url, storage_options=store_url.storage_options, retry=FAST_RETRY)


@pytest.fixture
def run(capsys, store_url):
    """Run the command in-process with the backend's storage options; return (exit code, stdout, stderr)."""

    def run_cli(*argv: str) -> tuple[int, str, str]:
        code = main(["--storage-options", json.dumps(store_url.storage_options), *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run_cli


def commit(store: CheckpointStore, tmp_path: Path, step: int) -> dict[str, bytes]:
    folder = tmp_path / f"src-{step}"
    contents = {"state.pt": f"{step}:state:".encode() * 300, "extra/rng.bin": f"{step}:rng".encode()}
    for name, data in contents.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    CommitWriter(store).write_checkpoint(step, folder, reason="interval", framework="test")
    return contents


def remote_file(store: CheckpointStore, step: int, name: str) -> str:
    return posixpath.join(store.step_path(step), name)


def table_rows(out: str) -> dict[int, tuple[bool, str]]:
    """step -> (marked newest valid, the row's text) from the plain `ls` table."""
    rows = {}
    for line in out.splitlines():
        tokens = line.lstrip("* ").split()
        if tokens and tokens[0].isdigit():
            rows[int(tokens[0])] = (line.startswith("*"), line)
    return rows


def assert_one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("spot-callbacks: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_ls_lists_steps_and_marks_a_truncated_one_invalid(store, store_url, run, tmp_path):
    if is_local_fs(store.fs):  # an existing empty folder: as empty as a prefix with nothing under it
        Path(store.root).mkdir(parents=True)
    code, out, err = run("ls", store_url.url)
    assert (code, out) == (1, "") and f"nothing is stored under {store.url}" in assert_one_error_line(err)

    for step in (100, 200, 300):
        contents = commit(store, tmp_path, step)
    store.fs.pipe_file(remote_file(store, 300, "state.pt"), contents["state.pt"][:10])

    code, out, err = run("ls", store_url.url)
    assert code == 0, err
    rows = table_rows(out)
    assert sorted(rows) == [100, 200, 300]
    assert [step for step, (marked, _) in rows.items() if marked] == [200]  # newest *valid*
    size = cli.human_size(sum(len(data) for data in contents.values()))
    assert all(f" {size} " in line and "interval" in line and "test" in line for _, line in rows.values())
    assert rows[100][1].rstrip().endswith("ok") and rows[200][1].rstrip().endswith("ok")
    assert "state.pt is 10 bytes but the manifest says 3" in rows[300][1]
    assert store.url not in rows[300][1]  # the short reason, not the full URL
    assert "newest valid checkpoint" in out and "step 200" in out


def test_verify_checks_checksums_and_names_the_altered_file(store, store_url, run, tmp_path):
    commit(store, tmp_path, 1)
    contents = commit(store, tmp_path, 2)
    code, out, _ = run("verify", store_url.url)
    total = cli.human_size(sum(len(data) for data in contents.values()))
    assert (code, out) == (0, f"OK step 2: 2 files, {total} verified\n")

    flipped = bytearray(contents["state.pt"])
    flipped[100] ^= 0x01
    store.fs.pipe_file(remote_file(store, 2, "state.pt"), bytes(flipped))

    code, out, err = run("verify", store_url.url)  # default: the newest committed, damaged or not
    line = assert_one_error_line(err)
    assert code == 1 and out == ""
    assert f"{step_dirname(2)}/state.pt does not match its manifest" in line
    assert run("verify", store_url.url, "--shallow")[0] == 0  # same size: only checksums see it
    assert run("verify", store_url.url, "--step", "1")[:2] == (0, f"OK step 1: 2 files, {total} verified\n")

    code, _, err = run("verify", store_url.url, "--step", "7")
    assert code == 1 and "no committed checkpoint at step 7" in assert_one_error_line(err)


def test_verify_with_nothing_committed_fails(store, store_url, run):
    code, _, err = run("verify", store_url.url)  # a prefix with nothing under it (a missing local folder)
    assert code == 1 and f"nothing is stored under {store.url}" in assert_one_error_line(err)
    store.fs.makedirs(posixpath.join(store.root, "step-000000005"), exist_ok=True)
    store.fs.pipe_file(posixpath.join(store.root, "step-000000005", "state.pt"), b"never committed")
    code, _, err = run("verify", store_url.url)
    assert code == 1 and "no committed checkpoints in" in assert_one_error_line(err)


def test_pull_writes_the_newest_valid_checkpoint(store, store_url, run, tmp_path):
    code, _, err = run("pull", store_url.url, str(tmp_path / "nothing"))
    assert code == 1 and f"nothing is stored under {store.url}" in assert_one_error_line(err)

    first = commit(store, tmp_path, 1)
    second = commit(store, tmp_path, 2)
    code, out, err = run("pull", store_url.url, str(tmp_path / "newest"))
    assert code == 0, err
    assert out == f"{(tmp_path / 'newest').resolve()}\n"
    for name, data in second.items():
        assert (tmp_path / "newest" / name).read_bytes() == data
    assert json.loads((tmp_path / "newest" / MANIFEST_NAME).read_text())["step"] == 2

    assert run("pull", store_url.url, str(tmp_path / "older"), "--step", "1")[0] == 0
    assert (tmp_path / "older" / "state.pt").read_bytes() == first["state.pt"]

    store.fs.pipe_file(remote_file(store, 2, "state.pt"), b"short")
    code, _, err = run("pull", store_url.url, str(tmp_path / "fallback"))
    assert code == 0 and "skipping damaged checkpoint" in err  # the store's warning is shown
    assert (tmp_path / "fallback" / "state.pt").read_bytes() == first["state.pt"]


def test_rm_deletes_the_manifest_first_and_protects_the_newest_valid(
    store, store_url, run, tmp_path, monkeypatch
):
    for step in (1, 2):
        commit(store, tmp_path, step)

    code, _, err = run("rm", store_url.url, "--step", "2", "--yes")
    line = assert_one_error_line(err)
    assert code == 1 and "newest valid checkpoint" in line and "--force" in line
    assert [info.step for info in store.committed()] == [1, 2]

    # The command builds its own store; fsspec hands it the same (cached) filesystem instance.
    assert CheckpointStore(store_url.url, storage_options=store_url.storage_options).fs is store.fs
    deleted = []
    real_rm = store.fs.rm
    monkeypatch.setattr(store.fs, "rm", lambda path, *a, **k: deleted.append(path) or real_rm(path, *a, **k))
    code, out, err = run("rm", store_url.url, "--step", "1", "--yes")
    monkeypatch.undo()
    assert code == 0, err
    assert out.startswith("deleted checkpoint") and step_dirname(1) in out
    assert deleted[0] == remote_file(store, 1, MANIFEST_NAME)
    assert store.step_path(1) in deleted[1:]
    assert [info.step for info in store.committed()] == [2]
    assert set(store.step_folders()) == {2}

    code, _, err = run("rm", store_url.url, "--step", "2", "--yes", "--force")
    assert code == 0, err
    assert store.committed() == []

    code, _, err = run("rm", store_url.url, "--step", "2", "--yes")  # the run folder is empty now
    assert code == 1 and f"nothing is stored under {store.url}" in assert_one_error_line(err)


def test_rm_asks_on_a_terminal_and_requires_yes_otherwise(store, store_url, run, tmp_path, monkeypatch):
    for step in (1, 2):
        commit(store, tmp_path, step)

    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # piped: no one to ask
    code, _, err = run("rm", store_url.url, "--step", "1")
    assert code == 1 and "pass --yes" in assert_one_error_line(err)

    monkeypatch.setattr(sys, "stdin", FakeTerminal("n\n"))
    code, _, err = run("rm", store_url.url, "--step", "1")
    assert code == 1 and "[y/N]" in err and "not deleted" in err
    assert [info.step for info in store.committed()] == [1, 2]

    monkeypatch.setattr(sys, "stdin", FakeTerminal("y\n"))
    assert run("rm", store_url.url, "--step", "1")[0] == 0
    assert [info.step for info in store.committed()] == [2]


def test_rm_removes_an_uncommitted_folder(store, store_url, run, tmp_path):
    commit(store, tmp_path, 1)
    (tmp_path / "partial.bin").write_bytes(b"x" * 100)
    writer = CommitWriter(store)
    writer.begin(5)
    writer.upload_file(tmp_path / "partial.bin", 5, "state.pt")  # never committed
    code, out, err = run("rm", store_url.url, "--step", "5", "--yes")
    assert code == 0, err
    assert out.startswith("deleted uncommitted folder")
    assert set(store.step_folders()) == {1}


def test_secret_storage_option_never_printed(store, store_url, capsys, tmp_path):
    # s3fs hands unknown options to its session, so there the fake secret is a session token
    # (moto does not check it); the other backends accept and ignore an unknown option.
    secret_name = "token" if store_url.backend == "s3" else "client_secret_for_tests"
    options = {**store_url.storage_options, secret_name: FAKE_SECRET}
    credentials = [
        value for key, value in store_url.storage_options.items() if key in ("secret", "connection_string")
    ]
    commit(store, tmp_path, 3)
    outputs = []
    for argv in (
        ["ls", store_url.url],
        ["verify", store_url.url, "--step", "9"],
        ["verify", store_url.url],
        ["report", store_url.url],
    ):
        code = main(["-vv", "--storage-options", json.dumps(options), *argv])
        out, err = capsys.readouterr()
        outputs.append((code, out + err))
    assert [code for code, _ in outputs] == [0, 1, 0, 0], outputs
    assert secret_name in outputs[0][1]  # the names may be shown, for debugging
    for _, text in outputs:
        assert FAKE_SECRET not in text
        for credential in credentials:
            assert credential not in text


def test_secret_echoed_by_a_backend_is_redacted_from_errors_and_logs(capsys, monkeypatch):
    def leaky_committed(self):
        logging.getLogger("spot_callbacks").warning("retrying with secret=%s", FAKE_SECRET)
        raise PermissionError(f"denied for credential {FAKE_SECRET}\nsecond line")

    monkeypatch.setattr(CheckpointStore, "committed", leaky_committed)
    options = json.dumps({"password": FAKE_SECRET})
    CheckpointStore("memory://cli-leak").fs.pipe_file("/cli-leak/step-000000001/state.pt", b"x")

    assert main(["--storage-options", options, "ls", "memory://cli-leak"]) == 1
    out, err = capsys.readouterr()
    assert FAKE_SECRET not in out + err
    assert "retrying with secret=***" in err
    error_lines = [line for line in err.splitlines() if line.startswith("spot-callbacks: error:")]
    assert error_lines == [
        "spot-callbacks: error: permission denied reading 'cli-leak': PermissionError: denied for credential ***. "
        "Fix: grant this identity read and list on it, or use other credentials"
    ]

    assert main(["-v", "ls", "memory://cli-leak", "--storage-options", options]) == 1  # with the traceback
    out, err = capsys.readouterr()
    assert "Traceback" in err and FAKE_SECRET not in out + err

    assert main(["ls", "ftp://user:" + FAKE_SECRET + "@127.0.0.1:1/run"]) == 1  # a password in the URL
    out, err = capsys.readouterr()
    assert FAKE_SECRET not in out + err


@pytest.mark.parametrize(
    ("storage_options", "message"),
    [
        ('{"secret": "' + FAKE_SECRET + '",', "--storage-options is not valid JSON"),
        (f'["{FAKE_SECRET}"]', "--storage-options must be a JSON object"),
        ("@/nonexistent/options.json", "cannot read --storage-options file"),
    ],
)
def test_bad_storage_options_is_one_line_error(capsys, storage_options, message):
    assert main(["--storage-options", storage_options, "ls", "memory://cli-bad-options"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and message in assert_one_error_line(err)
    assert FAKE_SECRET not in err


def test_storage_options_from_a_file_and_after_the_command(capsys, tmp_path):
    options_file = tmp_path / "options.json"
    options_file.write_text(json.dumps({"auto_mkdir": False}))
    url = (tmp_path / "run").as_uri()
    (tmp_path / "run" / "step-000000001").mkdir(parents=True)  # an upload that never committed
    assert main(["ls", url, "--storage-options", f"@{options_file}"]) == 0
    assert capsys.readouterr().out.startswith("no committed checkpoints in file://")


def test_usage_errors_exit_2_and_misplaced_json_is_not_echoed(capsys):
    assert main([]) == 2
    assert main(["verify"]) == 2
    assert main(["rm", "memory://x"]) == 2  # --step is required
    assert main(["verify", "memory://x", "--step", "-3"]) == 2
    assert main(["ls", "memory://x", json.dumps({"secret": FAKE_SECRET})]) == 2
    _, err = capsys.readouterr()
    assert "unrecognized arguments" in err and FAKE_SECRET not in err
    assert main(["--help"]) == 0
    assert "pull" in capsys.readouterr().out


def test_ls_rich_table_on_a_terminal(tmp_path, capsys, monkeypatch):
    import rich  # noqa: F401 - a dependency of spot-callbacks[all]: the test needs it, never skips

    store = CheckpointStore(f"memory://cli-rich-{tmp_path.name}/run")
    for step in (10, 20):
        commit(store, tmp_path, step)
    store.fs.pipe_file(remote_file(store, 20, "state.pt"), b"[bold]x")  # markup-like text stays text
    monkeypatch.setattr(cli, "is_terminal", lambda stream: True)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["ls", store.url]) == 0
    out = capsys.readouterr().out
    assert "10" in out and "20" in out and "state.pt is 7 bytes" in out and "step 10" in out


def test_console_script_help_runs():
    script = shutil.which("spot-callbacks", path=str(Path(sys.executable).parent)) or shutil.which(
        "spot-callbacks"
    )
    argv = [script] if script else [sys.executable, "-m", "spot_callbacks.cli"]
    result = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for command in ("ls", "verify", "pull", "rm", "report", "plan", "--storage-options"):
        assert command in result.stdout
    result = subprocess.run(
        [sys.executable, "-m", "spot_callbacks.cli", "ls", "memory://cli-subprocess"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stdout) == (1, "")
    assert "nothing is stored under memory:///cli-subprocess" in result.stderr


# ------------------------------------------------------------------------------------ report
HOUR = 3600.0


def commit_with_ledger(store: CheckpointStore, tmp_path: Path, step: int, reason: str, metrics: dict, ledger):
    folder = tmp_path / f"costs-{step}"
    folder.mkdir()
    (folder / "state.pt").write_bytes(b"w" * 5000)
    CommitWriter(store).write_checkpoint(
        step, folder, reason=reason, framework="test", metrics=metrics, extra={"ledger": ledger.to_json()}
    )


def a_run_with_two_resumes_and_a_pending_preemption(store: CheckpointStore, tmp_path: Path):
    """Four checkpoints, a preemption resumed after 5 min, a crash, and a preemption not yet resumed."""
    t0 = 1_800_000_000.0
    ledger = RunLedger().add_checkpoint("interval", stall_s=2.0, train_s=1800.0)
    commit_with_ledger(store, tmp_path, 100, "interval", {"stall_s": 2.0, "train_s": 1800.0}, ledger)
    ledger = ledger.add_checkpoint("preemption", stall_s=1.0, train_s=2700.0)
    commit_with_ledger(store, tmp_path, 150, "preemption", {"stall_s": 1.0, "train_s": 2700.0}, ledger)
    ledger = ledger.add_resume(
        measure_resume("preemption", 150, t0, t0 - 5, t0 + 300, pull_s=40.0, load_s=20.0)
    )
    ledger = ledger.add_checkpoint("interval", stall_s=3.0, train_s=3600.0)
    commit_with_ledger(store, tmp_path, 200, "interval", {"stall_s": 3.0, "train_s": 3600.0}, ledger)
    crash = measure_resume(
        "interval", 200, t0 + 4000, t0 + 3990, t0 + 3990 + 900, 30.0, 10.0, interval_s=1800
    )
    ledger = ledger.add_resume(crash)
    ledger = ledger.add_checkpoint("preemption", stall_s=2.0, train_s=7200.0)
    commit_with_ledger(store, tmp_path, 300, "preemption", {"stall_s": 2.0, "train_s": 7200.0}, ledger)
    store.delete(100)  # retention: the newest ledger still counts it
    return ledger


def report_rows(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        match = re.match(r"^  (\S.*?)\s{2,}(\S.*)$", line)
        if match and not line.startswith("   "):
            rows.setdefault(match.group(1), match.group(2))
    return rows


def test_report_reads_the_runs_history_from_its_manifests(store, store_url, run, tmp_path):
    ledger = a_run_with_two_resumes_and_a_pending_preemption(store, tmp_path)
    code, out, err = run("report", store_url.url, "--spot-price", "1.5", "--on-demand-price", "4")
    assert code == 0, err
    rows = report_rows(out)
    assert out.startswith(f"{store.url} (test), newest checkpoint committed ")
    assert rows["checkpoints"].startswith(
        "4 taken (2 interval, 2 preemption); 3 kept in the store; newest step 300"
    )
    stall_s, train_s = 2.0 + 1.0 + 3.0 + 2.0, 7200.0
    assert rows["training time"] == "2.00 h in 3 runs"
    assert rows["training stall"].startswith(
        f"{stall_s:.2f} s total ({100 * stall_s / train_s:.1f}% of training)"
    )
    assert rows["interruptions"] == "3 (2 resumed, 1 awaiting resume from step 300 (preemption))"
    assert rows["lost work"].startswith("0.00 s measured + up to 15.0 min estimated")  # the crash: <= 900 s
    assert rows["resumes"] == "2: pull 35.0 s, load 15.0 s on average; downtime 5.0 min total (1 unknown)"
    billed_s = train_s + 900 + (40 + 30) + (20 + 10)
    assert ledger.billed_s == billed_s
    assert rows["goodput"].startswith(f"{100 * (train_s - stall_s) / billed_s:.1f}% of ")
    spot_cost, on_demand_cost = billed_s / HOUR * 1.5, train_s / HOUR * 4
    assert rows["spot cost"].startswith(f"${spot_cost:.2f} ({billed_s / HOUR:.2f} h billed")
    saved = on_demand_cost - spot_cost
    assert rows["on-demand cost"].endswith(f"spot saved ${saved:.2f} ({100 * saved / on_demand_cost:.1f}%)")
    resume_lines = out.split("recent resumes (2 of 2)\n")[1].splitlines()
    assert "FROM STEP" in resume_lines[0]
    assert resume_lines[1].split()[1:3] == ["150", "preemption"] and resume_lines[1].rstrip().endswith(
        "5.0 min"
    )
    assert resume_lines[2].split()[1:3] == ["200", "interval"] and "<= 15.0 min (est.)" in resume_lines[2]
    assert resume_lines[2].rstrip().endswith("unknown")


def test_report_without_prices_without_a_ledger_and_without_checkpoints(capsys, tmp_path):
    url = f"memory://cli-report-{tmp_path.name}/run"
    assert main(["report", url]) == 1
    assert f"nothing is stored under memory:///cli-report-{tmp_path.name}/run" in capsys.readouterr().err
    store = CheckpointStore(url)
    for step in (1, 2):
        commit(store, tmp_path, step)  # manifests written without a ledger (older versions, other tools)
    assert main(["report", url]) == 0
    rows = report_rows(capsys.readouterr().out)
    assert rows["checkpoints"].startswith("2 taken (2 interval); newest step 2")
    assert "note" in rows and "spot cost" not in rows
    assert main(["report", url, "--on-demand-price", "3"]) == 1
    assert "--on-demand-price needs --spot-price" in assert_one_error_line(capsys.readouterr().err)
    assert main(["report", url, "--spot-price", "-1"]) == 2


def test_report_rich_tables_on_a_terminal(tmp_path, capsys, monkeypatch):
    store = CheckpointStore(f"memory://cli-report-rich-{tmp_path.name}/run")
    a_run_with_two_resumes_and_a_pending_preemption(store, tmp_path)
    monkeypatch.setattr(cli, "is_terminal", lambda stream: True)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["report", store.url, "--spot-price", "1.5"]) == 0
    out = capsys.readouterr().out
    for text in (
        "goodput",
        "interruptions",
        "3 (2 resumed",
        "recent resumes (2 of 2)",
        "from step",
        "spot cost",
    ):
        assert text in out, text


# ------------------------------------------------------------------------------------ plan
PLAN_ARGS = ["plan", "--work-hours", "200", "--spot-price", "1.2", "--on-demand-price", "3.9",
             "--interruptions-per-hour", "0.1", "--checkpoint-seconds", "30", "--resume-seconds", "5min"]  # fmt: skip


def test_plan_prints_the_numbers_of_the_cost_model(capsys):
    assert main(PLAN_ARGS) == 0
    out = capsys.readouterr().out
    plan = plan_job(200, 1.2, 3.9, 0.1, 30, 300)
    rows = {label: value for label, value in report.plan_rows(plan)}
    assert out == report.format_rows(list(rows.items()), indent="") + "\n"
    assert plan.interval_s == daly_interval_s(30, HOUR / 0.1)
    assert rows["optimal interval"].startswith(f"{plan.interval_s / 60:.1f} min (Daly")
    assert rows["spot"].startswith(f"${plan.spot_cost:,.2f}, {plan.spot_hours:.2f} h expected")
    assert rows["on demand"].startswith(f"${200 * 3.9:,.2f}, 200.00 h")
    assert rows["verdict"].startswith(f"spot saves ${200 * 3.9 - plan.spot_cost:,.2f}")
    rate = break_even_interruptions_per_hour(1.2, 3.9, 30, 300)
    assert rows["break-even rate"].startswith(f"{rate:.3g} interruptions/h")


def test_plan_plot_writes_a_png(tmp_path, capsys):
    target = tmp_path / "plan.png"
    assert main([*PLAN_ARGS, "--plot", str(target)]) == 0
    assert re.search(rf"^plot +{re.escape(str(target))}$", capsys.readouterr().out, re.MULTILINE)
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (960, 600)  # 8 x 5 inches at 120 dpi
    assert len(data) > 20_000  # curves, labels and a legend, not an empty canvas


def test_plan_errors(capsys, tmp_path):
    assert main([*PLAN_ARGS[:-2], "--resume-seconds", "soon"]) == 2
    assert "'soon' is not a duration" in capsys.readouterr().err
    assert main([*PLAN_ARGS, "--checkpoint-seconds", "0"]) == 2
    assert main([*PLAN_ARGS, "--spot-price", "nan"]) == 2
    assert main(PLAN_ARGS[:-2]) == 2  # --resume-seconds is required
    capsys.readouterr()
    assert main([*PLAN_ARGS, "--plot", str(tmp_path / "missing" / "plan.png")]) == 1
    assert "cannot write the plot to" in assert_one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------ pull never deletes what is not the run's
def tree_snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry below ``root`` (links not followed): file bytes, or the link's target."""
    snapshot: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_symlink():
            snapshot[name] = f"-> {path.readlink()}"
        elif path.is_file():
            snapshot[name] = path.read_bytes()
    return snapshot


def users_folder(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("the user's notes")
    (path / "sub" / "data.bin").write_bytes(b"\x00user data" * 100)
    return path


@pytest.fixture
def local_store(tmp_path) -> CheckpointStore:
    store = CheckpointStore((tmp_path / "run").as_uri(), retry=FAST_RETRY)
    commit(store, tmp_path, 1)
    return store


def test_pull_refuses_a_folder_of_the_users_files_and_the_current_directory(local_store, tmp_path):
    user = users_folder(tmp_path / "user")
    before = tree_snapshot(user)

    def pull(*argv: str, cwd: Path = user) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "spot_callbacks.cli", "pull", local_store.url, *argv],
            cwd=cwd, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    done = pull(str(user), cwd=tmp_path)
    line = assert_one_error_line(done.stderr)
    assert done.returncode == 1 and done.stdout == ""
    assert f"{user} is not empty ('notes.txt' and 1 more)" in line and "--force" in line
    assert "nothing was changed" in line
    for dest in (".", "sub/.."):
        done = pull(dest)
        line = assert_one_error_line(done.stderr)
        assert done.returncode == 1 and f"{user} is the current directory" in line and "./resume" in line
        done = pull(dest, "--force")  # a pull never replaces the directory it runs in
        assert done.returncode == 1 and "is the current directory" in assert_one_error_line(done.stderr)
    assert tree_snapshot(user) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "src-1", "user"]  # no staging left

    done = pull(str(user / "sub"), "--force", cwd=tmp_path)  # the user asked for it: replaced, and said so
    assert done.returncode == 0, done.stderr
    assert "--force: replacing" in done.stderr and done.stdout == f"{user / 'sub'}\n"
    assert (user / "sub" / "state.pt").read_bytes() == commit(local_store, tmp_path, 1)["state.pt"]
    assert not (user / "sub" / "data.bin").exists() and (user / "notes.txt").exists()


def test_pull_replaces_an_earlier_pull_of_the_same_run_only(local_store, tmp_path, capsys):
    url, dest = local_store.url, tmp_path / "resume"
    assert main(["pull", url, str(tmp_path / "empty"), "--step", "1"]) == 0  # missing: created
    (tmp_path / "empty-dir").mkdir()
    assert main(["pull", url, str(tmp_path / "empty-dir")]) == 0  # empty: used
    assert main(["pull", url, str(dest)]) == 0
    second = commit(local_store, tmp_path, 2)
    assert main(["pull", url, str(dest)]) == 0  # a pull of step 1, still committed here: replaced
    assert (dest / "state.pt").read_bytes() == second["state.pt"]
    capsys.readouterr()

    def refused(*argv: str) -> str:
        snapshot = tree_snapshot(dest)
        assert main(["pull", url, str(dest), *argv]) == 1
        out, err = capsys.readouterr()
        assert out == "" and tree_snapshot(dest) == snapshot
        line = assert_one_error_line(err)
        assert str(dest) in line and "--force" in line and "nothing was changed" in line
        return line

    (dest / "extra" / "notes.txt").write_text("mine")
    assert "holds a pull of step 2 and other files (e.g. 'extra/notes.txt')" in refused("--step", "1")
    (dest / "extra" / "notes.txt").unlink()
    state = bytearray((dest / "state.pt").read_bytes())
    state[0] ^= 0xFF  # same size, other bytes: the user's edit would be lost
    (dest / "state.pt").write_bytes(bytes(state))
    assert "whose files differ from that checkpoint" in refused("--step", "1")
    assert main(["pull", url, str(dest), "--step", "1", "--force"]) == 0

    other = CheckpointStore((tmp_path / "other-run").as_uri(), retry=FAST_RETRY)
    commit(other, tmp_path / "other-src", 1)  # the same step and file names, another run
    capsys.readouterr()
    assert main(["pull", other.url, str(dest)]) == 1
    assert "differ from that checkpoint" in assert_one_error_line(capsys.readouterr().err)
    local_store.delete(1)  # retention deleted the step that was pulled: this copy may be the last
    assert "holds a pull of step 1, which is not committed in" in refused()
    assert (dest / "state.pt").read_bytes() == commit(local_store, tmp_path, 1)["state.pt"]


def test_pull_never_deletes_through_a_symbolic_link(local_store, tmp_path, capsys):
    user = users_folder(tmp_path / "user")
    before = tree_snapshot(user)
    link = tmp_path / "link"
    link.symlink_to(user, target_is_directory=True)
    for argv in ([], ["--force"]):
        assert main(["pull", local_store.url, str(link), *argv]) == 1
        line = assert_one_error_line(capsys.readouterr().err)
        assert f"{link} is a symbolic link; nothing was changed" in line

    dest = tmp_path / "resume"
    assert main(["pull", local_store.url, str(dest)]) == 0
    (dest / "extra" / "mine").symlink_to(user, target_is_directory=True)
    capsys.readouterr()
    assert main(["pull", local_store.url, str(dest)]) == 1
    assert "a symbolic link 'extra/mine'" in assert_one_error_line(capsys.readouterr().err)
    newer = commit(local_store, tmp_path, 2)
    assert main(["pull", local_store.url, str(dest), "--force"]) == 0  # the link goes, not its target
    assert not (dest / "extra" / "mine").exists() and tree_snapshot(user) == before
    assert (dest / "state.pt").read_bytes() == newer["state.pt"]
    assert "--force: replacing" in capsys.readouterr().err

    a_file = tmp_path / "a-file"
    a_file.write_text("keep")
    assert main(["pull", local_store.url, str(a_file), "--force"]) == 1
    assert "exists and is not a folder" in assert_one_error_line(capsys.readouterr().err)
    assert a_file.read_text() == "keep"
