"""The fast data plane against a server that lies (store/clients/obstores.py): the manifest is the truth.

A hostile proxy of our own (:mod:`helpers.hostile`) stands in front of moto and lies about one
checkpoint's payload: a HEAD of 10**12 bytes, an HTML page, a body 1000 bytes too long or short, a
wrong Content-Range, a trickle, a stall. Each lie is damage at once (never retried), the resume falls
back to the previous checkpoint with one line, nothing is written past the manifest's size, and a
process pulling through a trickling or stalled server exits within a bound.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.hostile import hostile_proxy
from helpers.reliability_counts import DAMAGED, record

from spot_callbacks import CheckpointStore
from spot_callbacks.resume import pull_newest_valid
from spot_callbacks.store import step_dirname
from spot_callbacks.store.clients.base import MiB
from spot_callbacks.store.retry import RetryPolicy
from spot_callbacks.store.writer import CommitWriter

FAST_RETRY = RetryPolicy(attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05)
ROOT = Path(__file__).resolve().parent.parent


def payload(tmp_path: Path, step: int, size: int) -> tuple[Path, bytes]:
    folder = tmp_path / f"src{step}"
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(step)
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).numpy().tobytes()
    (folder / "state.pt").write_bytes(raw)
    (folder / "small.bin").write_bytes(b"s" * 100)
    return folder, raw


def two_checkpoints(server: Any, tmp_path: Path, name: str, size: int) -> tuple[str, dict[int, bytes]]:
    """Steps 1 and 2 committed straight to moto (no proxy); the url of their run."""
    url = f"s3://{server.bucket}/{name}-{tmp_path.name}"
    store = CheckpointStore(url, storage_options=dict(server.storage_options), retry=FAST_RETRY)
    contents = {}
    for step in (1, 2):
        folder, contents[step] = payload(tmp_path, step, size)
        CommitWriter(store).write_checkpoint(step, folder, reason="manual", framework="test")
    return url, contents


def through(proxy: Any, server: Any) -> dict[str, Any]:
    return {**server.storage_options, "endpoint_url": proxy.url}


@pytest.mark.parametrize(
    ("lie", "shape"),
    [(lie, "stream") for lie in ("html", "extra", "short")]
    + [(lie, "segments") for lie in ("html", "extra", "short", "range")],
)
def test_a_body_that_disagrees_with_the_manifest_is_damage_at_once_and_the_resume_falls_back(
    lie, shape, s3_server, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("SPOT_TRANSFER_BUFFER_MB", "8")
    monkeypatch.setenv("SPOT_PULL_SEGMENT_MB", "128" if shape == "stream" else "1")  # 4 MiB: 4 segments
    url, contents = two_checkpoints(s3_server, tmp_path, f"{lie}-{shape}", 4 * MiB + 7)
    target = f"{step_dirname(2)}/state.pt"
    with hostile_proxy(s3_server.port, target, lie) as proxy:
        store = CheckpointStore(url, storage_options=through(proxy, s3_server), retry=FAST_RETRY)
        with caplog.at_level(logging.WARNING, logger="spot_callbacks"):
            found = pull_newest_valid(store, lambda step: tmp_path / "pulled" / str(step))
    assert found is not None and found.step == 1
    assert (tmp_path / "pulled" / "1" / "state.pt").read_bytes() == contents[1]
    assert sorted(os.listdir(tmp_path / "pulled")) == ["1"]  # step 2's staging is gone, nothing half-written
    skipped = [r.getMessage() for r in caplog.records if "skipping damaged checkpoint" in r.getMessage()]
    assert len(skipped) == 1 and step_dirname(2) in skipped[0] and "not the one committed" in skipped[0]
    assert "\n" not in skipped[0]  # one line, no Rust debug dump
    assert not [r for r in caplog.records if "retrying" in r.getMessage() and target in r.getMessage()]
    assert (
        1 <= proxy.answered["GET"] <= 4
    )  # one attempt: one GET, or one per segment; a lie is not asked again
    record(DAMAGED, 1)


def test_a_head_that_lies_about_the_size_is_never_asked_the_manifest_sizes_the_pull(
    s3_server, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPOT_PULL_SEGMENT_MB", "1")
    url, contents = two_checkpoints(s3_server, tmp_path, "head", 4 * MiB + 7)
    with hostile_proxy(s3_server.port, f"{step_dirname(2)}/state.pt", "head") as proxy:
        store = CheckpointStore(url, storage_options=through(proxy, s3_server), retry=FAST_RETRY)
        pulled = store.pull(2, tmp_path / "pulled")
        assert store.verify(2)
    assert (pulled / "state.pt").read_bytes() == contents[2]
    assert proxy.answered["HEAD"] == 0  # a payload pull or verify sends no HEAD at all


SUBPROCESS_PULL = """
import logging, sys, time
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from spot_callbacks import CheckpointStore
from spot_callbacks.resume import pull_newest_valid
from spot_callbacks.store.retry import RetryPolicy
url, endpoint, key, secret, dest = sys.argv[1:6]
options = {"key": key, "secret": secret, "endpoint_url": endpoint, "config_kwargs": {"read_timeout": 3}}
store = CheckpointStore(url, storage_options=options, retry=RetryPolicy(attempts=2, initial_backoff_s=0.1, max_backoff_s=0.2))
began = time.monotonic()
try:
    found = pull_newest_valid(store, lambda step: __import__("pathlib").Path(dest) / str(step))
    print(f"resumed {found.step if found else None} after {time.monotonic() - began:.1f}s", flush=True)
