"""What the ``spot-callbacks`` command prints never holds a credential: storage option values and
URL passwords are replaced by ``***`` in its messages and in the log records it shows."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from spot_callbacks.config import PUBLIC_OPTION_NAMES, shown_option_value

# Option names whose values are credentials; other long values are hidden too unless known public.
_SECRET_NAME = re.compile(r"key|secret|token|pass|cred|sas|sig|auth|conn|session|private|cert", re.IGNORECASE)
_PUBLIC_NAMES = PUBLIC_OPTION_NAMES | {"endpoint"}
_NOT_SECRET_VALUES = frozenset({"anon", "google_default", "cache", "browser", "cloud", "true", "false"})
_MIN_SECRET_LEN = 6
_MIN_UNKNOWN_LEN = 8
_HIDDEN = "***"


class Redactor:
    """Replaces secret strings (storage option values, a URL's password) in text with ``***``.

    Example:
        >>> redact = Redactor()
        >>> redact.add_options({"secret": "hunter2-hunter2", "endpoint_url": "http://minio:9000"})
        >>> redact("denied: secret=hunter2-hunter2 at http://minio:9000")
        'denied: secret=*** at http://minio:9000'
    """

    def __init__(self) -> None:
        self._secrets: set[str] = set()

    def add_options(self, options: Any, name: str = "") -> None:
        """Remember the values of ``options`` (nested dicts and lists too) that may be secret."""
        if isinstance(options, dict):
            for key, value in options.items():
                self.add_options(value, str(key))
        elif isinstance(options, (list, tuple)):
            for value in options:
                self.add_options(value, name)
        elif isinstance(options, str):
            if _SECRET_NAME.search(name):
                if len(options) >= _MIN_SECRET_LEN and options.lower() not in _NOT_SECRET_VALUES:
                    self._secrets.add(options)
                # Connection strings: also each credential part, should a library print it alone.
                for part in options.split(";"):
                    part_name, _, part_value = part.partition("=")
                    if _SECRET_NAME.search(part_name) and len(part_value) >= _MIN_SECRET_LEN:
                        self._secrets.add(part_value)
            elif name not in _PUBLIC_NAMES and len(options) >= _MIN_UNKNOWN_LEN:
                self._secrets.add(options)
            else:  # a public URL may still carry a password (http://user:pw@minio:9000)
                self.add_url(options)

    def add_url(self, url: str) -> None:
        """Remember the password of a URL such as ``ftp://user:password@host/path``."""
        try:
            password = urlsplit(url).password
        except ValueError:
            return
        if password:
            self._secrets.add(password)

    def __call__(self, text: str) -> str:
        for secret in sorted(self._secrets, key=len, reverse=True):  # a connection string before its parts
            text = text.replace(secret, _HIDDEN)
        return text


def shown_options(options: dict[str, Any]) -> str:
    """``name=value`` for the options that locate a store (an endpoint URL less its credentials), the
    other names alone: for a log line.

    Example:
        >>> shown_options({"endpoint_url": "http://minio:9000", "secret": "x"})
        'endpoint_url=http://minio:9000, secret'
    """
    shown = []
    for name in sorted(options):
        value = shown_option_value(name, options[name])
        shown.append(name if value == "***" else f"{name}={value}")
    return ", ".join(shown)


class _RedactingFormatter(logging.Formatter):
    def __init__(self, redact: Redactor) -> None:
        super().__init__("%(message)s")
        self._redact = redact

    def format(self, record: logging.LogRecord) -> str:
        return self._redact(super().format(record))


def install_log_handler(verbosity: int, redact: Redactor) -> Callable[[], None]:
    """Send log records to stderr, redacted; return the function that undoes it (main runs in tests)."""
    # The store warns (skipped damaged checkpoints, retries) through logging: show those always.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_RedactingFormatter(redact))
    levels = {
        "spot_callbacks": logging.DEBUG if verbosity >= 2 else logging.INFO if verbosity else logging.WARNING
    }
    if verbosity >= 2:
        levels["fsspec"] = logging.DEBUG
    previous_levels = {}
    for name, level in levels.items():
        logger = logging.getLogger(name)
        previous_levels[name] = logger.level
        logger.addHandler(handler)
        logger.setLevel(level)

    # Backends log each retry, some with a traceback (gcsfs: six per dead endpoint), through loggers
    # with no handler, which Python then prints to stderr: the one diagnosed line says it instead.
    # -v shows them.
    quiet = logging.NullHandler()
    root = logging.getLogger()
    if not verbosity:
        root.addHandler(quiet)

    def restore() -> None:
        root.removeHandler(quiet)
        for name, level in previous_levels.items():
            logger = logging.getLogger(name)
            logger.removeHandler(handler)
            logger.setLevel(level)

    return restore
