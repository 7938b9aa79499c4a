"""Every storage option a user may set, and how each fast client takes it: honoured or refused, never dropped.

The table (:data:`S3_OPTIONS`, :data:`AZURE_OPTIONS`; docs/storage.md prints it) says, for each
s3fs / adlfs option, how the upload client and the pull client take it with the same meaning. Three
outcomes, no fourth:

- honoured by both fast clients;
- :data:`BOTO3_PULLS`: obstore cannot send it, so boto3's TransferManager pulls too (s3 only);
- :data:`FSSPEC_ONLY`: no fast client can, the store's bytes stay on fsspec.

Both refusals name the option in the store's one log line (``announce`` in store/dataplane.py). The
functions below read a filesystem's options once, for the planes in ``s3.py`` and ``azure.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from spot_callbacks.store.clients.base import UPLOAD_THREADS, Unsupported
from spot_callbacks.store.clients.obstores import DEFAULT_READ_TIMEOUT_S, OBSTORE_RETRIES, obstore_installed

BOTO3_PULLS = "boto3 pulls (obstore cannot send it)"
FSSPEC_ONLY = "fsspec only (no fast client can)"
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Option:
    """One row: an option as written in ``storage_options``, and how the upload and pull clients take it.

    Example:
        >>> row = next(row for row in S3_OPTIONS if row.option.startswith("requester_pays"))
        >>> row.upload, row.pull
        ('s3transfer RequestPayer', 'obstore request_payer')
    """

    option: str
    upload: str
    pull: str


S3_OPTIONS = (
    Option("key, secret, token", "boto3 client credentials", "obstore credential provider"),
    Option("anon=True", "botocore UNSIGNED", "obstore skip_signature"),
    Option("profile", "boto3 session profile", "obstore gets the credentials boto3 resolved"),
    Option("endpoint_url, use_ssl", "boto3 endpoint_url, use_ssl", "obstore endpoint, allow_http"),
    Option("client_kwargs region_name", "boto3 region_name", "obstore region (on AWS: the bucket's own)"),
    Option("client_kwargs verify=False", "boto3 verify=False", "obstore allow_invalid_certificates"),
    Option("client_kwargs verify='ca.pem' (a CA bundle)", "boto3 verify=", BOTO3_PULLS),
    Option(
        "config_kwargs s3.addressing_style",
        "botocore Config",
        "obstore virtual_hosted_style_request ('virtual'), path style otherwise",
    ),
    Option(
        "config_kwargs retries max_attempts / total_max_attempts",
        "botocore Config",
        "obstore max_retries (the same number of retries)",
    ),
    Option("config_kwargs retries mode='adaptive'", "botocore Config", BOTO3_PULLS),
    Option(
        "config_kwargs connect_timeout, read_timeout",
        "botocore Config",
        "obstore connect_timeout, read_timeout",
    ),
    Option(
        "config_kwargs signature_version 's3v4' or UNSIGNED",
        "botocore Config",
        "obstore SigV4 / skip_signature",
    ),
    Option("config_kwargs signature_version other (e.g. 's3')", "botocore Config", BOTO3_PULLS),
    Option("config_kwargs proxies, or another key obstore lacks", "botocore Config", BOTO3_PULLS),
    Option(
        "s3_additional_kwargs ServerSideEncryption, SSEKMSKeyId (SSE-S3, SSE-KMS)",
        "s3transfer ExtraArgs",
        "obstore (S3 decrypts on GET)",
    ),
    Option(
        "s3_additional_kwargs ACL, StorageClass, Tagging", "s3transfer ExtraArgs", "obstore (nothing to send)"
    ),
    Option(
        "s3_additional_kwargs SSECustomer* (SSE-C), ExpectedBucketOwner", "s3transfer ExtraArgs", BOTO3_PULLS
    ),
    Option("requester_pays=True", "s3transfer RequestPayer", "obstore request_payer"),
    Option("version_aware=True", "boto3", BOTO3_PULLS),
    Option("s3_additional_kwargs s3transfer's upload does not take", FSSPEC_ONLY, FSSPEC_ONLY),
    Option("session= (an aiobotocore session)", FSSPEC_ONLY, FSSPEC_ONLY),
    Option("client_kwargs or a keyword boto3 does not take", FSSPEC_ONLY, FSSPEC_ONLY),
)

AZURE_OPTIONS = (
    Option("account_name, account_key", "obstore account_name, account_key", "the same"),
    Option("connection_string", "obstore endpoint, account, key or SAS (from adlfs' client)", "the same"),
    Option("sas_token", "obstore sas_key", "the same"),
    Option("anon=True", "obstore skip_signature", "the same"),
    Option("account_host", "obstore endpoint", "the same"),
    Option("read_timeout, connection_timeout", "obstore read_timeout, connect_timeout", "the same"),
    Option("credential (an azure-identity credential)", FSSPEC_ONLY, FSSPEC_ONLY),
    Option("location_mode='secondary'", FSSPEC_ONLY, FSSPEC_ONLY),
)

# What boto3.session.Session(...).client("s3", ...) takes besides config: s3fs passes client_kwargs there.
_CLIENT_KWARGS = {
    "region_name", "api_version", "use_ssl", "verify", "endpoint_url", "aws_access_key_id",
    "aws_secret_access_key", "aws_session_token", "aws_account_id",
}  # fmt: skip
# What s3fs hands its AioSession (``**kwargs`` of S3FileSystem that are not its own).
_SESSION_KWARGS = {"profile"}
# s3_additional_kwargs a GET carries too, that obstore cannot send: boto3 pulls then.
_READ_ARGS = {"SSECustomerAlgorithm", "SSECustomerKey", "SSECustomerKeyMD5", "ExpectedBucketOwner"}
CREDENTIAL_KEYS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
# botocore Config keys obstore honours with the same meaning, or that only shape boto3's own client
# (a pool size, validation of boto3's parameters, its user agent, payload hashing the manifest's
# xxh3 replaces): any other key moves the pulls to boto3, named.
_CONFIG_OBSTORE_TAKES = {
    "connect_timeout", "read_timeout", "retries", "region_name", "signature_version", "s3",
    "max_pool_connections", "parameter_validation", "user_agent", "user_agent_extra",
    "user_agent_appid", "tcp_keepalive", "request_checksum_calculation", "response_checksum_validation",
}  # fmt: skip
_S3_CONFIG_OBSTORE_TAKES = {"addressing_style", "payload_signing_enabled"}
_SIGV4 = {"s3v4", "v4"}


def s3_client_arguments(fs: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """boto3's ``client("s3", ...)`` arguments (``init``, ``client_kwargs``, ``config``) from an s3fs
    filesystem, as s3fs' ``set_session`` builds them; :class:`Unsupported` names an option boto3 lacks."""
    if not getattr(fs, "_session_is_owned", True):
        raise Unsupported("storage_options session= (an aiobotocore session of its own) cannot drive boto3")
    unknown = sorted(set(getattr(fs, "kwargs", {})) - _SESSION_KWARGS)
    if unknown:
        raise Unsupported(f"storage_options {', '.join(unknown)} mean nothing to boto3")
    client_kwargs = dict(getattr(fs, "client_kwargs", {}) or {})
    unknown = sorted(set(client_kwargs) - _CLIENT_KWARGS)
    if unknown:
        raise Unsupported(f"client_kwargs {', '.join(unknown)} mean nothing to boto3")
    init = {
        "aws_access_key_id": fs.key,
        "aws_secret_access_key": fs.secret,
        "aws_session_token": fs.token,
        "endpoint_url": fs.endpoint_url,
    }
    init = {k: v for k, v in init.items() if v is not None and v != client_kwargs.get(k)}
    if "use_ssl" not in client_kwargs:
        init["use_ssl"] = fs.use_ssl
    config = dict(fs.config_kwargs or {})
    config.setdefault("connect_timeout", getattr(fs, "connect_timeout", CONNECT_TIMEOUT_S))
    config.setdefault("read_timeout", getattr(fs, "read_timeout", DEFAULT_READ_TIMEOUT_S))
    config.setdefault("max_pool_connections", UPLOAD_THREADS + 4)
    if fs.anon:
        from botocore import UNSIGNED

        init = {k: v for k, v in init.items() if k not in CREDENTIAL_KEYS}
        client_kwargs = {k: v for k, v in client_kwargs.items() if k not in CREDENTIAL_KEYS}
        config["signature_version"] = UNSIGNED
    from botocore.config import Config

    try:
        Config(**config)
    except TypeError as err:
        raise Unsupported(f"config_kwargs that botocore's Config refuses: {err}") from None
    return init, client_kwargs, config


