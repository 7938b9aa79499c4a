"""The examples do what their docstrings and README say, run as a user runs them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spot_callbacks import CheckpointInfo, CheckpointStore

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN_TIMEOUT_S = 240
POLL_S = 0.05


def example_env(tmp_path: Path, machine: str) -> dict[str, str]:
    """Each run on its own empty scratch disk (a fresh machine); one thread: the CI box is shared."""
    scratch = str(tmp_path / f"scratch-{machine}")
    return {**os.environ, "SPOT_SCRATCH": scratch, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def wait_for_first_commit(store: CheckpointStore, process: subprocess.Popen, output: Path) -> CheckpointInfo:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        newest = store.latest()
        if newest is not None:
            return newest
        assert process.poll() is None, f"exited {process.returncode} before a commit:\n{output.read_text()}"
        time.sleep(POLL_S)
    pytest.fail(f"no checkpoint committed within {RUN_TIMEOUT_S} s:\n{output.read_text()}")


def sigterm_after_first_commit(
    command: list[str], store: CheckpointStore, env: dict[str, str], output: Path
) -> tuple[subprocess.Popen, CheckpointInfo, str]:
    """Start ``command``, send it SIGTERM once its first checkpoint committed, wait for its end.

    Returns the process (ended), that first commit and what it printed (stdout and stderr).
    """
    with output.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            first_commit = wait_for_first_commit(store, process, output)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    return process, first_commit, output.read_text()


def run_on_two_fresh_machines(
    command: list[str], tmp_path: Path, cwd: Path | None = None
) -> list[subprocess.CompletedProcess]:
    """The same command run to the end twice, each time on an empty scratch disk; both must exit 0."""
    runs = []
    for machine in ("a", "b"):
        run = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, env=example_env(tmp_path, machine),
            timeout=RUN_TIMEOUT_S,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        runs.append(run)
    return runs


@pytest.mark.slow
def test_lightning_spot_stops_on_sigterm_and_the_same_command_resumes(tmp_path: Path) -> None:
    # Far more steps than the first commit needs, so the SIGTERM lands mid-run on a fast machine too.
    dirpath = tmp_path / "run"
    command = [sys.executable, str(EXAMPLES / "lightning_spot.py"), "--dirpath", str(dirpath),
               "--max-steps", "300", "--every-n-steps", "10"]  # fmt: skip
    store = CheckpointStore(str(dirpath))
    first, first_commit, printed = sigterm_after_first_commit(
        command, store, example_env(tmp_path, "a"), tmp_path / "first.log"
    )
    assert first.returncode == 143, printed
    assert f"PID {first.pid}" in printed and f"kill -TERM {first.pid}" in printed
    assert "then run the same command again to resume" in printed
    emergency = store.latest()
    assert emergency.reason == "preemption" and first_commit.step <= emergency.step < 300, printed

    second = subprocess.run(
        command, capture_output=True, text=True, env=example_env(tmp_path, "b"), timeout=RUN_TIMEOUT_S
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert re.search(rf"^resumed from step {emergency.step} of 300: ", second.stdout, re.MULTILINE), (
        second.stdout
    )
    assert "done: newest committed checkpoint is step 300" in second.stdout
    assert "PID" in second.stdout  # every run says how to stop it


@pytest.mark.slow
def test_lightning_cli_example_resumes_when_the_same_command_runs_again(tmp_path: Path) -> None:
    # As documented in examples/lightning_cli.yaml, from a working directory of the user's.
    command = [
        sys.executable,
        str(EXAMPLES / "lightning_cli.py"),
        "fit",
        "--config",
        str(EXAMPLES / "lightning_cli.yaml"),
    ]
    store = CheckpointStore(str(tmp_path / "spot_runs" / "lightning-cli"))
    runs = run_on_two_fresh_machines(command, tmp_path, cwd=tmp_path)
    [end] = store.committed()
    assert (
        end.reason == "end" and (tmp_path / "spot_runs" / "lightning-cli" / "logs" / "config.yaml").is_file()
    )
    assert not (tmp_path / "config.yaml").exists()  # nothing written into the working directory
    assert "resuming from" not in runs[0].stderr
    assert f"resuming from {end.url} (step {end.step}, end)" in runs[1].stderr, runs[1].stderr[-4000:]


@pytest.mark.slow
def test_hf_spot_run_again_after_it_finished_trains_nothing(tmp_path: Path) -> None:
    command = [sys.executable, str(EXAMPLES / "hf_spot.py"), "--dirpath", str(tmp_path / "run"),
               "--output-dir", str(tmp_path / "output"), "--max-steps", "10", "--every-n-steps", "5"]  # fmt: skip
    store = CheckpointStore(str(tmp_path / "run"))
    runs = run_on_two_fresh_machines(command, tmp_path)
    assert "finished at step 10 (1 process)" in runs[0].stdout
    # Resumed at max_steps, Transformers would train one more step: the example does not start it.
    assert "already finished at step 10 (max_steps=10): nothing to train" in runs[1].stdout
    assert [info.step for info in store.committed()] == [5, 10]


@pytest.mark.parametrize("example", ["lightning_spot.py", "hf_spot.py"])
def test_a_failed_start_prints_the_one_line_cause_and_no_traceback_unless_verbose(
    tmp_path: Path, example: str
) -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    options = json.dumps({"endpoint_url": endpoint, "key": "k", "secret": "s"})
    command = [
        sys.executable,
        str(EXAMPLES / example),
        "--dirpath",
        "s3://bucket/run",
        "--storage-options",
        options,
    ]
    env = {k: v for k, v in example_env(tmp_path, "a").items() if not k.startswith("SPOT_CONNECT")}
    quiet = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=RUN_TIMEOUT_S
    )
    said = quiet.stdout + quiet.stderr
    assert quiet.returncode == 1, said
    assert said.count("nothing accepts connections") == 1 and "Traceback" not in said, said
    verbose = subprocess.run(
        [*command, "-v"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=RUN_TIMEOUT_S
    )
    assert (
        verbose.returncode == 1
        and "Traceback" in verbose.stderr
        and "StoreUnavailableError" in verbose.stderr
    )
