"""A store that is not there fails in seconds, with one line: a refused port within 10 s, an endpoint
that accepts and never answers within 15 s, from the CLI and from a training start (SPOT_CONNECT_TIMEOUT_S)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_preflight import silent_socket  # noqa: F401 - a fixture

from spot_callbacks import SpotConfig, StoreUnavailableError
from spot_callbacks.engine import SpotEngine

BIN = Path(sys.executable).parent


def _refused_endpoint() -> str:
    with socket.socket() as probe:  # a port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def _ls(endpoint: str, *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    options = json.dumps({"endpoint_url": endpoint, "key": "k", "secret": "s"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOT_")}
    started = time.monotonic()
    result = subprocess.run(
        [str(BIN / "spot-callbacks"), "--storage-options", options, *extra, "ls", "s3://bucket/run"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    return result, time.monotonic() - started


def test_ls_on_a_refused_port_fails_in_seconds_with_one_line_naming_the_cause() -> None:
    result, took_s = _ls(_refused_endpoint())
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "nothing accepts connections" in lines[0], result.stderr
    assert "SPOT_PREFLIGHT_TIMEOUT_S" not in lines[0]  # a longer budget is no fix for a refused port
    assert took_s <= 10.0, f"a refused port took {took_s:.1f}s"


def test_ls_on_an_endpoint_that_never_answers_fails_within_15s(silent_socket: str) -> None:  # noqa: F811
    result, took_s = _ls(silent_socket)
    assert result.returncode == 1
    assert "did not answer in time" in result.stderr and "Traceback" not in result.stderr
    assert took_s <= 15.0, f"a silent endpoint took {took_s:.1f}s"


def test_timeout_bounds_a_command_on_an_endpoint_that_never_answers(silent_socket: str) -> None:  # noqa: F811
    result, took_s = _ls(silent_socket, "--timeout", "3s")
    assert result.returncode == 1 and "did not answer in time" in result.stderr, result.stderr
    assert took_s <= 9.0, f"--timeout 3s took {took_s:.1f}s"


def test_timeout_leaves_the_environment_as_it_found_it(tmp_path) -> None:
    from spot_callbacks.cli import main

    before = {k: v for k, v in os.environ.items() if k.startswith("SPOT_")}
    assert main(["--timeout", "7s", "ls", str(tmp_path / "run")]) == 1  # nothing stored there: one line
    assert {k: v for k, v in os.environ.items() if k.startswith("SPOT_")} == before
    assert main(["ls", "--timeout", "soon", str(tmp_path / "run")]) == 2  # a usage error names the flag


def test_a_training_start_on_a_refused_port_fails_before_the_first_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SPOT_CONNECT_TIMEOUT_S", raising=False)
    monkeypatch.delenv("SPOT_PREFLIGHT_TIMEOUT_S", raising=False)
    options = {"endpoint_url": _refused_endpoint(), "key": "k", "secret": "s"}
    engine = SpotEngine(
        SpotConfig(dirpath="s3://bucket/run", interval=None, preemption=[], storage_options=options), "test"
    )
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="nothing accepts connections"):
        engine.start()
    assert time.monotonic() - started <= 10.0


def test_hf_latest_before_train_on_a_refused_port_fails_in_seconds_with_the_diagnosis(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HF's latest() runs before the Trainer's start: it takes the preflight's bounds and one-line cause
    too (it used to retry a listing for ~25 s and end in botocore's own EndpointConnectionError)."""
    from spot_callbacks.hf import SpotCheckpointCallback

    monkeypatch.delenv("SPOT_CONNECT_TIMEOUT_S", raising=False)
    monkeypatch.delenv("SPOT_PREFLIGHT_TIMEOUT_S", raising=False)
    options = {"endpoint_url": _refused_endpoint(), "key": "k", "secret": "s"}
    callback = SpotCheckpointCallback(
        dirpath="s3://bucket/run", interval=None, preemption=[], storage_options=options
    )
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="nothing accepts connections"):
        callback.latest()
    assert time.monotonic() - started <= 10.0