except Exception as err:
    print(f"failed after {time.monotonic() - began:.1f}s: {type(err).__name__}: {err}", flush=True)
    sys.exit(3)
"""


@pytest.mark.parametrize("lie", ["trickle", "stall"])
def test_a_process_pulling_from_a_trickling_or_stalled_server_ends_the_pull_and_exits_promptly(
    lie, s3_server, tmp_path
):
    url, contents = two_checkpoints(s3_server, tmp_path, lie, 2 * MiB)
    script = tmp_path / "pull.py"
    script.write_text(textwrap.dedent(SUBPROCESS_PULL))
    options = s3_server.storage_options
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPOT_UPLOAD_MIN_MBPS": "100", "SPOT_PULL_SEGMENT_MB": "1"}
    with hostile_proxy(s3_server.port, f"{step_dirname(2)}/state.pt", lie, trickle_s=1.0) as proxy:
        began = time.monotonic()
        child = subprocess.run(
            [sys.executable, str(script), url, proxy.url, options["key"], options["secret"], str(tmp_path / "out")],
            env=env, capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        took = time.monotonic() - began
    output = child.stdout + child.stderr
    print(f"the pull through a {lie} ended and the process exited after {took:.1f}s")
    assert proxy.answered["GET"] >= 1, output
    # A trickle passes every read timeout: its size-derived deadline (16 s at least) ends it as damage,
    # and the resume falls back. A stall trips the read timeout (3 s): retried (2 attempts), then an error.
    if lie == "trickle":
        assert child.returncode == 0 and "resumed 1" in child.stdout, output
        assert "skipping damaged checkpoint" in output and "trickling or stalled server" in output, output
        assert (tmp_path / "out" / "1" / "state.pt").read_bytes() == contents[1]
    else:
        assert child.returncode == 3 and "did not answer in time" in child.stdout, output
        assert "Debug source" not in output, output
    assert took < 120, f"the pull through a {lie} took {took:.0f}s to end and exit: {output}"


def test_a_server_without_bulk_delete_gets_single_deletes_and_retention_still_prunes(
    s3_server, tmp_path
) -> None:
    url = f"s3://{s3_server.bucket}/no-bulk-{tmp_path.name}"
    with hostile_proxy(s3_server.port, "", "no-bulk-delete") as proxy:
        store = CheckpointStore(url, storage_options=through(proxy, s3_server), retry=FAST_RETRY)
        writer = CommitWriter(store)
        for step in (1, 2, 3, 4):
            folder, _ = payload(tmp_path, step, 1000)
            info = writer.write_checkpoint(step, folder, reason="manual", framework="test")
            writer.settle(info, keep_last=2, deadline=None)
        assert proxy.answered["POST"] >= 1  # the bulk delete was asked and refused
    direct = CheckpointStore(url, storage_options=dict(s3_server.storage_options))
    assert [info.step for info in direct.committed()] == [3, 4]
    direct.fs.invalidate_cache()
    assert not [
        path for path in direct.fs.find(direct.root) if "step-000000001" in path or "step-000000002" in path
    ]


def test_a_server_without_bulk_delete_rewrites_and_deletes_a_step_one_object_at_a_time(
    s3_server, tmp_path
) -> None:
    url = f"s3://{s3_server.bucket}/no-bulk-step-{tmp_path.name}"
    with hostile_proxy(s3_server.port, "", "no-bulk-delete") as proxy:
        store = CheckpointStore(url, storage_options=through(proxy, s3_server), retry=FAST_RETRY)
        for step, seed in ((1, 1), (1, 2), (2, 3)):  # step 1 twice: the second write deletes the first
            folder, raw = payload(tmp_path / f"seed{seed}", seed, 1000)
            CommitWriter(store).write_checkpoint(step, folder, reason="manual", framework="test")
        pulled = store.pull(1, tmp_path / "pulled")
        assert (pulled / "state.pt").read_bytes() == payload(tmp_path / "again", 2, 1000)[1]
        store.delete(2)
        # The bulk delete was asked once and refused: the store learned it (manifest deletes included).
        assert proxy.answered["POST"] == 1
    direct = CheckpointStore(url, storage_options=dict(s3_server.storage_options))
    assert [info.step for info in direct.committed()] == [1]
    direct.fs.invalidate_cache()
    assert not [path for path in direct.fs.find(direct.root) if "step-000000002" in path]


def test_a_server_without_bulk_delete_passes_the_preflight_and_leaves_no_probe(s3_server, tmp_path) -> None:
    from spot_callbacks.store.preflight import PROBE_PREFIX, preflight

    url = f"s3://{s3_server.bucket}/no-bulk-preflight-{tmp_path.name}"
    with hostile_proxy(s3_server.port, "", "no-bulk-delete") as proxy:
        preflight(CheckpointStore(url, storage_options=through(proxy, s3_server), retry=FAST_RETRY))
        assert proxy.answered["POST"] >= 1  # the probe's delete went as a bulk delete first, refused
    direct = CheckpointStore(url, storage_options=dict(s3_server.storage_options))
    direct.fs.invalidate_cache()
    assert not [
        path
        for path in direct.fs.find(f"{s3_server.bucket}")
        if PROBE_PREFIX in path and url.rsplit("/", 1)[1] in path
    ]