def s3_upload_args(fs: Any) -> dict[str, Any]:
    """s3transfer's ``ExtraArgs`` for every upload (SSE, ACL, StorageClass, Tagging, requester pays)."""
    from s3transfer.manager import TransferManager

    args = dict(getattr(fs, "s3_additional_kwargs", {}) or {})
    if fs.requester_pays:
        args["RequestPayer"] = "requester"
    unknown = sorted(set(args) - set(TransferManager.ALLOWED_UPLOAD_ARGS))
    if unknown:
        raise Unsupported(f"s3_additional_kwargs {', '.join(unknown)} that s3transfer's upload does not take")
    return args


def s3_read_args(fs: Any) -> dict[str, Any]:
    """The arguments every GET carries (boto3's ``get_object`` names)."""
    extra = getattr(fs, "s3_additional_kwargs", {}) or {}
    args = {k: v for k, v in extra.items() if k in _READ_ARGS}
    if fs.requester_pays:
        args["RequestPayer"] = "requester"
    return args


def obstore_refusal(
    fs: Any, client_kwargs: dict[str, Any], config: dict[str, Any], read_args: dict[str, Any]
) -> str | None:
    """The option obstore cannot honour for this s3fs filesystem (boto3 then pulls), or ``None``.

    Example:
        >>> from types import SimpleNamespace
        >>> obstore_refusal(SimpleNamespace(), {}, {"retries": {"mode": "adaptive"}}, {})
        "config_kwargs retries mode='adaptive'"
    """
    if not obstore_installed():
        return "obstore is not installed (pip install 'spot-callbacks[s3]')"
    unsendable = sorted(set(read_args) - {"RequestPayer"})
    if unsendable:
        return f"{', '.join(unsendable)} on every GET"
    if isinstance(client_kwargs.get("verify"), str):
        return "client_kwargs verify= a CA bundle"
    unknown = sorted(key for key, value in config.items() if key not in _CONFIG_OBSTORE_TAKES and value)
    if unknown:
        return f"config_kwargs {', '.join(unknown)}"
    s3_config = config.get("s3") or {}
    unknown = sorted(key for key, value in s3_config.items() if key not in _S3_CONFIG_OBSTORE_TAKES and value)
    if unknown:
        return f"config_kwargs s3 {', '.join(unknown)}"
    retries = config.get("retries") or {}
    if retries.get("mode") == "adaptive":
        return "config_kwargs retries mode='adaptive'"
    signature = config.get("signature_version")
    if signature is not None and not isinstance(signature, str) and not _unsigned(signature):
        return f"config_kwargs signature_version={signature!r}"
    if isinstance(signature, str) and signature not in _SIGV4:
        return f"config_kwargs signature_version={signature!r} (obstore signs with SigV4 only)"
    if getattr(fs, "version_aware", False):
        return "version_aware=True"
    return None


