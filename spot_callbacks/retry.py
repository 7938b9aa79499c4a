"""Which storage errors are worth retrying, and the backoff used for them (tenacity)."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import tenacity

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
