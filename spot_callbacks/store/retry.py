"""Which storage errors are worth retrying, the backoff used for them (tenacity), and how long
one upload attempt may take before it counts as hung."""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

from spot_callbacks.errors import AttemptTimeoutError

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


def is_transient(error: BaseException) -> bool:
    """True for errors a later attempt may not see: timeouts, resets, 5xx, throttling."""
    if not isinstance(error, Exception):
        return False
    if isinstance(error, _PERMANENT_TYPES):
        return False
    if any(cls.__name__ in _PERMANENT_NAMES for cls in type(error).__mro__):
        return False
    return not (isinstance(error, OSError) and error.errno in _PERMANENT_ERRNOS)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for transient storage errors.

    Example:
        >>> RetryPolicy(attempts=3).call(lambda: 42, what="answer")
        42
    """

    attempts: int = 6
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    def call(self, fn: Callable[[], T], what: str) -> T:
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
        return retrying(fn)


UPLOAD_TIMEOUT_ENV = "SPOT_UPLOAD_TIMEOUT_S"
UPLOAD_MIN_SPEED_ENV = "SPOT_UPLOAD_MIN_MBPS"


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
        environ = os.environ if environ is None else environ
        default = cls()
        floor_text = environ.get(UPLOAD_TIMEOUT_ENV, "").strip()
        floor_s: float | None = default.floor_s
        if floor_text.lower() in ("0", "off", "none"):
            floor_s = None
        elif floor_text:
            floor_s = _positive_number(UPLOAD_TIMEOUT_ENV, floor_text, "seconds, or 0/off for no timeout")
        speed_text = environ.get(UPLOAD_MIN_SPEED_ENV, "").strip()
        speed = (
            _positive_number(UPLOAD_MIN_SPEED_ENV, speed_text, "MB/s") if speed_text else default.min_mb_per_s
        )
        return cls(floor_s, speed)


def _positive_number(name: str, text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}={text!r} is not a positive number; use e.g. {name}=120 ({unit})")
    return value


def call_with_timeout(fn: Callable[[], T], timeout_s: float | None, what: str) -> T:
    """Run ``fn`` in a daemon thread and raise :class:`AttemptTimeoutError` if it has not returned
    within ``timeout_s`` (``None``: wait forever).

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
            f"Slow links: raise {UPLOAD_TIMEOUT_ENV} (seconds) or lower {UPLOAD_MIN_SPEED_ENV}"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
