"""``s3://`` payload bytes: boto3's s3transfer TransferManager uploads, obstore's streamed GET pulls.

Both clients are built from the s3fs filesystem the store already has, the way s3fs builds its
own aiobotocore client (its key, secret, token, anon, endpoint_url, use_ssl, client_kwargs,
config_kwargs, profile, requester_pays, s3_additional_kwargs, and the environment and AWS config
files botocore reads): no second configuration. How each option reaches each client, or why it
cannot, is :mod:`~spot_callbacks.store.clients.options`: an option neither client can honour is an
:class:`~spot_callbacks.store.clients.base.Unsupported` naming it; one only obstore cannot honour
moves the pulls to boto3.

Measured on a local S3 server (BENCHMARKS.md): s3transfer's upload reads each part from the scratch
file as it sends it (no part buffers: tens of MB of RSS for any checkpoint) and costs a third of
obstore's CPU; obstore's one streamed GET per file pulls at the link's rate for the least CPU.
On a plain-http endpoint neither hashes the payload for the wire (no SHA-256 payload signing, no
CRC32): the manifest's xxh3, verified on every pull, is the integrity check there; on https the
clients keep the cloud's own checks. A file without a writer digest is hashed from the bytes
s3transfer reads for each part (:mod:`~spot_callbacks.store.clients.sent_digests`), not in a pass of its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, cast

from spot_callbacks.store.checksums import CHECKSUM_ALGORITHM, FileDigest
from spot_callbacks.store.clients.base import (
    UPLOAD_PART_BYTES,
    UPLOAD_THREADS,
    TransferBudget,
    Unsupported,
)
from spot_callbacks.store.clients.obstores import (
    ObstoreReader,
    StoreCache,
    WrongRegionError,
    client_options,
    retry_config,
)
from spot_callbacks.store.clients.options import (
    CREDENTIAL_KEYS,
    obstore_refusal,
    obstore_retries,
    obstore_s3_config,
    s3_client_arguments,
    s3_read_args,
    s3_upload_args,
)
from spot_callbacks.store.clients.streams import Deadline, digest_stream
from spot_callbacks.store.meter import Moved, ignore_moved
from spot_callbacks.store.transfer import digest_mapped

if TYPE_CHECKING:  # s3transfer is imported with the clients, so a store without boto3 is told so
    from spot_callbacks.store.clients.sent_digests import HashingOSUtils, SentParts

CREDENTIALS_TTL = timedelta(minutes=5)


def s3_plane(fs: Any, budget: TransferBudget, pull_with: str = "auto") -> S3Plane:
    """The S3 data plane for the s3fs filesystem ``fs``; :class:`Unsupported` names what it cannot honour.

    ``pull_with`` is ``"auto"`` (obstore where installed and able, else boto3), ``"boto3"`` or ``"obstore"``.
    """
    pull_with = {"obstore": "obstore", "boto3": "boto3"}.get(pull_with, "auto")
    import importlib.util

    if importlib.util.find_spec("boto3") is None:
        raise Unsupported("boto3 is not installed (pip install 'spot-callbacks[s3]')")
    return S3Plane(fs, budget, pull_with)


class S3Plane:
    """Payload files of one s3fs filesystem through boto3's TransferManager (up) and obstore (down).

    Clients are built at the first transfer and shared by every file: one pool of
    :data:`~spot_callbacks.store.clients.base.UPLOAD_THREADS` requests for all uploads in flight.

    Example:
        >>> import s3fs
        >>> fs = s3fs.S3FileSystem(key="k", secret="s", endpoint_url="http://127.0.0.1:9", skip_instance_cache=True)
        >>> plane = S3Plane(fs, TransferBudget(), "boto3")
        >>> plane.name, plane.serves(fs)
        ('boto3 s3transfer (upload and pull)', True)
    """

    def __init__(self, fs: Any, budget: TransferBudget, pull_with: str = "auto") -> None:
        self._fs = fs
        self._budget = budget
        self._init, self._client_kwargs, self._config = s3_client_arguments(fs)
        self._upload_args = s3_upload_args(fs)
        self._read_args = s3_read_args(fs)
        refusal = obstore_refusal(fs, self._client_kwargs, self._config, self._read_args)
        if pull_with == "obstore" and refusal:
            raise Unsupported(f"obstore cannot pull from this filesystem: {refusal}")
        self.pull_with = "obstore" if pull_with != "boto3" and not refusal else "boto3"
        self.pull_fallback_reason = refusal if pull_with == "auto" else None
        self.name = (
            "boto3 s3transfer (upload), obstore (pull)"
            if self.pull_with == "obstore"
            else "boto3 s3transfer (upload and pull)"
        )
        self._lock = threading.Lock()
        self._session: Any = None
        self._client: Any = None
        self._manager: Any = None
        self._osutil: HashingOSUtils | None = None
        self._obstores: dict[str, StoreCache] = {}
        self._reader = ObstoreReader(budget, float(self._config["read_timeout"]))

    def serves(self, fs: Any) -> bool:
        return fs is self._fs

    def warm(self, remote_path: str) -> None:
        bucket, _key = self._split(remote_path)
        self._transfers()
        if self.pull_with == "obstore":
            self._obstore(bucket)(self._reader_deadline())

    # ------------------------------------------------------------------ transfers
    hashes_as_it_sends = True

    def upload(
        self, local_path: str, remote_path: str, moved: Moved = ignore_moved, *, digest: bool = False
    ) -> FileDigest | None:
        bucket, key = self._split(remote_path)
        manager = self._transfers()
        watching = (
            self._osutil.watching(local_path, os.path.getsize(local_path))
            if digest and self._osutil is not None
            else nullcontext(None)
        )
        sent: SentParts | None
        with _boto_errors(f"s3://{bucket}/{key}"), watching as sent:
            manager.upload(
                local_path, bucket, key, extra_args=dict(self._upload_args), subscribers=_told(moved)
            ).result()
        return sent.digest() if sent is not None else None

    def download(
        self,
        remote_path: str,
        local_path: str,
        timeout_s: float | None,
        expected_size: int | None = None,
        moved: Moved = ignore_moved,
        checksum_kind: str = CHECKSUM_ALGORITHM,
    ) -> FileDigest:
        bucket, key = self._split(remote_path)
        if self.pull_with == "obstore":
            with self._region_named(bucket):
                return self._reader.download(
                    self._obstore(bucket), key, f"s3://{bucket}/{key}", local_path, timeout_s, expected_size,
                    moved, checksum_kind,
                )  # fmt: skip
        with _boto_errors(f"s3://{bucket}/{key}"):
            # s3transfer writes ranged GETs out of order into a temporary it renames: hash after.
            self._transfers().download(
                bucket, key, local_path, extra_args=dict(self._read_args), subscribers=_told(moved)
            ).result()
        return digest_mapped(local_path, checksum_kind)

    def digest(
        self,
        remote_path: str,
        timeout_s: float | None,
        expected_size: int | None = None,
        moved: Moved = ignore_moved,
        checksum_kind: str = CHECKSUM_ALGORITHM,
    ) -> FileDigest:
        bucket, key = self._split(remote_path)
        url = f"s3://{bucket}/{key}"
        if self.pull_with == "obstore":
            with self._region_named(bucket):
                return self._reader.digest(
                    self._obstore(bucket), key, url, timeout_s, expected_size, moved, checksum_kind
                )
        with _boto_errors(url):
            body = self._boto()[1].get_object(Bucket=bucket, Key=key, **self._read_args)["Body"]
            with body:
                chunks = body.iter_chunks(self._budget.stream_chunk_bytes())
                return digest_stream(chunks, Deadline(timeout_s), f"read {url}", moved, checksum_kind)

    # ------------------------------------------------------------------ clients
    def _split(self, remote_path: str) -> tuple[str, str]:
        bucket, key, _version = self._fs.split_path(remote_path)
        return bucket, key

    def _boto(self) -> tuple[Any, Any]:
        with self._lock:
            if self._client is None:
                self._session, self._client = _boto3_client(
                    self._fs, self._init, self._client_kwargs, self._config
                )
            return self._session, self._client

    def _transfers(self) -> Any:
        from s3transfer.manager import TransferConfig, TransferManager

        from spot_callbacks.store.clients.sent_digests import HashingOSUtils

        _session, client = self._boto()
        with self._lock:
            if self._manager is None:
                config = TransferConfig(
                    multipart_threshold=UPLOAD_PART_BYTES,
                    multipart_chunksize=UPLOAD_PART_BYTES,
                    max_request_concurrency=UPLOAD_THREADS,
                )
                self._osutil = HashingOSUtils()
                self._manager = TransferManager(client, config, osutil=self._osutil)
            return self._manager

    @contextmanager
    def _region_named(self, bucket: str) -> Iterator[None]:
        """A redirect obstore got without the region (it reads no headers of an error) is asked of
        boto3 once: the user's line names the bucket's region."""
        try:
            yield
        except WrongRegionError as err:
            if err.region is not None:
                raise
            region = _told_region(self._boto()[1], bucket)
            raise WrongRegionError(err.url, region) from err

    def _reader_deadline(self) -> float:
        from spot_callbacks.store.clients.obstores import request_deadline_s

        return request_deadline_s(0, self._reader.read_timeout_s)

    def _obstore(self, bucket: str) -> StoreCache:
        """obstore's stores for ``bucket``, one per whole-request deadline (endpoint, region and
        credentials resolved once)."""
        session, client = self._boto()
        with self._lock:
            stores = self._obstores.get(bucket)
        if stores is None:
            build = _obstore_for(
                self._fs, session, client, bucket, self._init, self._client_kwargs, self._config,
                self._read_args,
            )  # fmt: skip
            with self._lock:
                stores = self._obstores.setdefault(bucket, StoreCache(build))
        return stores


def _told(moved: Moved) -> list[Any]:
    """s3transfer's subscribers telling ``moved`` the bytes of each read (none when nobody watches)."""
    if moved is ignore_moved:
        return []
    from s3transfer.subscribers import BaseSubscriber

    class _Progress(BaseSubscriber):  # s3transfer is untyped
        def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
            moved(bytes_transferred)

    return [_Progress()]


