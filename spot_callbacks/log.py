"""The ``spot_callbacks`` logger, and the one place that decides whether its lines are shown.

A library configures no logging at import (the application owns the root logger). The
callbacks call :func:`show_info_lines` when they are created: if by then the application has
configured no handler at all, the info lines that matter on a spot instance (resumed from,
committed, skipped, preempted) would be lost to Python's last-resort handler, which shows
warnings only; so, as Lightning does for its own logger, one stream handler at INFO is added to
``spot_callbacks`` alone. An application that configured logging sees nothing added.
"""

from __future__ import annotations

import logging

log = logging.getLogger("spot_callbacks")
log.addHandler(logging.NullHandler())


class OneRankSpeaks(logging.Filter):
    """Info lines narrate the run, and every rank would say the same: only rank 0 says them (eight ranks,
    one line). Warnings and errors are each rank's own and always pass, as does a record logged with
    ``extra={"every_rank": True}`` (a line that differs by rank: what one node pulled).

    Example:
        >>> OneRankSpeaks().filter(logging.makeLogRecord({"levelno": logging.INFO}))
        True
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or getattr(record, "every_rank", False):
            return True
        return _this_rank() == 0


def _this_rank() -> int:
    from spot_callbacks._dist import distributed_ready, rank

    if distributed_ready():
        return rank()
    # Under torchrun before the process group exists: the launcher's RANK.
    import spot_callbacks.settings as settings

    text = settings.environment_variable("RANK") or "0"
    return int(text) if text.isdigit() else 0


class PrintableLines(logging.Filter):
    """Every line escaped of control characters (``_format.printable``): a log line may quote a
    manifest, a lock or a file name from the store, which must not drive the terminal it is shown on.

    Example:
        >>> record = logging.makeLogRecord({"msg": "ignoring %s", "args": ("\x1b[2J",)})
        >>> PrintableLines().filter(record), record.getMessage()
        (True, 'ignoring \\\\x1b[2J')
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from spot_callbacks._format import printable

        message = record.getMessage()
        safe = printable(message, keep_newlines=True)
        if safe != message:
            record.msg, record.args = safe, None
        return True


log.addFilter(OneRankSpeaks())
log.addFilter(PrintableLines())

_added: logging.Handler | None = None


def show_info_lines() -> None:
    """Show ``spot_callbacks`` info lines on stderr when the application configured no logging.

    Example:
        >>> root = logging.getLogger()
        >>> root.addHandler(app_handler := logging.StreamHandler())  # the application's logging
        >>> show_info_lines()  # so nothing is added
        >>> [type(h).__name__ for h in logging.getLogger("spot_callbacks").handlers]
        ['NullHandler']
        >>> root.removeHandler(app_handler)
    """
    global _added
    if _added is not None or logging.getLogger().hasHandlers():
        return
    _added = logging.StreamHandler()
    log.addHandler(_added)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    log.propagate = False
