"""Which fsspec backend a ``dirpath`` needs, the extra that installs it, and the timeouts it starts with.

A cloud SDK's own defaults make a store that cannot be reached slow to say so: botocore waits
60 s to connect and retries 5 times over s3fs' own retries (155 s for a refused endpoint), and
gcsfs asks a gRPC control API for every bucket's layout with a 60 s retry budget, uncached
when it fails. :func:`with_backend_defaults` sets shorter ones, only where the user set none.
"""

from __future__ import annotations

import difflib
import importlib.util
from typing import Any

import fsspec

from spot_callbacks.errors import UnknownStoreError

# protocol -> (the package that implements it, the spot-callbacks extra that installs it)
CLOUD_BACKENDS: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
}
S3_CONNECT_TIMEOUT_S = 10
S3_READ_TIMEOUT_S = 60
S3_MAX_ATTEMPTS = 3  # botocore's, each inside one of the store's own retried attempts
GCS_CONTROL_RETRY_S = 5.0  # gcsfs' bucket-layout probe (gRPC); a plain bucket answers in well under 1 s


def resolve_filesystem(dirpath: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """``fsspec.core.url_to_fs(dirpath, ...)`` with :func:`with_backend_defaults`, or an
    :class:`UnknownStoreError` naming ``dirpath``, the protocol, the installed backends and the extra to install.

    Example:
        >>> resolve_filesystem("memory://doc-backends/run", None)[1]
        '/doc-backends/run'
        >>> resolve_filesystem("s4://bucket/run", None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.UnknownStoreError: dirpath='s4://bucket/run' cannot hold checkpoints: ...
    """
    protocol, _ = fsspec.core.split_protocol(dirpath)
    if protocol is not None:
        check_protocol(dirpath, protocol)
    return fsspec.core.url_to_fs(dirpath, **with_backend_defaults(protocol, storage_options))


def check_protocol(dirpath: str, protocol: str) -> None:
    """Raise :class:`UnknownStoreError` unless fsspec knows ``protocol`` and its package imports."""
    if protocol not in fsspec.available_protocols():
        close = difflib.get_close_matches(protocol, [*CLOUD_BACKENDS, "file", "memory"], n=1, cutoff=0.5)
        suggestion = f"did you mean {close[0]}://? " if close else ""
        raise UnknownStoreError(
            dirpath,
            f"fsspec knows no protocol {protocol!r} (installed backends: {', '.join(installed_protocols())})",
            f"{suggestion}use s3://, gs://, az:// or a local path; "
            "pip install 'spot-callbacks[s3]' (or [gcs], [azure]) adds a cloud backend",
        )
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as err:
        package, extra = CLOUD_BACKENDS.get(protocol, (None, None))
        fix = (
            f"pip install 'spot-callbacks[{extra}]'" if extra else f"install the package fsspec names: {err}"
        )
        raise UnknownStoreError(
            dirpath,
            f"protocol {protocol!r} needs the package {package or 'behind it'}, which is not installed "
            f"(installed backends: {', '.join(installed_protocols())})",
            fix,
            err,
        ) from None


def installed_protocols() -> list[str]:
    """The local protocols and every cloud protocol whose package is installed.

    Example:
        >>> installed_protocols()[:2]
        ['file', 'memory']
    """
    clouds = [p for p, (package, _) in CLOUD_BACKENDS.items() if importlib.util.find_spec(package)]
    return ["file", "memory", *clouds]


def with_backend_defaults(protocol: str | None, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` plus the start-up-friendly timeouts of its backend, where none are set.

    Example:
        >>> with_backend_defaults("s3", {"config_kwargs": {"connect_timeout": 3}})["config_kwargs"]
        {'connect_timeout': 3, 'read_timeout': 60, 'retries': {'max_attempts': 3, 'mode': 'standard'}}
        >>> with_backend_defaults("gs", {})
        {'retry_timeout': 5.0}
    """
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", S3_CONNECT_TIMEOUT_S)
        config.setdefault("read_timeout", S3_READ_TIMEOUT_S)
        config.setdefault("retries", {"max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"})
        options["config_kwargs"] = config
    elif protocol in ("gs", "gcs"):
        options.setdefault("retry_timeout", GCS_CONTROL_RETRY_S)
    return options
