"""Every storage option is honoured by the fast clients or refused with one line naming it (store/clients/options.py).

One test per row of the table docs/storage.md prints (:data:`S3_OPTIONS`, :data:`AZURE_OPTIONS`).
"Honoured" is shown by the server where it can show it: moto's ``head_object``/``get_object_acl``/
``get_object_tagging`` of the uploaded payload, or the requests a recording proxy
(:mod:`helpers.hostile` with ``lie="none"``) saw. Where no server of the suite can show it (TLS: the
suite's servers are plain http), the test reads the option off both clients as built.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.hostile import hostile_proxy

from spot_callbacks import CheckpointStore
from spot_callbacks.store import step_dirname
from spot_callbacks.store.clients.options import AZURE_OPTIONS, S3_OPTIONS
from spot_callbacks.store.clients.s3 import S3Plane
from spot_callbacks.store.dataplane import FsspecPlane
from spot_callbacks.store.retry import RetryPolicy
from spot_callbacks.store.writer import CommitWriter

FAST_RETRY = RetryPolicy(attempts=2, initial_backoff_s=0.01, max_backoff_s=0.05)
ROOT = Path(__file__).resolve().parent.parent
PAYLOAD = bytes(range(256)) * 400
CA_BUNDLE = str(Path(__import__("botocore").__file__).parent / "cacert.pem")


def round_trip(url: str, options: dict[str, Any], tmp_path: Path, caplog: Any) -> CheckpointStore:
    """A checkpoint written, verified and pulled through a store with ``options``: the bytes come back."""
    store = CheckpointStore(url, storage_options=options, retry=FAST_RETRY)
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "src" / "state.pt").write_bytes(PAYLOAD)
    with caplog.at_level(logging.INFO, logger="spot_callbacks"):
        CommitWriter(store).write_checkpoint(1, tmp_path / "src", reason="manual", framework="test")
        assert store.verify(1)
        assert (store.pull(1, tmp_path / "pulled") / "state.pt").read_bytes() == PAYLOAD
    return store


def fallback_lines(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if "payload bytes of" in r.getMessage()]


def s3_object(server: Any, url: str) -> tuple[Any, str, str]:
    import boto3

    client = boto3.client(
        "s3", endpoint_url=server.endpoint_url, aws_access_key_id=server.storage_options["key"],
        aws_secret_access_key=server.storage_options["secret"], region_name="us-east-1",
    )  # fmt: skip
    key = f"{url.split('/', 3)[3]}/{step_dirname(1)}/state.pt"
    return client, server.bucket, key


def obstore_of(store: CheckpointStore) -> Any:
    plane = store.data_plane
    assert isinstance(plane, S3Plane) and plane.pull_with == "obstore"
    return plane._obstore(plane._split(store.url)[0])(16.0)


# ------------------------------------------------------------------ s3: one case per row
def honoured_on_server(extra: dict[str, Any], check: Callable[[Any, str, str], None]) -> Any:
    def case(server: Any, url: str, tmp_path: Path, caplog: Any) -> None:
        store = round_trip(url, {**server.storage_options, **extra}, tmp_path, caplog)
        assert isinstance(store.data_plane, S3Plane) and store.data_plane.pull_with == "obstore"
        check(*s3_object(server, url))

    return case


def honoured_in_requests(
    extra: Callable[[Any], dict[str, Any]], check: Callable[[list[tuple[str, str, dict[str, str]]]], None]
) -> Any:
    def case(server: Any, url: str, tmp_path: Path, caplog: Any) -> None:
        with hostile_proxy(server.port, "", "none") as proxy:
            options = {**server.storage_options, "endpoint_url": proxy.url, **extra(server)}
            options = {k: v for k, v in options.items() if v is not None}
            store = round_trip(url, options, tmp_path, caplog)
        assert isinstance(store.data_plane, S3Plane) and store.data_plane.pull_with == "obstore"
        payload = [seen for seen in proxy.seen if "state.pt" in seen[1] and seen[0] in ("PUT", "GET")]
        assert {method for method, _, _ in payload} == {"PUT", "GET"}
        check(payload)

    return case


def boto3_pulls(extra: dict[str, Any], named: str) -> Any:
    def case(server: Any, url: str, tmp_path: Path, caplog: Any) -> None:
        store = round_trip(url, {**server.storage_options, **extra}, tmp_path, caplog)
        plane = store.data_plane
        assert isinstance(plane, S3Plane) and plane.pull_with == "boto3"
        assert named in (plane.pull_fallback_reason or "")
        lines = fallback_lines(caplog)
        assert len(lines) == 1 and f"(pulls by boto3: {named}" in lines[0]

    return case


def fsspec_only(extra: Callable[[Any], dict[str, Any]], named: str, *, moves: bool = True) -> Any:
    def case(server: Any, url: str, tmp_path: Path, caplog: Any) -> None:
        options = {**server.storage_options, **extra(server)}
        if moves:
            store = round_trip(url, options, tmp_path, caplog)
        else:  # an option the server itself would refuse: the decision and its line, before any byte
            store = CheckpointStore(url, storage_options=options, retry=FAST_RETRY)
            with caplog.at_level(logging.INFO, logger="spot_callbacks"):
                from spot_callbacks.store.dataplane import announce

                announce(store.url, store.data_plane)
        assert isinstance(store.data_plane, FsspecPlane) and named in (store.data_plane.reason or "")
        lines = fallback_lines(caplog)
        assert len(lines) == 1 and "through fsspec (S3FileSystem)" in lines[0] and named in lines[0]

    return case


def built(extra: dict[str, Any], check: Callable[[CheckpointStore], None]) -> Any:
    def case(server: Any, url: str, tmp_path: Path, caplog: Any) -> None:
        store = round_trip(url, {**server.storage_options, **extra}, tmp_path, caplog)
        check(store)

    return case


def _signed_in(region: str) -> Callable[[list[tuple[str, str, dict[str, str]]]], None]:
    def check(payload: list[tuple[str, str, dict[str, str]]]) -> None:
        assert all(f"/{region}/s3/aws4_request" in headers["authorization"] for _, _, headers in payload)

    return check


def _unsigned(payload: list[tuple[str, str, dict[str, str]]]) -> None:
    assert all("authorization" not in headers for _, _, headers in payload)


def _requester_pays(payload: list[tuple[str, str, dict[str, str]]]) -> None:
    assert all(headers.get("x-amz-request-payer") == "requester" for _, _, headers in payload)


def _path_style(payload: list[tuple[str, str, dict[str, str]]]) -> None:
    assert all(path.startswith("/spot-test") or "/" in path[1:] for _, path, _ in payload)


def _verify_off(store: CheckpointStore) -> None:
    plane = store.data_plane
    assert isinstance(plane, S3Plane)
    assert plane._boto()[1]._endpoint.http_session._verify is False
    assert obstore_of(store).client_options["allow_invalid_certificates"] == "true"


def _ca_bundle(store: CheckpointStore) -> None:
    plane = store.data_plane
    assert isinstance(plane, S3Plane) and plane.pull_with == "boto3"
    assert plane._boto()[1]._endpoint.http_session._verify == CA_BUNDLE


def _retries(store: CheckpointStore) -> None:
    assert obstore_of(store).retry_config["max_retries"] == 5
    # botocore's max_attempts counts the retries: 5 retries, 6 attempts; obstore's max_retries the same.
    assert store.data_plane._boto()[1].meta.config.retries["total_max_attempts"] == 6  # type: ignore[attr-defined]


def _timeouts(store: CheckpointStore) -> None:
    options = obstore_of(store).client_options
    assert (options["connect_timeout"], options["read_timeout"]) == ("3s", "7s")
    config = store.data_plane._boto()[1].meta.config  # type: ignore[attr-defined]
    assert (config.connect_timeout, config.read_timeout) == (3, 7)


def _sse_s3(client: Any, bucket: str, key: str) -> None:
    assert client.head_object(Bucket=bucket, Key=key)["ServerSideEncryption"] == "AES256"


def _sse_kms(client: Any, bucket: str, key: str) -> None:
    head = client.head_object(Bucket=bucket, Key=key)
    assert head["ServerSideEncryption"] == "aws:kms" and head["SSEKMSKeyId"].endswith("spot-key")


def _acl_class_tags(client: Any, bucket: str, key: str) -> None:
    assert client.head_object(Bucket=bucket, Key=key)["StorageClass"] == "STANDARD_IA"
    grants = client.get_object_acl(Bucket=bucket, Key=key)["Grants"]
    assert any(g["Grantee"].get("URI", "").endswith("AllUsers") and g["Permission"] == "READ" for g in grants)
    assert client.get_object_tagging(Bucket=bucket, Key=key)["TagSet"] == [{"Key": "team", "Value": "ml"}]


def _profile(server: Any) -> dict[str, Any]:
    return {"key": None, "secret": None, "profile": "spot-test"}


def _session(server: Any) -> dict[str, Any]:
    import aiobotocore.session

    return {"session": aiobotocore.session.AioSession()}


def _unsigned_config(server: Any) -> dict[str, Any]:
    from botocore import UNSIGNED

    return {"config_kwargs": {"signature_version": UNSIGNED}}


S3_CASES: dict[str, Any] = {
    "key, secret, token": honoured_in_requests(lambda s: {}, _signed_in("us-east-1")),
    "anon=True": honoured_in_requests(lambda s: {"key": None, "secret": None, "anon": True}, _unsigned),
    "profile": honoured_in_requests(_profile, _signed_in("us-east-1")),
    "endpoint_url, use_ssl": honoured_in_requests(lambda s: {"use_ssl": False}, _signed_in("us-east-1")),
    "client_kwargs region_name": honoured_in_requests(
        lambda s: {"client_kwargs": {"region_name": "eu-west-3"}}, _signed_in("eu-west-3")
    ),
    "client_kwargs verify=False": built({"client_kwargs": {"verify": False}}, _verify_off),
    "client_kwargs verify='ca.pem' (a CA bundle)": built(
        {"client_kwargs": {"verify": CA_BUNDLE}}, _ca_bundle
    ),
    "config_kwargs s3.addressing_style": honoured_in_requests(
        lambda s: {"config_kwargs": {"s3": {"addressing_style": "path"}}}, _path_style
    ),
    "config_kwargs retries max_attempts / total_max_attempts": built(
        {"config_kwargs": {"retries": {"max_attempts": 5}}}, _retries
    ),
    "config_kwargs retries mode='adaptive'": boto3_pulls(
        {"config_kwargs": {"retries": {"mode": "adaptive"}}}, "config_kwargs retries mode='adaptive'"
    ),
    "config_kwargs connect_timeout, read_timeout": built(
        {"config_kwargs": {"connect_timeout": 3, "read_timeout": 7}}, _timeouts
    ),
    "config_kwargs signature_version 's3v4' or UNSIGNED": honoured_in_requests(
        lambda s: {"config_kwargs": {"signature_version": "s3v4"}}, _signed_in("us-east-1")
    ),
    "config_kwargs signature_version other (e.g. 's3')": boto3_pulls(
        {"config_kwargs": {"signature_version": "s3"}}, "config_kwargs signature_version='s3'"
    ),
    "config_kwargs proxies, or another key obstore lacks": boto3_pulls(
        {"config_kwargs": {"proxies": {"https": "http://127.0.0.1:9"}}}, "config_kwargs proxies"
    ),
    "s3_additional_kwargs ServerSideEncryption, SSEKMSKeyId (SSE-S3, SSE-KMS)": honoured_on_server(
        {"s3_additional_kwargs": {"ServerSideEncryption": "AES256"}}, _sse_s3
    ),
    "s3_additional_kwargs ACL, StorageClass, Tagging": honoured_on_server(
        {"s3_additional_kwargs": {"ACL": "public-read", "StorageClass": "STANDARD_IA", "Tagging": "team=ml"}},
        _acl_class_tags,
    ),
    "s3_additional_kwargs SSECustomer* (SSE-C), ExpectedBucketOwner": boto3_pulls(
        {"s3_additional_kwargs": {"ExpectedBucketOwner": "123456789012"}}, "ExpectedBucketOwner on every GET"
    ),
    "requester_pays=True": honoured_in_requests(lambda s: {"requester_pays": True}, _requester_pays),
    "version_aware=True": boto3_pulls({"version_aware": True}, "version_aware=True"),
    "s3_additional_kwargs s3transfer's upload does not take": fsspec_only(
        lambda s: {"s3_additional_kwargs": {"Bogus": 1}}, "s3_additional_kwargs Bogus", moves=False
    ),
    "session= (an aiobotocore session)": fsspec_only(_session, "session="),
    "client_kwargs or a keyword boto3 does not take": fsspec_only(
        lambda s: {"client_kwargs": {"bogus_option": 1}}, "client_kwargs bogus_option", moves=False
    ),
}

# Rows with more than one value worth showing.
EXTRA_CASES = {
    "config_kwargs s3.addressing_style='virtual'": "virtual",
    "config_kwargs signature_version=UNSIGNED": honoured_in_requests(_unsigned_config, _unsigned),
    "SSE-KMS": honoured_on_server(
        {"s3_additional_kwargs": {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "spot-key"}}, _sse_kms
    ),
}


def test_every_row_of_the_table_has_a_case_and_a_line_in_the_docs():
    assert set(S3_CASES) == {row.option for row in S3_OPTIONS}
    assert set(AZURE_CASES) == {row.option for row in AZURE_OPTIONS}
    docs = (ROOT / "docs" / "storage.md").read_text()
    for row in (*S3_OPTIONS, *AZURE_OPTIONS):
        assert f"| {row.option} | {row.upload} | {row.pull} |" in docs, row.option


@pytest.mark.parametrize("row", [*S3_CASES, *EXTRA_CASES])
def test_an_s3_option_is_honoured_or_refused_with_one_line_naming_it(row, s3_server, tmp_path, caplog):
    url = f"s3://{s3_server.bucket}/opt-{re.sub(r'[^a-z0-9]+', '-', row.lower())[:40]}-{tmp_path.name}"
    case = {**S3_CASES, **EXTRA_CASES}[row]
    if row == "profile":
        credentials = tmp_path / "credentials"
        credentials.write_text(
            f"[spot-test]\naws_access_key_id = {s3_server.storage_options['key']}\n"
            f"aws_secret_access_key = {s3_server.storage_options['secret']}\n"
        )
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
            for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
                patch.delenv(name, raising=False)
            case(s3_server, url, tmp_path, caplog)
        return
    if case == "virtual":
        # Virtual-hosted requests need a DNS name per bucket (none on 127.0.0.1): the option as both
        # clients hold it, boto3's config and obstore's virtual_hosted_style_request.
        options = {**s3_server.storage_options, "config_kwargs": {"s3": {"addressing_style": "virtual"}}}
        store = CheckpointStore(url, storage_options=options, retry=FAST_RETRY)
        assert store.data_plane._boto()[1].meta.config.s3["addressing_style"] == "virtual"  # type: ignore[attr-defined]
        assert obstore_of(store).config["virtual_hosted_style_request"] == "true"
        return
    if row in ("anon=True", "config_kwargs signature_version=UNSIGNED"):
        # Anonymous requests need a bucket anyone may write (the suite's own is private).
        client, _bucket, _key = s3_object(s3_server, url)
        if "spot-public" not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
            client.create_bucket(Bucket="spot-public", ACL="public-read-write")
        url = url.replace(f"s3://{s3_server.bucket}/", "s3://spot-public/")
    case(s3_server, url, tmp_path, caplog)


# ------------------------------------------------------------------ az: one case per row
def az_round_trip(server: Any, tmp_path: Path, caplog: Any, options: dict[str, Any]) -> Any:
    from spot_callbacks.store.clients.azure import AzurePlane

    store = round_trip(f"az://{server.bucket}/opt-{tmp_path.name}", options, tmp_path, caplog)
    assert isinstance(store.data_plane, AzurePlane)
    return store.data_plane


def _az_key(server: Any, tmp_path: Path, caplog: Any) -> None:
    plane = az_round_trip(server, tmp_path, caplog, dict(server.storage_options))
    key = re.search(r"AccountKey=([^;]+)", server.connection_string).group(1)  # type: ignore[union-attr]
    assert plane._options["account_key"] == key and plane._options["account_name"] == "devstoreaccount1"


def _az_connection_string(server: Any, tmp_path: Path, caplog: Any) -> None:
    plane = az_round_trip(server, tmp_path, caplog, dict(server.storage_options))
    assert plane._options["endpoint"] == server.endpoint_url


def _az_sas(server: Any, tmp_path: Path, caplog: Any) -> None:
    from datetime import datetime, timedelta, timezone

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    key = re.search(r"AccountKey=([^;]+)", server.connection_string).group(1)  # type: ignore[union-attr]
    sas = generate_container_sas(
        "devstoreaccount1", server.bucket, account_key=key,
        permission=ContainerSasPermissions(read=True, write=True, delete=True, list=True, add=True, create=True),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
    )  # fmt: skip
    connection = f"BlobEndpoint={server.endpoint_url};SharedAccessSignature={sas}"
    plane = az_round_trip(server, tmp_path, caplog, {"connection_string": connection})
    assert "account_key" not in plane._options and plane._options["sas_key"] == sas


def _service(url: str, **extra: Any) -> Any:
    from types import SimpleNamespace

    client = SimpleNamespace(url=url, account_name="acct", credential=None)
    return SimpleNamespace(service_client=client, credential=None, sync_credential=None, **extra)


def _az_anon(server: Any, tmp_path: Path, caplog: Any) -> None:
    from spot_callbacks.store.clients.options import azure_account_options

    options = azure_account_options(_service("https://acct.blob.core.windows.net/", anon=True))
    assert options == {
        "account_name": "acct",
        "endpoint": "https://acct.blob.core.windows.net",
        "skip_signature": True,
    }


def _az_host(server: Any, tmp_path: Path, caplog: Any) -> None:
    from spot_callbacks.store.clients.options import azure_account_options

    options = azure_account_options(_service("https://blobs.example.net/?sv=1&sig=x"))
    assert options["endpoint"] == "https://blobs.example.net" and options["sas_key"] == "sv=1&sig=x"


def _az_timeouts(server: Any, tmp_path: Path, caplog: Any) -> None:
    options = {**server.storage_options, "read_timeout": 7, "connection_timeout": 3}
    plane = az_round_trip(server, tmp_path, caplog, options)
    client = plane._store(server.bucket)(16.0).client_options
    assert (client["read_timeout"], client["connect_timeout"]) == ("7s", "3s")


def az_refused(extra: dict[str, Any], named: str) -> Any:
    def case(server: Any, tmp_path: Path, caplog: Any) -> None:
        import adlfs

        from spot_callbacks.store.dataplane import announce, select_data_plane

        fs = adlfs.AzureBlobFileSystem(skip_instance_cache=True, **server.storage_options, **extra)
        plane = select_data_plane(fs)
        assert isinstance(plane, FsspecPlane) and named in (plane.reason or "")
        with caplog.at_level(logging.INFO, logger="spot_callbacks"):
            announce(f"az://{server.bucket}/refused-{tmp_path.name}", plane)
        lines = fallback_lines(caplog)
        assert len(lines) == 1 and "through fsspec (AzureBlobFileSystem)" in lines[0] and named in lines[0]

    return case


class _Credential:
    """An azure-identity-shaped credential (adlfs keeps it; obstore is never handed it)."""

    def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        raise AssertionError("never asked: the fast client refuses a credential before any request")


AZURE_CASES: dict[str, Any] = {
    "account_name, account_key": _az_key,
    "connection_string": _az_connection_string,
    "sas_token": _az_sas,
    "anon=True": _az_anon,
    "account_host": _az_host,
    "read_timeout, connection_timeout": _az_timeouts,
    "credential (an azure-identity credential)": az_refused({"credential": _Credential()}, "credential="),
    "location_mode='secondary'": az_refused({"location_mode": "secondary"}, "location_mode='secondary'"),
}


@pytest.mark.parametrize("row", list(AZURE_CASES))
def test_an_azure_option_is_honoured_or_refused_with_one_line_naming_it(
    row, azurite_server, tmp_path, caplog
):
    AZURE_CASES[row](azurite_server, tmp_path, caplog)
