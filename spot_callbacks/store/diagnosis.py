"""What a storage failure means for a user: permanent or transient, the cause in one line, and the fix.

Cloud SDKs say the same thing many ways (botocore's error codes, azure-core's exception types,
gcsfs' ``HttpError``, aiohttp's connector errors, the OS's errno), often across several
chained exceptions and many lines of XML. :func:`diagnose` reads the whole chain by class name,
HTTP status, errno and error code, so no cloud SDK has to be imported here.
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass

from spot_callbacks.errors import AttemptTimeoutError
from spot_callbacks.store.backends import backend_of
from spot_callbacks.store.retry import http_status, is_transient

_AUTH_NAMES = {
    "ClientAuthenticationError",  # azure-core
    "NoCredentialsError",  # botocore
    "PartialCredentialsError",  # botocore
    "DefaultCredentialsError",  # google-auth
    "RefreshError",  # google-auth
}
_AUTH_CODES = re.compile(
    r"InvalidAccessKeyId|SignatureDoesNotMatch|AuthenticationFailed|InvalidAuthenticationInfo|"
    r"ExpiredToken|InvalidToken|InvalidClientTokenId|invalid_grant|Unauthorized|failed to authenticate"
)
_MISSING_CODES = re.compile(
    r"NoSuchBucket|ContainerNotFound|specified container does not exist|bucket does not exist"
)
_UNKNOWN_HOST = re.compile(
    r"Name or service not known|nodename nor servname|Temporary failure in name resolution|"
    r"getaddrinfo failed|No address associated with hostname|Could not resolve host"
)
_REFUSED = re.compile(r"Connection refused|Connect call failed|Could not connect to the endpoint URL")
# No credentials at all (not wrong ones): botocore's "Unable to locate credentials", adlfs' ValueError.
_NO_CREDENTIALS = re.compile(
    r"Unable to locate credentials|Must provide either a connection_string or account_name with credentials"
)
_UNEXPECTED_OPTION = re.compile(r"unexpected keyword argument '([^']+)'")


@dataclass(frozen=True)
class Diagnosis:
    """A storage failure told for a user: ``permanent`` (a retry cannot help), ``cause``, ``fix``.

    ``unreachable`` marks a transient failure where nothing answered at all (a refused connection).

    Example:
        >>> diagnose(PermissionError(13, "Permission denied"), "file", "/data/run").permanent
        True
    """

    permanent: bool
    cause: str
    fix: str
    unreachable: bool = False
    specific: bool = True  # False: no known cause, the error's own first line stands in for one


def diagnose(error: BaseException, protocol: str, bucket: str, *, reading: bool = False) -> Diagnosis:
    """The :class:`Diagnosis` of ``error`` from a store of ``protocol`` whose bucket (or root folder) is ``bucket``.

    ``reading``: the failure was of a read-only use (the ``spot-callbacks`` command), not training's.

    Example:
        >>> diagnose(ConnectionRefusedError(111, "Connection refused"), "s3", "b").unreachable
        True
        >>> diagnose(FileNotFoundError("NoSuchBucket"), "s3", "b").cause
        "the bucket 'b' does not exist"
    """
    chain = list(causes(error))
    text = " ".join(f"{type(err).__name__}: {err}" for err in chain)
    found = _diagnose_reachability(chain, text) or _diagnose_refusal(chain, text, protocol, bucket, reading)
    if found is not None:
        return found
    if is_transient(error):
        status = http_status(error)
        answer = f" (HTTP {status})" if status else ""
        return Diagnosis(
            False,
            f"the store keeps failing{answer}: {one_line(error)}",
            "check that the store is up and reachable; retry later",
            specific=bool(status),
        )
    return Diagnosis(True, one_line(error), "check dirpath and storage_options", specific=False)


def _diagnose_reachability(chain: list[BaseException], text: str) -> Diagnosis | None:
    if any(isinstance(err, socket.gaierror) for err in chain) or _UNKNOWN_HOST.search(text):
        return Diagnosis(
            True,
            f"the store's host name does not resolve ({one_line(chain[-1])})",
            "check endpoint_url / the account or bucket name in dirpath, and DNS",
        )
    if any(isinstance(err, AttemptTimeoutError) for err in chain):
        return Diagnosis(
            False,
            "the store accepted the connection but did not answer in time",
            "check endpoint_url and any proxy or firewall between here and the store",
        )
    if any(isinstance(err, ConnectionRefusedError) for err in chain) or _REFUSED.search(text):
        return Diagnosis(
            False,
            f"nothing accepts connections at the store's endpoint ({one_line(chain[0])})",
            "check endpoint_url (host and port) and that the store's server is running",
            unreachable=True,
        )
    return None


def _diagnose_refusal(
    chain: list[BaseException], text: str, protocol: str, bucket: str, reading: bool
) -> Diagnosis | None:
    statuses = {http_status(err) for err in chain}
    backend = backend_of(protocol)
    if _NO_CREDENTIALS.search(text):
        return Diagnosis(
            True,
            "no credentials were found for the store",
            backend.no_credentials_fix,
        )
    unexpected = _UNEXPECTED_OPTION.search(text)
    if unexpected and any(isinstance(err, TypeError) for err in chain):
        return Diagnosis(
            True,
            f"the store's client does not take the option {unexpected.group(1)!r}",
            "correct or remove that key in storage_options",
        )
    if 401 in statuses or _AUTH_CODES.search(text) or any(_named(err, _AUTH_NAMES) for err in chain):
        return Diagnosis(
            True,
            f"the store refused the credentials ({one_line(chain[0])})",
            backend.credentials_fix,
        )
    errnos = {getattr(err, "errno", None) for err in chain}
    if errno.EROFS in errnos:
        return Diagnosis(True, f"{bucket!r} is on a read-only filesystem", "use a dirpath on a writable disk")
    if errno.ENOSPC in errnos or errno.EDQUOT in errnos:
        return Diagnosis(True, f"no space left for {bucket!r}", "free space there, or use another dirpath")
    if any(isinstance(err, (NotADirectoryError, FileExistsError)) for err in chain):
        return Diagnosis(
            True, "part of dirpath is a file, not a folder", "remove that file, or use another dirpath"
        )
    if 403 in statuses or any(isinstance(err, PermissionError) for err in chain):
        if reading:
            return Diagnosis(
                True,
                f"permission denied reading {bucket!r}: {one_line(chain[0])}",
                "grant this identity read and list on it, or use other credentials",
            )
        where = f"the folder {bucket!r} (read-only or immutable?)" if backend.local else f"{bucket!r}"
        return Diagnosis(
            True,
            f"permission denied writing into {where}: {one_line(chain[0])}",
            "grant this identity write, read, list and delete on dirpath, or use another dirpath",
        )
    if (
        404 in statuses
        or _MISSING_CODES.search(text)
        or any(isinstance(err, FileNotFoundError) for err in chain)
    ):
        kind = backend.container
        return Diagnosis(
            True,
            f"the {kind} {bucket!r} does not exist",
            f"create the {kind} first, or correct its name in dirpath",
        )
    return None


def one_line(error: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message``, at most ``limit`` characters (cloud errors carry pages of XML).

    Example:
        >>> one_line(ValueError("bad value\\n<xml>...</xml>"))
        'ValueError: bad value'
    """
    lines = str(error).strip().splitlines()
    first = lines[0].strip() if lines else ""
    text = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and what caused it (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _named(error: BaseException, names: set[str]) -> bool:
    return any(cls.__name__ in names for cls in type(error).__mro__)