def obstore_s3_config(config: dict[str, Any], read_args: dict[str, Any]) -> dict[str, Any]:
    """obstore's S3Store configuration keys for the options it honours (addressing style, signing,
    requester pays); endpoint, region and credentials are resolved through boto3 by the plane."""
    options: dict[str, Any] = {}
    if (config.get("s3") or {}).get("addressing_style") == "virtual":
        options["virtual_hosted_style_request"] = True
    if _unsigned(config.get("signature_version")):
        options["skip_signature"] = True
    if read_args.get("RequestPayer") == "requester":
        options["request_payer"] = True
    return options


def obstore_retries(config: dict[str, Any]) -> int:
    """obstore's ``max_retries`` for botocore's ``retries`` (``max_attempts`` counts retries,
    ``total_max_attempts`` the first try too); :data:`OBSTORE_RETRIES` where the user set none.

    Example:
        >>> obstore_retries({}), obstore_retries({"retries": {"max_attempts": 7}}), obstore_retries({"retries": {"total_max_attempts": 3}})
        (2, 7, 2)
    """
    retries = config.get("retries") or {}
    if "total_max_attempts" in retries:
        return max(0, int(retries["total_max_attempts"]) - 1)
    if "max_attempts" in retries:
        return max(0, int(retries["max_attempts"]))
    return OBSTORE_RETRIES


def _unsigned(signature: Any) -> bool:
    """Whether ``signature`` is botocore's ``UNSIGNED`` (anonymous requests)."""
    return type(signature).__name__ == "UNSIGNED" and type(signature).__module__ == "botocore"


def azure_account_options(fs: Any) -> dict[str, Any]:
    """obstore's Azure configuration from adlfs' own service client: endpoint, account, key or SAS;
    :class:`Unsupported` names an option obstore cannot honour."""
    if getattr(fs, "credential", None) is not None or getattr(fs, "sync_credential", None) is not None:
        raise Unsupported("storage_options credential= (an Azure identity credential)")
    if getattr(fs, "location_mode", "primary") != "primary":
        raise Unsupported(f"storage_options location_mode={fs.location_mode!r}")
    client = getattr(fs, "service_client", None)
    if client is None:
        raise Unsupported("adlfs has no service client to read the account from")
    parts = urlsplit(client.url)
    endpoint = f"{parts.scheme}://{parts.netloc}{parts.path}".rstrip("/")
    options: dict[str, Any] = {"account_name": client.account_name, "endpoint": endpoint}
    key = getattr(getattr(client, "credential", None), "account_key", None)
    sas = (
        getattr(fs, "sas_token", None) or _connection_string_field(fs, "SharedAccessSignature") or parts.query
    )
    if key:
        options["account_key"] = key
    elif sas:
        options["sas_key"] = sas.lstrip("?")
    elif getattr(fs, "anon", False):
        options["skip_signature"] = True
    else:
        raise Unsupported("no account key, SAS token or anonymous access that obstore can use")
    return options


def azure_timeouts(fs: Any) -> tuple[float, float]:
    """adlfs' ``connection_timeout`` and ``read_timeout`` where the user set them (adlfs keeps them in
    the keywords it hands azure-core), else :data:`CONNECT_TIMEOUT_S` and s3fs' read timeout."""
    given = getattr(fs, "_timeout_kwargs", None) or {}
    connect = given.get("connection_timeout") or getattr(fs, "connection_timeout", None) or CONNECT_TIMEOUT_S
    read = given.get("read_timeout") or getattr(fs, "read_timeout", None) or DEFAULT_READ_TIMEOUT_S
    return float(connect), float(read)


def _connection_string_field(fs: Any, name: str) -> str | None:
    for part in (getattr(fs, "connection_string", None) or "").split(";"):
        field, _, value = part.partition("=")
        if field.strip().lower() == name.lower():
            return value.strip()
    return None