def _boto3_client(
    fs: Any, init: dict[str, Any], client_kwargs: dict[str, Any], config: dict[str, Any]
) -> tuple[Any, Any]:
    import boto3
    import botocore.session
    from botocore.config import Config

    core = botocore.session.Session(**getattr(fs, "kwargs", {}))
    loader = getattr(getattr(fs, "session", None), "get_component", None)
    if loader is not None:
        # s3fs' session has parsed S3's service model already (~100 ms of JSON): share its loader.
        core.register_component("data_loader", loader("data_loader"))
    session = boto3.session.Session(botocore_session=core)
    endpoint = client_kwargs.get("endpoint_url") or init.get("endpoint_url")
    plain_http = endpoint.startswith("http://") if endpoint else not init.get("use_ssl", True)
    client = None
    if not plain_http:  # known https, or an endpoint only botocore resolves (the environment, a profile)
        client = session.client("s3", config=Config(**config), **init, **client_kwargs)
        plain_http = client.meta.endpoint_url.startswith("http://")
    if plain_http:
        # Plain http: botocore would SHA-256 every payload for the signature and CRC32 it too; the
        # manifest's xxh3 is checked on every pull instead. The user's own settings win. Responses
        # keep their validation: objects uploaded so carry no checksum to check, and with it off
        # s3transfer skips its HEAD for a first ranged GET past the end of small objects, which
        # some S3-compatible servers refuse (nanio: InvalidArgument).
        plain = dict(config)
        plain["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
        if "request_checksum_calculation" in Config.OPTION_DEFAULTS:  # botocore >= 1.36 computes CRC32s
            plain.setdefault("request_checksum_calculation", "when_required")
        client = session.client("s3", config=Config(**plain), **init, **client_kwargs)
    return session, client


def _obstore_for(
    fs: Any,
    session: Any,
    client: Any,
    bucket: str,
    init: dict[str, Any],
    client_kwargs: dict[str, Any],
    config: dict[str, Any],
    read_args: dict[str, Any],
) -> Any:
    """A builder of obstore's S3Store for ``bucket`` (its argument: a whole request's deadline in
    seconds), with the endpoint, region and credentials boto3 resolved, resolved once."""
    from obstore.store import S3Store

    endpoint = client.meta.endpoint_url
    on_aws = _is_aws_endpoint(endpoint)
    options: dict[str, Any] = {
        "region": _bucket_region(client, bucket) if on_aws else client.meta.region_name
    }
    if not on_aws:
        options["endpoint"] = endpoint
    options.update(obstore_s3_config(config, read_args))
    http = endpoint.startswith("http://")
    if http:
        options["unsigned_payload"] = True
    provider = None
    if fs.anon:
        options["skip_signature"] = True
    else:
        provider = _credentials(session, {**init, **client_kwargs})

    def build(total_timeout_s: float) -> Any:
        # obstore types these as TypedDicts and a provider protocol; ours are plain dicts built from s3fs's options.
        return cast(Any, S3Store)(
            bucket,
            config=options,
            client_options=client_options(
                http=http,
                connect_timeout_s=float(config["connect_timeout"]),
                read_timeout_s=float(config["read_timeout"]),
                verify=client_kwargs.get("verify", True) is not False,
                total_timeout_s=total_timeout_s,
            ),
            retry_config=retry_config(total_timeout_s, obstore_retries(config)),
            credential_provider=provider,
        )

    return build


def _is_aws_endpoint(endpoint: str) -> bool:
    from urllib.parse import urlsplit

    host = urlsplit(endpoint).hostname or ""
    return host.endswith(".amazonaws.com") or host == "amazonaws.com"


def _bucket_region(client: Any, bucket: str) -> str:
    """The bucket's own region (obstore does not follow AWS's region redirects; boto3 does)."""
    return _told_region(client, bucket) or client.meta.region_name or "us-east-1"


def _told_region(client: Any, bucket: str) -> str | None:
    """The region a HEAD of ``bucket`` answers with (``x-amz-bucket-region``), if any."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        answer = client.head_bucket(Bucket=bucket)
    except ClientError as err:
        answer = err.response
    except BotoCoreError:
        return None
    region = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
    return str(region) if region else None


class _Credentials:
    """obstore's credential callback: the keys s3fs was given, else boto3's chain (env, profile, IMDS...),
    refreshed by boto3 as it refreshes its own. The environment is never read past what boto3 read."""

    def __init__(self, session: Any, given: dict[str, Any]) -> None:
        self._given = given
        self._resolved = None if given else session.get_credentials()

    def __call__(self) -> dict[str, Any]:
        if self._given:
            return {
                "access_key_id": self._given["aws_access_key_id"],
                "secret_access_key": self._given["aws_secret_access_key"],
                "token": self._given.get("aws_session_token"),
                "expires_at": None,
            }
        if self._resolved is None:
            from botocore.exceptions import NoCredentialsError

            raise NoCredentialsError()
        frozen = self._resolved.get_frozen_credentials()
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            # Asked again after this: boto3 refreshes temporary credentials (IMDS, SSO, a role) itself.
            "expires_at": datetime.now(timezone.utc) + CREDENTIALS_TTL,
        }


def _credentials(session: Any, arguments: dict[str, Any]) -> _Credentials:
    given = {k: arguments[k] for k in CREDENTIAL_KEYS if arguments.get(k)}
    if given and not ("aws_access_key_id" in given and "aws_secret_access_key" in given):
        given = {}  # a token alone: boto3 completes the rest from its chain
    return _Credentials(session, given)


class _boto_errors:
    """botocore's ClientError told as s3fs tells it (the same builtin classes for the same answers),
    but a redirect to the bucket's region as :class:`WrongRegionError` naming it (s3fs' OSError
    would be retried, and says only "Moved Permanently")."""

    def __init__(self, url: str) -> None:
        self._url = url

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        if error is None or type(error).__name__ != "ClientError":
            return
        response = getattr(error, "response", None) or {}
        metadata = response.get("ResponseMetadata", {})
        if (
            metadata.get("HTTPStatusCode") == 301
            or response.get("Error", {}).get("Code") == "PermanentRedirect"
        ):
            raise WrongRegionError(
                self._url, metadata.get("HTTPHeaders", {}).get("x-amz-bucket-region")
            ) from error
        from s3fs.errors import translate_boto_error

        raise translate_boto_error(error) from error
