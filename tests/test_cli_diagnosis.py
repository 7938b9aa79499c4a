"""`spot-callbacks` says what is wrong with a store the way training does: one line with the cause and the
fix, within the preflight's bounds, no backend retries or tracebacks unless ``-v``.

Against real servers (moto, Azurite) and sockets (a closed port, one that accepts and never answers);
the commands run as a user runs them (a subprocess) where what the backends print matters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
from conftest import closed_port_url
from helpers.hostile import WRONG_REGION, hostile_proxy
from test_preflight import WRONG_AZURE_KEY, _azurite_key, silent_socket  # noqa: F401 - a fixture

from spot_callbacks import CheckpointStore, SpotConfig
from spot_callbacks.cli import main
from spot_callbacks.cli.commands import describe_error
from spot_callbacks.engine import SpotEngine
from spot_callbacks.errors import ConfigError
from spot_callbacks.store.diagnosis import diagnose
from spot_callbacks.store.retry import RetryPolicy
from spot_callbacks.store.writer import CommitWriter

BUDGET_S = 10  # $SPOT_PREFLIGHT_TIMEOUT_S for these runs: the default 60 s works the same, slower


def spot_callbacks(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str, float]:
    """Run the command in a fresh process; return (exit code, stdout, stderr, seconds)."""
    environ = {**os.environ, "SPOT_PREFLIGHT_TIMEOUT_S": str(BUDGET_S), **(env or {})}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "spot_callbacks.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={key: value for key, value in environ.items() if value is not None},
    )
    return result.returncode, result.stdout, result.stderr, time.monotonic() - started


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("spot-callbacks: error: ") and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------- endpoints that do not answer
def test_a_refused_s3_endpoint_is_one_line_with_the_fix_within_the_bound() -> None:
    options = json.dumps({"key": "k", "secret": "s", "endpoint_url": closed_port_url()})
    code, out, err, elapsed_s = spot_callbacks("--storage-options", options, "ls", "s3://bucket/run")
    line = one_error_line(err)
    assert (code, out) == (1, "")
    assert (
        "cannot read s3://bucket/run: nothing accepts connections" in line
        and "Fix: check endpoint_url" in line
    )
    # The backend's words, once; on a loaded machine the client's own retries can outlast the attempt,
    # and then a direct connect tells a refused endpoint from a silent one (its words).
    assert "attempt" not in err and ("EndpointConnectionError" in line or "ConnectionRefusedError" in line)
    assert elapsed_s < BUDGET_S + 15, elapsed_s  # a refused connection gets half the budget


def test_a_silent_s3_endpoint_ends_within_the_budget(silent_socket: str) -> None:  # noqa: F811
    options = json.dumps({"key": "k", "secret": "s", "endpoint_url": silent_socket})
    code, _, err, elapsed_s = spot_callbacks("--storage-options", options, "verify", "s3://bucket/run")
    line = one_error_line(err)
    # Nothing ever answered: a longer preflight budget would not help, the connect timeout is the knob.
    assert code == 1 and "did not answer in time" in line and "SPOT_CONNECT_TIMEOUT_S" in line
    assert elapsed_s < BUDGET_S + 20, elapsed_s


def test_a_dead_gcs_endpoint_prints_no_backend_tracebacks() -> None:
    options = json.dumps({"endpoint_url": closed_port_url(), "token": "anon", "project": "test"})
    code, _, err, elapsed_s = spot_callbacks("--storage-options", options, "pull", "gs://bucket/run", "dest")
    line = one_error_line(err)  # gcsfs logged six tracebacks through Python's last-resort handler
    assert code == 1 and "nothing accepts connections" in line and "endpoint_url" in line
    assert elapsed_s < BUDGET_S + 20, elapsed_s


def test_minus_v_shows_what_the_backend_said() -> None:
    options = json.dumps({"key": "k", "secret": "s", "endpoint_url": closed_port_url()})
    code, _, err, _ = spot_callbacks("-v", "--storage-options", options, "ls", "s3://bucket/run")
    assert code == 1 and "Traceback" in err and "nothing accepts connections" in err.splitlines()[-1]


# ----------------------------------------------------------------- credentials
def test_a_wrong_azure_key_is_the_cause_and_the_fix_not_the_xml(azurite_server, capsys) -> None:
    conn = azurite_server.connection_string.replace(_azurite_key(azurite_server), WRONG_AZURE_KEY)
    options = json.dumps({"connection_string": conn})
    assert main(["--storage-options", options, "ls", f"az://{azurite_server.bucket}/run"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "refused the credentials" in line and "account key, SAS token or connection string" in line
    assert "<?xml" not in line and WRONG_AZURE_KEY not in line


def test_no_azure_credentials_says_where_they_go() -> None:
    env = {name: None for name in os.environ if name.startswith("AZURE_STORAGE")}
    code, _, err, _ = spot_callbacks("ls", "az://container/run", env=env)  # type: ignore[arg-type]
    line = one_error_line(err)
    assert code == 1 and "no credentials were found" in line and "AZURE_STORAGE_CONNECTION_STRING" in line
    assert "Must provide either" not in line


# ----------------------------------------------------------------- an option's name
def test_a_mistyped_option_gets_the_backends_own_name(s3_server, capsys) -> None:
    options = json.dumps({"endpoint": s3_server.endpoint_url})
    assert main(["--storage-options", options, "ls", f"s3://{s3_server.bucket}/run"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "storage_options key 'endpoint' is not an option of s3fs.S3FileSystem" in line
    assert "did you mean 'endpoint_url'?" in line and "AioSession" not in line
    # gcsfs ignored it silently (and went to Google's servers)
    with pytest.raises(
        ConfigError, match="'endpoint' is not an option of gcsfs.*did you mean 'endpoint_url'"
    ):
        CheckpointStore("gs://bucket/run", {"endpoint": "http://127.0.0.1:1", "token": "anon"})


def test_training_names_the_mistyped_option_at_construction(s3_server) -> None:
    config = SpotConfig(
        dirpath=f"s3://{s3_server.bucket}/run", storage_options={"endpoint": s3_server.endpoint_url},
        interval=None, preemption=[],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="did you mean 'endpoint_url'"):
        SpotEngine(config, "test")


# ----------------------------------------------------------------- nothing there
def test_a_missing_bucket_is_named_by_ls_verify_and_pull(s3_server, capsys, tmp_path) -> None:
    options = json.dumps(s3_server.storage_options)
    for argv in (["ls"], ["verify"], ["pull"], ["report"]):
        extra = [str(tmp_path / "dest")] if argv == ["pull"] else []
        assert main(["--storage-options", options, *argv, "s3://no-such-bucket-ux/run", *extra]) == 1
        line = one_error_line(capsys.readouterr().err)
        assert "'no-such-bucket-ux' does not exist" in line, argv  # not "no committed checkpoints"


def test_a_prefix_typo_is_an_error_with_the_name_it_meant(s3_server, capsys, tmp_path) -> None:
    run = f"s3://{s3_server.bucket}/ux-{uuid.uuid4().hex[:8]}/runs"
    store = CheckpointStore(f"{run}/demo", s3_server.storage_options)
    (tmp_path / "state.pt").write_bytes(b"weights")
    CommitWriter(store).write_checkpoint(3, tmp_path, reason="manual", framework="test")
    options = json.dumps(s3_server.storage_options)
    for argv in (["ls"], ["verify"], ["pull"]):
        extra = [str(tmp_path / "dest")] if argv == ["pull"] else []
        assert main(["--storage-options", options, *argv, f"{run}/dem0", *extra]) == 1
        line = one_error_line(capsys.readouterr().err)
        assert f"nothing is stored under {run}/dem0" in line and f"did you mean '{run}/demo'?" in line, argv
    assert main(["--storage-options", options, "ls", f"{run}/demo"]) == 0


# ----------------------------------------------------------------- the fast clients' errors
def _committed(server: Any, tmp_path: Any, name: str) -> str:
    url = f"s3://{server.bucket}/{name}-{uuid.uuid4().hex[:8]}"
    store = CheckpointStore(url, server.storage_options)
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src" / "state.pt").write_bytes(os.urandom(3 * 1024 * 1024))
    CommitWriter(store).write_checkpoint(1, tmp_path / "src", reason="manual", framework="test")
    return url


@pytest.mark.parametrize(("target", "plane"), [("", "auto"), ("state.pt", "obstore"), ("state.pt", "boto3")])
def test_a_bucket_in_another_region_is_named_by_pull_whichever_client_asked(
    target, plane, s3_server, tmp_path
) -> None:
    # AWS answers 301 PermanentRedirect with x-amz-bucket-region to a client of another region. The
    # proxy says so to every request ("": s3fs' listing meets it first) or to the payload's GETs and
    # every HEAD (the fast client meets it; obstore reads no headers of an error: boto3 asks once).
    url = _committed(s3_server, tmp_path, "region")
    with hostile_proxy(s3_server.port, target, "wrong-region") as proxy:
        options = json.dumps({**s3_server.storage_options, "endpoint_url": proxy.url})
        code, _, err, _ = spot_callbacks(
            "--storage-options", options, "pull", url, str(tmp_path / "dest"), env={"SPOT_DATA_PLANE": plane}
        )
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("pull ")]
    assert len(lines) == 1 and lines[0].startswith("spot-callbacks: error: "), err
    assert code == 1 and f"the bucket '{s3_server.bucket}' is in region '{WRONG_REGION}'" in lines[0]
    assert f"client_kwargs={{'region_name': '{WRONG_REGION}'}}" in lines[0]
    assert "Generic S3 error" not in err and "retrying" not in err and "Traceback" not in err
    if target:
        # The payload's client met it (obstore's GET; s3transfer's HEAD before its GETs).
        assert any(method in ("GET", "HEAD") and "state.pt" in path for method, path, _ in proxy.seen)


def test_a_resume_from_a_bucket_in_another_region_stops_with_the_region_not_a_fallback(
    s3_server, tmp_path, caplog
) -> None:
    import logging

    from spot_callbacks.resume import pull_newest_valid

    url = _committed(s3_server, tmp_path, "region-resume")
    with hostile_proxy(s3_server.port, "state.pt", "wrong-region") as proxy:
        options = {**s3_server.storage_options, "endpoint_url": proxy.url}
        store = CheckpointStore(url, options, retry=RetryPolicy(attempts=3, initial_backoff_s=0.01))
        with caplog.at_level(logging.WARNING, logger="spot_callbacks"), pytest.raises(ValueError) as raised:
            pull_newest_valid(store, lambda step: tmp_path / "pulled" / str(step))
    assert f"the bucket '{s3_server.bucket}' is in region '{WRONG_REGION}'" in str(raised.value)
    assert "\n" not in str(raised.value)
    assert "skipping damaged checkpoint" not in caplog.text and "retrying" not in caplog.text
    found = diagnose(raised.value, "s3", s3_server.bucket)
    assert found.permanent and f"client_kwargs={{'region_name': '{WRONG_REGION}'}}" in found.fix


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (
            "Generic S3 error: Error performing GET http://h/b/k in 10s - Connection refused\n\nDebug: ...",
            "nothing accepts connections",
        ),
        (
            "Generic S3 error: HTTP error: error sending request\n\nDebug source:\nTimeout { .. }",
            "stopped answering in time",
        ),
        (
            "Generic S3 error: Error performing GET: Client error with status 403 Forbidden: AccessDenied\n\nDebug ...",
            "permission denied reading",
        ),
    ],
)
def test_obstores_multi_line_errors_become_one_diagnosis_line(error, says) -> None:
    from spot_callbacks.store.clients.obstores import translated

    class GenericError(Exception):
        """obstore's class name for most of object_store's errors."""

    told = translated(GenericError(error), "s3://b/run/step-000000001/state.pt")
    line = describe_error(told, url="s3://b/run")
    assert says in line and "\n" not in line and "Debug" not in line, line
