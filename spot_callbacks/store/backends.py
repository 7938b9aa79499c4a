"""The backend table: one row per protocol family, the one place a protocol name is spelled.

Like fsspec's ``known_implementations`` or torchsnapshot's storage plugins, each :class:`Backend`
row says everything the library knows of a family of fsspec protocols (``s3``/``s3a``,
``az``/``abfs``/``abfss``, ...): the package that implements it and the extra that installs it,
the options it starts with, the fast client that moves its payload bytes, how to ask its
bucket's region, and what the store can promise on it. Every module asks the table
(:func:`backend_of`, :func:`backend_of_fs`, :func:`family_of`, :func:`in_family`) instead of
naming protocols; a new backend is a row here plus its client module.

Factories are referenced by dotted name (``"package.module:function"``) and imported when first
used, so this module imports nothing of the store's and the layers stay as ``.importlinter`` draws them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import spot_callbacks.settings as settings


def _s3_defaults(options: dict[str, Any]) -> None:
    # botocore waits 60 s to connect and retries 5 times over s3fs' own retries (155 s for a
    # refused endpoint): a store that cannot be reached would be slow to say so.
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", settings.CONNECT_TIMEOUT_S.value())
    config.setdefault("read_timeout", S3_READ_TIMEOUT_S)
    config.setdefault("retries", {"max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"})
    options["config_kwargs"] = config


def _gcs_defaults(options: dict[str, Any]) -> None:
    # gcsfs asks a gRPC control API for every bucket's layout with a 60 s retry budget, uncached
    # when it fails.
    options.setdefault("retry_timeout", GCS_CONTROL_RETRY_S)


S3_READ_TIMEOUT_S = 60
S3_MAX_ATTEMPTS = 3  # botocore's, each inside one of the store's own retried attempts
GCS_CONTROL_RETRY_S = 5.0  # gcsfs' bucket-layout probe (gRPC); a plain bucket answers in well under 1 s
# s3fs uploads a file's parts max_concurrency at a time, each held twice in RAM (the part and
# botocore's copy): 10 (its default) x 50 MiB x 2 is ~1 GB per file in flight, beside the staged
# checkpoint itself. 4 keeps it near 420 MB; storage_options={"max_concurrency": N} overrides.
S3_UPLOAD_CONCURRENCY = 4


def _s3_upload_defaults(options: dict[str, Any]) -> None:
    options.setdefault("max_concurrency", S3_UPLOAD_CONCURRENCY)


def _s3_connect(fs: Any) -> None:
    fs.connect()  # s3fs' blocking set_session(): aiobotocore's client, built once per filesystem


def load(dotted: str) -> Any:
    """The object a dotted name (``"package.module:attribute"``) names, its module imported now.

    Example:
        >>> load("posixpath:join")("a", "b")
        'a/b'
    """
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


def _s3_plane(fs: Any, budget: Any, choice: str) -> Any:
    return load("spot_callbacks.store.clients.s3:s3_plane")(fs, budget, choice)


def _azure_plane(fs: Any, budget: Any, choice: str) -> Any:
    return load("spot_callbacks.store.clients.azure:azure_plane")(fs, budget)


@dataclass(frozen=True)
class Backend:
    """One row of the backend table: a family of fsspec protocols and what the library knows of it.

    Args:
        family: the family's name (its first protocol).
        protocols: every protocol fsspec answers to for it (``fs.protocol``).
        package: the package that implements it (``None``: fsspec itself, or not one we install).
        extra: the spot-callbacks extra that installs ``package`` (``pip install 'spot-callbacks[<extra>]'``).
        local: the local disk, where a write is not atomic and a rename is.
        in_fsspec: fsspec itself implements it (always installed).
        bucketed: the first path segment is a bucket (or container), which must exist.
        container: what a user calls that first segment (the root folder on a local disk).
        starts_with: sets the options it starts with where the user set none (short timeouts).
        opens_with: sets what :func:`~spot_callbacks.store.layout.open_filesystem` adds for a run's store.
        passed_on_options: ``storage_options`` keys its filesystem hands on to the client it builds.
        connects: builds its filesystem's client ahead of the first request, sending nothing to the store
            (``store/warmup.py``); ``None``: nothing to build, or it is built with the filesystem.
        strict_options: an unknown ``storage_options`` key fails only at the first request there.
        data_plane: ``(fs, budget, choice) -> DataPlane``, the fast client of its payload bytes.
        data_plane_choices: the ``$SPOT_DATA_PLANE`` values besides ``auto`` its fast client honours.
        no_data_plane: why fsspec moves its payload bytes, where a user would expect a faster client.
        bucket_region: dotted name of ``(fs, bucket) -> Placement | None`` (``accounting/region.py``).
        no_credentials_fix: how to give it credentials; ``credentials_fix``: how to check them.
        conditional_writes: ``"etag"`` where a PUT can be made conditional on an object's absence
            (If-None-Match: *) or its ETag (If-Match), as the run lock uses them; else ``None``.
        sorted_listing: its listings come in key order. Declared, not relied on: the store sorts
            what it lists (``store/commit.py``'s protocol assumes any order).
        bulk_delete: its filesystem deletes many objects in one request. Declared, not relied on:
            a step folder is deleted, and the delete confirmed, either way.

    Example:
        >>> backend_of("s3a").family, backend_of("s3a").extra, backend_of("gcs").conditional_writes
        ('s3', 's3', None)
        >>> backend_of("hdfs").family, backend_of("hdfs").data_plane is None  # not in the table: fsspec's
        ('hdfs', True)
    """

    family: str
    protocols: tuple[str, ...]
    package: str | None = None
    extra: str | None = None
    local: bool = False
    in_fsspec: bool = False
    bucketed: bool = False
    container: str = "bucket"
    starts_with: Callable[[dict[str, Any]], None] | None = None
    opens_with: Callable[[dict[str, Any]], None] | None = None
    passed_on_options: frozenset[str] = field(default_factory=frozenset)
    connects: Callable[[Any], None] | None = None
    strict_options: bool = False
    data_plane: Callable[[Any, Any, str], Any] | None = None
    data_plane_choices: tuple[str, ...] = ()
    no_data_plane: str | None = None
    bucket_region: str | None = None
    no_credentials_fix: str = "pass the credentials in storage_options"
    credentials_fix: str = "check the credentials in storage_options"
    conditional_writes: str | None = None
    sorted_listing: bool = False
    bulk_delete: bool = False

    @property
    def url_prefix(self) -> str:
        """``"s3://"``: how a user writes a URL of this backend."""
        return f"{self.protocols[0]}://"

    @property
    def install(self) -> str | None:
        """The command that installs this backend, or ``None`` (nothing to install)."""
        return f"pip install 'spot-callbacks[{self.extra}]'" if self.extra else None


# The table. GCS (ifGenerationMatch) and Azure (ETags) have conditional writes too, but gcsfs and
# adlfs do not pass them through their writes, so they are not promised here yet.
BACKENDS: tuple[Backend, ...] = (
    Backend(
        "s3",
        ("s3", "s3a"),
        package="s3fs",
        extra="s3",
        bucketed=True,
        starts_with=_s3_defaults,
        opens_with=_s3_upload_defaults,
        passed_on_options=frozenset({"session_vars", "event_hooks", "include_builtin_handlers", "profile"}),
        connects=_s3_connect,
        strict_options=True,  # s3fs hands every other key to AioSession, which raises at the first request
        data_plane=_s3_plane,
        data_plane_choices=("boto3", "obstore"),
        bucket_region="spot_callbacks.accounting.region:s3_bucket_placement",
        no_credentials_fix="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or "
        "storage_options key/secret (anon=True for a public bucket)",
        credentials_fix="check the access key and secret (storage_options key/secret, or "
        "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)",
        conditional_writes="etag",
        sorted_listing=True,
        bulk_delete=True,
    ),
    Backend(
        "gs",
        ("gs", "gcs"),
        package="gcsfs",
        extra="gcs",
        bucketed=True,
        starts_with=_gcs_defaults,
        passed_on_options=frozenset({"retry_timeout"}),
        # obstore's GCS client sends object names percent-encoded and asks the metadata server for
        # a token even unsigned: it cannot be shown to work against fake-gcs-server, so gcsfs stays.
        no_data_plane="no faster client is verified for gs:// yet",
        bucket_region="spot_callbacks.accounting.region:gcs_bucket_placement",
        no_credentials_fix="set GOOGLE_APPLICATION_CREDENTIALS, or storage_options token "
        "(token='anon' for a public bucket)",
        credentials_fix="check the token (storage_options token, or GOOGLE_APPLICATION_CREDENTIALS) and the project",
        sorted_listing=True,
        bulk_delete=True,
    ),
    Backend(
        "az",
        ("az", "abfs", "abfss"),
        package="adlfs",
        extra="azure",
        bucketed=True,
        container="container",
        data_plane=_azure_plane,
        data_plane_choices=("obstore",),
        no_credentials_fix="set AZURE_STORAGE_CONNECTION_STRING, or storage_options connection_string, or "
        "account_name with account_key, sas_token or credential (anon=True for a public container)",
        credentials_fix="check the account key, SAS token or connection string (storage_options, or AZURE_STORAGE_*)",
        sorted_listing=True,  # no bulk delete: adlfs deletes blob by blob
        # no bucket_region: Azure's data plane does not tell a storage account's location
    ),
    Backend("adl", ("adl",), bucketed=True),
    Backend("file", ("file", "local"), local=True, in_fsspec=True, container="folder"),
    Backend("memory", ("memory",), in_fsspec=True),
)
_BY_PROTOCOL = {protocol: backend for backend in BACKENDS for protocol in backend.protocols}
# The families fsspec itself implements, always installed.
BUILT_IN = tuple(backend.protocols[0] for backend in BACKENDS if backend.in_fsspec)
LOCAL_PROTOCOLS = tuple(p for backend in BACKENDS if backend.local for p in backend.protocols)
BARE_PATH_PROTOCOL = LOCAL_PROTOCOLS[0]  # what fsspec reads a path without "<protocol>://" as
# How a user writes a run folder's URL: the families we install, then fsspec's own (the CLI's help).
URL_PREFIXES = tuple(backend.url_prefix for backend in BACKENDS if backend.extra or backend.in_fsspec)
# A run folder's URL in each family we install, for the examples in error messages.
EXAMPLE_URLS = tuple(f"{backend.url_prefix}{backend.container}/run" for backend in BACKENDS if backend.extra)
# protocol -> (package, extra), for the families a spot-callbacks extra installs
CLOUD_BACKENDS: dict[str, tuple[str, str]] = {
    protocol: (backend.package, backend.extra)
    for backend in BACKENDS
    if backend.package and backend.extra
    for protocol in backend.protocols
}


def backend_of(protocol: str) -> Backend:
    """The row of ``protocol``; a protocol the table does not know gets an empty row of its own
    (fsspec's backend, nothing promised, no fast client).

    Example:
        >>> backend_of("abfss").family, backend_of("file").local, backend_of("memory").bucketed
        ('az', True, False)
    """
    return _BY_PROTOCOL.get(protocol) or Backend(protocol, (protocol,))


def fs_protocols(fs: Any) -> tuple[str, ...]:
    """The protocols an fsspec filesystem answers to (``fs.protocol`` is a str or a tuple)."""
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def backend_of_fs(fs: Any) -> Backend:
    """The row of an fsspec filesystem: the first of its protocols the table knows.

    Example:
        >>> import fsspec
        >>> backend_of_fs(fsspec.filesystem("file")).family
        'file'
    """
    protocols = fs_protocols(fs)
    return next((_BY_PROTOCOL[p] for p in protocols if p in _BY_PROTOCOL), backend_of(protocols[0]))


def family_of(protocol: str) -> str:
    """The family a protocol belongs to (``"s3a"`` -> ``"s3"``); an unknown protocol is its own.

    Example:
        >>> family_of("abfss"), family_of("gcs"), family_of("hdfs")
        ('az', 'gs', 'hdfs')
    """
    return backend_of(protocol).family


def in_family(protocols: str | tuple[str, ...] | list[str] | set[str], *families: str) -> bool:
    """True when any of ``protocols`` (an fsspec ``fs.protocol``) belongs to one of ``families``.

    Example:
        >>> in_family(("s3", "s3a"), "s3"), in_family("gcs", "s3", "az")
        (True, False)
    """
    names = (protocols,) if isinstance(protocols, str) else tuple(protocols)
    return any(family_of(name) in families for name in names)


def with_backend_defaults(protocol: str | None, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` plus the start-up-friendly timeouts of its backend, where none are set.

    A cloud SDK's own defaults make a store that cannot be reached slow to say so; the row's
    ``starts_with`` sets shorter ones, only where the user set none.

    Example:
        >>> with_backend_defaults("s3", {"config_kwargs": {"connect_timeout": 3}})["config_kwargs"]
        {'connect_timeout': 3, 'read_timeout': 60, 'retries': {'max_attempts': 3, 'mode': 'standard'}}
        >>> with_backend_defaults("gs", {})
        {'retry_timeout': 5.0}
    """
    options = dict(storage_options or {})
    starts_with = backend_of(protocol).starts_with if protocol else None
    if starts_with is not None:
        starts_with(options)
    return options


def conditional_writes(protocols: str | tuple[str, ...] | list[str]) -> str | None:
    """The conditional writes the backend of ``protocols`` (an fsspec ``fs.protocol``) promises, or None.

    Example:
        >>> conditional_writes("s3"), conditional_writes("gs"), conditional_writes(("file", "local"))
        ('etag', None, None)
    """
    names = (protocols,) if isinstance(protocols, str) else tuple(protocols)
    return next((w for name in names if (w := backend_of(name).conditional_writes)), None)
