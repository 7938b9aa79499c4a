"""The in-region check (spot_callbacks/accounting/region.py) against loopback metadata services, moto S3 and fake GCS."""

from __future__ import annotations

import json
import logging
import re
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import s3fs
import torch
from conftest import ServerInfo

from spot_callbacks import SpotConfig
from spot_callbacks._format import format_seconds
from spot_callbacks.accounting.region import (
    ASSUMED_CROSS_REGION_BYTES_PER_S,
    Mismatch,
    Placement,
    RegionCheck,
    instance_placement,
)
from spot_callbacks.engine import SpotEngine


@pytest.fixture
def eu_bucket(s3_server: ServerInfo) -> Iterator[str]:
    """A moto bucket created with LocationConstraint eu-west-1 (the shared test bucket has none: us-east-1)."""
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    bucket = f"spot-eu-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket, region_name="eu-west-1")
    assert fs.call_s3("get_bucket_location", Bucket=bucket)["LocationConstraint"] == "eu-west-1"
    try:
        yield bucket
    finally:
        fs.rm(bucket, recursive=True)


def s3_engine(s3_server: ServerInfo, bucket: str) -> SpotEngine:
    config = SpotConfig(
        dirpath=f"s3://{bucket}/{uuid.uuid4().hex}",
        storage_options=dict(s3_server.storage_options),
        interval=None,
        preemption=[],
    )
    return SpotEngine(config, framework="test")


def region_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "this instance runs in" in r.getMessage()
    ]


def test_a_bucket_in_another_region_warns_once_with_both_regions_and_the_resume_cost(
    aws_imds: Any, s3_server: ServerInfo, eu_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    engine = s3_engine(s3_server, eu_bucket)
    engine.start()
    try:
        assert engine.region_check is not None and engine.region_check.wait(10)
        engine.save_state(1, 0, {"w": torch.ones(1000)}, reason="steps")
        assert engine.wait_for_commit(timeout=30)
        for step in (2, 3, 4):
            engine.decide(step)
    finally:
        engine.finish()
    warnings = region_warnings(caplog)
    assert len(warnings) == 1, warnings
    size = engine.store.latest().size_bytes
    expected = format_seconds(size / ASSUMED_CROSS_REGION_BYTES_PER_S)
    assert "aws eu-west-1" in warnings[0] and "aws us-east-1" in warnings[0]
    assert f"about {expected} at an assumed 100 MB/s" in warnings[0]
    assert "testing" not in warnings[0]  # the credentials (key and secret are both "testing")
    assert aws_imds.matching("/latest/meta-data/placement/region")


def test_a_bucket_in_the_instances_region_says_nothing(
    aws_imds: Any, s3_server: ServerInfo, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="spot_callbacks")
    engine = s3_engine(s3_server, s3_server.bucket)  # no LocationConstraint: us-east-1, like the instance
    engine.start()
    try:
        assert engine.region_check is not None and engine.region_check.wait(10)
        engine.decide(1)
    finally:
        engine.finish()
    assert aws_imds.matching("/latest/meta-data/placement/region")  # it did ask
    assert engine.region_check.mismatch is None
    assert region_warnings(caplog) == []


def test_off_cloud_the_check_is_silent_and_start_does_not_wait_for_it(
    aws_imds: Any, metadata_env: Any, s3_server: ServerInfo, eu_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="spot_callbacks")
    # A metadata service that holds the request (like a firewalled link-local address); the others refuse.
    aws_imds.fault = "hang"
    check = RegionCheck(*_fs_and_root(s3_server, eu_bucket), f"s3://{eu_bucket}/run", timeout_s=30.0)
    check.start()
    assert aws_imds.wait_for_requests(1, "/latest/api/token")
    assert not check.wait(0)  # start() has returned while the metadata request is still held
    aws_imds.reset()  # the held request is answered (with garbage), like a late service
    assert check.wait(10)
    assert check.mismatch is None and check.warn_once(10**9) is None
    # And the same through the engine, with every metadata endpoint refusing at once.
    metadata_env()
    engine = s3_engine(s3_server, eu_bucket)
    engine.start()
    try:
        assert engine.region_check is not None and engine.region_check.wait(10)
        engine.decide(1)
    finally:
        engine.finish()
    assert engine.region_check.mismatch is None
    # Only the library's own lines about this test's store: a client of an earlier test on this worker
    # (gcsfs retrying a server that test stopped) may still log from its background loop, and an earlier
    # run's attempt record is rewritten for AFTER_END_S after its end, into a bucket its test removed.
    ours = [
        r
        for r in caplog.records
        if r.name.startswith("spot_callbacks") and not re.search(rf"s3://(?!{eu_bucket}/)", r.getMessage())
    ]
    assert [r.getMessage() for r in ours if r.levelno >= logging.WARNING] == []


def _fs_and_root(s3_server: ServerInfo, bucket: str) -> tuple[Any, str]:
    return s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options), f"{bucket}/run"


