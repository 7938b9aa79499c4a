"""Which storage errors are worth retrying, the backoff used for them (tenacity), and how long
one attempt of a storage call may take before it counts as hung.

Every call through :meth:`RetryPolicy.call` is bounded: a listing, read, delete or existence
check that has not answered within ``attempt_timeout_s`` (``$SPOT_STORE_TIMEOUT_S``, default
60 s) is abandoned and retried like a failed one; uploads take their own, size-based timeout
(:class:`UploadTimeout`).
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any, TypeVar

import tenacity

import spot_callbacks.settings as settings
from spot_callbacks.errors import AttemptTimeoutError, CheckpointError

log = logging.getLogger("spot_callbacks")
T = TypeVar("T")

# Errors that a retry cannot fix: a missing bucket, denied credentials, a bad argument.
_PERMANENT_TYPES: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    NotImplementedError,
)
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
# Missing or refused credentials, by class name so no cloud SDK has to be imported here.
_PERMANENT_NAMES = {
    "NoCredentialsError",  # botocore
    "PartialCredentialsError",  # botocore
    "ClientAuthenticationError",  # azure-core
    "DefaultCredentialsError",  # google-auth
    "RefreshError",  # google-auth
}
# 4xx answers are the request's fault and come back the same, except a timeout and throttling.
_TRANSIENT_4XX = {408, 429}


def http_status(error: BaseException) -> int | None:
    """The HTTP status a cloud SDK's exception carries (azure-core, gcsfs, aiohttp, botocore), or ``None``.

    Example:
        >>> class HttpResponseError(Exception):
        ...     status_code = 403
        >>> http_status(HttpResponseError()), http_status(OSError())
        (403, None)
    """
    for name in ("status_code", "code", "status"):
        value = getattr(error, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    response = getattr(error, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return value if isinstance(value, int) else None
    return None


def is_transient(error: BaseException) -> bool:
    """True for errors a later attempt may not see: timeouts, resets, 5xx, throttling.

    A :class:`~spot_callbacks.errors.CheckpointError` never is (a body that disagrees with its
    manifest is a lie told again on every try: damage at once).

    Example:
        >>> from spot_callbacks.errors import CorruptCheckpointError
        >>> is_transient(ConnectionResetError()), is_transient(CorruptCheckpointError("short"))
        (True, False)
    """
    if not isinstance(error, Exception):
        return False
    if isinstance(error, _PERMANENT_TYPES):
        return False
    if isinstance(error, CheckpointError):  # damage, a lock, a refused store: the same on every try
        return False
    if any(cls.__name__ in _PERMANENT_NAMES for cls in type(error).__mro__):
        return False
    status = http_status(error)
    if status is not None and 400 <= status < 500 and status not in _TRANSIENT_4XX:
        return False
    return not (isinstance(error, OSError) and error.errno in _PERMANENT_ERRNOS)


STORE_TIMEOUT_ENV = settings.STORE_TIMEOUT_S.name
DEFAULT_STORE_TIMEOUT_S = settings.STORE_TIMEOUT_S.default


def store_timeout_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    """``$SPOT_STORE_TIMEOUT_S``: seconds one attempt of a storage call may take (``0``/``off``: no limit).

    Example:
        >>> store_timeout_from_env({}), store_timeout_from_env({"SPOT_STORE_TIMEOUT_S": "off"})
        (60.0, None)
    """
    return settings.STORE_TIMEOUT_S.value(environ)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for transient storage errors, each attempt bounded in time.

    ``attempt_timeout_s`` (default ``$SPOT_STORE_TIMEOUT_S``, 60 s; ``None``: no limit) is how long
    one attempt may run before it is abandoned and retried as a hung one.

    Example:
        >>> RetryPolicy(attempts=3).call(lambda: 42, what="answer")
        42
        >>> RetryPolicy(attempt_timeout_s=30).timeout_for(400_000_000)
        130.0
    """

    attempts: int = 6
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    attempt_timeout_s: float | None = field(default_factory=store_timeout_from_env)

    def call(
        self,
        fn: Callable[[], T],
        what: str,
        timeout_s: float | None | EllipsisType = ...,
        fix: str | None = None,
    ) -> T:
        """``fn()``, retried on transient errors; an attempt past ``timeout_s`` (default
        :attr:`attempt_timeout_s`; ``None``: no limit) is abandoned and retried. ``fix`` is what
        the timeout's message tells a user to change."""
        if timeout_s is ...:
            timeout_s = self.attempt_timeout_s
            fix = fix or f"raise {STORE_TIMEOUT_ENV} (seconds) for a slow store"

        def log_retry(state: tenacity.RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome else None
            log.warning(
                "spot_callbacks: %s failed (attempt %d of %d): %s: %s; retrying",
                what, state.attempt_number, self.attempts, type(error).__name__, error,
            )  # fmt: skip

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=tenacity.wait_random_exponential(multiplier=self.initial_backoff_s, max=self.max_backoff_s),
            retry=tenacity.retry_if_exception(is_transient),
            before_sleep=log_retry,
            reraise=True,
        )
        return retrying(lambda: call_with_timeout(fn, timeout_s, what, fix))

    def timeout_for(self, nbytes: int) -> float | None:
        """The attempt timeout of a read of ``nbytes``: :attr:`attempt_timeout_s` plus the bytes at
        the slowest speed an upload is allowed (``$SPOT_UPLOAD_MIN_MBPS``)."""
        if self.attempt_timeout_s is None:
            return None
        min_mb_per_s = UploadTimeout.from_env().min_mb_per_s
        return UploadTimeout(self.attempt_timeout_s, min_mb_per_s).seconds_for(nbytes)


