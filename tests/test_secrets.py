"""Secrets: a recognisable credential in storage_options appears nowhere a run or the CLI leaves text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from spot_callbacks import CheckpointStore

SCRIPT = Path(__file__).parent / "scripts" / "lightning_run.py"
KEY_MARKER = "AKIASECRETMARKER123"  # moto accepts any key
SECRET_MARKER = "SECRETMARKERsecretvalue42"


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spot_callbacks.cli", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
@pytest.mark.remote_store
def test_a_secret_in_storage_options_never_appears_in_output_files_or_manifests(tmp_path, s3_server) -> None:
    url = f"s3://{s3_server.bucket}/secrets-{uuid.uuid4().hex[:8]}"
    options = {"key": KEY_MARKER, "secret": SECRET_MARKER, "endpoint_url": s3_server.endpoint_url}
    scratch = tmp_path / "scratch"
    env = {**os.environ, "SPOT_SCRATCH": str(scratch), "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--dirpath", url, "--storage-options", json.dumps(options),
         "--every-n-steps", "5", "--max-epochs", "2", "--out", str(tmp_path / "out.pt"),
         "--logger-dir", str(tmp_path / "logs")],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    store = CheckpointStore(url, storage_options=options)
    assert store.latest() is not None and store.latest().step == 20
    texts = {"training stdout": run.stdout, "training stderr": run.stderr}
    for argv in (["ls", url], ["verify", url], ["report", url], ["pull", url, str(tmp_path / "pulled")],
                 ["ls", "s3://no-such-bucket-for-secrets/run"]):  # fmt: skip
        done = _cli("-vv", "--storage-options", json.dumps(options), *argv)
        texts[f"cli {argv[0]} (exit {done.returncode})"] = done.stdout + done.stderr
    for remote in store.fs.find(store.root):  # every object in the store, manifests and the lock included
        texts[remote] = store.fs.cat_file(remote).decode("latin-1")
    for local in [p for root in (scratch, tmp_path / "logs", tmp_path / "pulled") for p in root.rglob("*")]:
        if local.is_file():
            texts[str(local)] = local.read_bytes().decode("latin-1")
    assert len(texts) >= 12, sorted(texts)  # outputs, several checkpoints' files, local copies, logs
    leaks = [name for name, text in texts.items() if KEY_MARKER in text or SECRET_MARKER in text]
    print(f"\nsecrets: grepped {len(texts)} outputs and files for the markers, {len(leaks)} leaks")
    assert not leaks, leaks
