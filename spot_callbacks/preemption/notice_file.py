"""A notice file: the appearance of the file at ``$SPOT_NOTICE_FILE`` is a preemption notice.

For whatever can write a file but neither send this process a signal nor answer as a metadata
service: a Kubernetes ``preStop`` hook (``touch /shared/preempted``), a scheduler's epilogue, a
sidecar. The file's content, if any, is the time left before the machine goes away (``90``,
``90s``, ``2min``); an empty file leaves the signal grace (``$SPOT_SIGNAL_GRACE_S``). The content
is not trusted: at most :data:`MAX_NOTICE_FILE_BYTES` are read, and anything that is not a
duration also leaves the signal grace, with a warning. The file is polled with the clouds
(``$SPOT_METADATA_POLL_S``); once removed, its next appearance is a new notice.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import spot_callbacks.settings as settings
from spot_callbacks._format import parse_duration
from spot_callbacks.errors import ConfigError
from spot_callbacks.preemption.notice import Notice
from spot_callbacks.preemption.poller import Poll
from spot_callbacks.preemption.signals import signal_grace_s

log = logging.getLogger("spot_callbacks")

# "120", "2min", "PT2M": a duration is a few bytes; more is not a duration.
MAX_NOTICE_FILE_BYTES = 64


def notice_file_problem() -> str | None:
    """Why the notice file cannot be watched (``$SPOT_NOTICE_FILE`` is unset); None when it can."""
    if settings.NOTICE_FILE.value() is None:
        return (
            f"{settings.NOTICE_FILE.name} is not set; set it to the path of the file whose appearance "
            "is the notice (e.g. the one a Kubernetes preStop hook touches)"
        )
    return None


def seconds_left_in(content: bytes, grace_s: float) -> tuple[float, str]:
    """The seconds left that a notice file's ``content`` announces, and a word on where they come from.

    Empty: ``grace_s``. Not a duration, negative, or longer than :data:`MAX_NOTICE_FILE_BYTES`:
    ``grace_s`` and a warning.

    Example:
        >>> seconds_left_in(b"90\\n", 30.0), seconds_left_in(b"", 30.0)
        ((90.0, '90s announced in the file'), (30.0, 'the signal grace, 30s'))
    """
    grace = (grace_s, f"the signal grace, {grace_s:g}s")
    if len(content) > MAX_NOTICE_FILE_BYTES:
        log.warning(
            "spot_callbacks: the notice file holds more than %d bytes, which is no duration; "
            "taking the signal grace (%gs) as the time left", MAX_NOTICE_FILE_BYTES, grace_s,
        )  # fmt: skip
        return grace
    text = content.decode("utf-8", "replace").strip()
    if not text:
        return grace
    try:
        seconds = parse_duration(text, key="the notice file")
    except ConfigError:
        seconds = None
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        log.warning(
            "spot_callbacks: the notice file says %r, which is not a time left (e.g. 90 or 2min); "
            "taking the signal grace (%gs)", text[:MAX_NOTICE_FILE_BYTES], grace_s,
        )  # fmt: skip
        return grace
    return seconds, f"{seconds:g}s announced in the file"


class NoticeFileSource:
    """A file whose appearance is a notice; its content may say the time left (see the module).

    Args:
        name: the source's name (the notice's ``source``).
        path: the file; default ``$SPOT_NOTICE_FILE`` (a ``ValueError`` when unset).

    Example:
        >>> import tempfile; folder = tempfile.mkdtemp()
        >>> source = NoticeFileSource("notice-file", f"{folder}/preempted")
        >>> source.poll(5.0).notice is None
        True
        >>> _ = Path(f"{folder}/preempted").write_text("120")
        >>> round(source.poll(5.0).notice.seconds_left()), source.poll(5.0).notice  # reported once
        (120, None)
    """

    def __init__(self, name: str, path: str | Path | None = None) -> None:
        path = path if path is not None else settings.NOTICE_FILE.value()
        if not path:
            raise ValueError(notice_file_problem() or "no notice file")
        self.name = name
        self.path = Path(path)
        self._reported = False

    def poll(self, wait_s: float) -> Poll:
        try:
            with self.path.open("rb") as notice_file:
                content = notice_file.read(MAX_NOTICE_FILE_BYTES + 1)
        except FileNotFoundError:
            self._reported = False  # removed: its next appearance is a new notice
            return Poll()
        if self._reported:
            return Poll()
        self._reported = True
        now = time.time()
        seconds, whence = seconds_left_in(content, signal_grace_s())
        return Poll(
            notice=Notice(self.name, now + seconds, f"{self.path} appeared; {whence}", received_at=now)
        )

    def acknowledge(self) -> None:
        """Nothing listens for it."""

    def abort(self) -> None:
        """A poll reads a few bytes of a local file: nothing to end."""

    def describe(self) -> str:
        return f"the notice file {self.path}"