def test_the_instance_region_of_each_cloud(
    aws_imds: Any, gcp_metadata: Any, azure_events: Any, metadata_env: Any
) -> None:
    aws_imds.region = "ap-south-1"
    gcp_metadata.zone = "projects/42/zones/europe-west4-b"
    azure_events.location = "westeurope"
    metadata_env(aws=aws_imds.url)
    assert instance_placement() == Placement("aws", "ap-south-1")
    metadata_env(gcp=gcp_metadata.url)
    assert instance_placement() == Placement("gcp", "europe-west4")
    metadata_env(azure=azure_events.url)
    assert instance_placement() == Placement("azure", "westeurope")
    metadata_env()
    assert instance_placement() is None
    aws_imds.fault = "no-token"  # an IMDS that refuses: unknown, like off-cloud
    metadata_env(aws=aws_imds.url)
    assert instance_placement() is None


def test_a_gcs_bucket_in_another_region_is_found_from_its_location(
    gcp_metadata: Any, gcs_server: ServerInfo
) -> None:
    import gcsfs

    # fake-gcs-server puts every bucket in US-CENTRAL1 (it ignores a requested location).
    with urllib.request.urlopen(
        f"{gcs_server.endpoint_url}/storage/v1/b/{gcs_server.bucket}", timeout=10
    ) as r:
        assert json.load(r)["location"] == "US-CENTRAL1"
    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **gcs_server.storage_options)
    url = f"gs://{gcs_server.bucket}/run"
    gcp_metadata.zone = "projects/42/zones/europe-west4-b"
    check = RegionCheck(fs, f"{gcs_server.bucket}/run", url)
    check.start()
    assert check.wait(10) and check.mismatch is not None
    assert check.mismatch.bucket == Placement("gcp", "us-central1")
    assert check.mismatch.instance == Placement("gcp", "europe-west4")
    # The same bucket seen from a VM in its region: nothing to say.
    gcp_metadata.zone = "projects/42/zones/us-central1-a"
    same = RegionCheck(fs, f"{gcs_server.bucket}/run", url)
    same.start()
    assert same.wait(10) and same.mismatch is None
    assert len(gcp_metadata.matching("/computeMetadata/v1/instance/zone")) == 2


def test_the_resume_cost_uses_the_measured_pull_speed_when_there_is_one() -> None:
    mismatch = Mismatch("s3://b/run", Placement("aws", "eu-west-1"), Placement("aws", "us-east-1"))
    check = RegionCheck(None, "b/run", "s3://b/run")
    check.mismatch = mismatch
    check._done.set()
    message = check.warn_once(98 * 10**9, pulled=(98 * 10**9, 490.0))  # 200 MB/s measured
    assert message is not None and "about 8.2 min (490 s) at the 200 MB/s this run's pull measured" in message
    assert check.warn_once(98 * 10**9, pulled=(98 * 10**9, 490.0)) is None  # once
    # A GCS multi-region holds the regions of its continent.
    assert Placement("gcp", "eu", ("europe-",)).contains(Placement("gcp", "europe-west1"))
    assert not Placement("gcp", "eu", ("europe-",)).contains(Placement("aws", "europe-west1"))