UPLOAD_TIMEOUT_ENV = settings.UPLOAD_TIMEOUT_S.name
UPLOAD_MIN_SPEED_ENV = settings.UPLOAD_MIN_MBPS.name
UPLOAD_TIMEOUT_FIX = f"raise {UPLOAD_TIMEOUT_ENV} (seconds) or lower {UPLOAD_MIN_SPEED_ENV}"


@dataclass(frozen=True)
class UploadTimeout:
    """How long one upload attempt may run before it counts as hung: ``floor_s`` plus its size at
    ``min_mb_per_s``. ``floor_s=None`` never times out.

    Read from ``$SPOT_UPLOAD_TIMEOUT_S`` (the floor; ``0`` or ``off`` disables) and
    ``$SPOT_UPLOAD_MIN_MBPS`` by :meth:`from_env`.

    Example:
        >>> UploadTimeout(floor_s=120, min_mb_per_s=4).seconds_for(1_000_000_000)
        370.0
        >>> UploadTimeout.from_env({"SPOT_UPLOAD_TIMEOUT_S": "off"}).seconds_for(10)
    """

    floor_s: float | None = 120.0
    min_mb_per_s: float = 4.0

    def __post_init__(self) -> None:
        if self.floor_s is not None and not self.floor_s > 0:
            raise ValueError(f"floor_s={self.floor_s!r} must be > 0 seconds, or None for no timeout")
        if not self.min_mb_per_s > 0:
            raise ValueError(f"min_mb_per_s={self.min_mb_per_s!r} must be > 0 MB/s")

    def seconds_for(self, nbytes: int) -> float | None:
        if self.floor_s is None:
            return None
        return self.floor_s + nbytes / (self.min_mb_per_s * 1e6)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> UploadTimeout:
        return cls(settings.UPLOAD_TIMEOUT_S.value(environ), settings.UPLOAD_MIN_MBPS.value(environ))


def call_with_timeout(fn: Callable[[], T], timeout_s: float | None, what: str, fix: str | None = None) -> T:
    """Run ``fn`` in a daemon thread and raise :class:`AttemptTimeoutError` if it has not returned
    within ``timeout_s`` (``None``: wait forever); ``fix`` ends the message (default: the upload
    timeout's settings).

    A thread cannot be killed: the late attempt is abandoned and may still finish in the
    background (the caller must make a late finish harmless). It is a daemon, so it never
    keeps the process from exiting.

    Example:
        >>> call_with_timeout(lambda: 42, 5.0, "answer")
        42
    """
    if timeout_s is None:
        return fn()
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def attempt() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller below
            outcome["error"] = err
        finally:
            done.set()

    threading.Thread(target=attempt, name="spot-attempt", daemon=True).start()
    if not done.wait(timeout_s):
        raise AttemptTimeoutError(
            f"{what} did not finish within {timeout_s:.1f}s (hung?); abandoning that attempt. "
            f"Slow links: {fix or UPLOAD_TIMEOUT_FIX}"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
