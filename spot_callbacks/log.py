"""The ``spot_callbacks`` logger, and the one place that decides whether its lines are shown.

A library configures no logging at import (the application owns the root logger). The
callbacks call :func:`show_info_lines` when they are created: if by then the application has
configured no handler at all, the info lines that matter on a spot instance (resumed from,
committed, skipped, preempted) would be lost to Python's last-resort handler, which shows
warnings only; so, as Lightning does for its own logger, one stream handler at INFO is added to
``spot_callbacks`` alone. An application that configured logging sees nothing added.

That handler writes through the live progress bar's own writer (:class:`BarAwareHandler`), so no line
glues onto a bar. The lines each checkpoint says are :func:`checkpoint_line`: debug lines unless
the run is ``verbose``, as Lightning's ``ModelCheckpoint(verbose=False)`` keeps its own quiet.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

log = logging.getLogger("spot_callbacks")
log.addHandler(logging.NullHandler())


class OneRankSpeaks(logging.Filter):
    """Info lines narrate the run, and every rank would say the same: only rank 0 says them (eight ranks,
    one line). Warnings and errors are each rank's own and always pass, as does a record logged with
    ``extra={"every_rank": True}`` (a line that differs by rank: what one node pulled). A warning
    logged with ``extra={"run_level": True}`` is the run's, which every rank saw alike (a launcher's
    SIGTERM reaches them all): rank 0 alone says it.

    Example:
        >>> OneRankSpeaks().filter(logging.makeLogRecord({"levelno": logging.INFO}))
        True
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "run_level", False):
            return _this_rank() == 0
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

_verbose = False


def set_verbose(verbose: bool) -> None:
    """Whether :func:`checkpoint_line` lines are info (shown) or debug lines; the running engine sets it."""
    global _verbose
    _verbose = verbose


def checkpoint_line(message: str, *args: Any, **kwargs: Any) -> None:
    """Log a line that each checkpoint says ("committed ...", "retention deleted ..."): at INFO when
    the run is ``verbose``, else at DEBUG. A warning is never one of these: it is always shown.

    Example:
        >>> set_verbose(False)
        >>> checkpoint_line("spot_callbacks: committed %s", "s3://b/run/step-000000004")  # a debug line
    """
    log.log(logging.INFO if _verbose else logging.DEBUG, message, *args, **kwargs)


def _live_bar_writer() -> Callable[[str], None] | None:
    """The writer of a progress bar on screen now, if any: a live rich display's console (Lightning's
    RichProgressBar) or ``tqdm.write`` (Lightning's TQDMProgressBar, the HF Trainer's bar). Neither
    package is imported here: a bar exists only if its package was imported already."""
    rich = sys.modules.get("rich")
    if rich is not None:
        console = rich.get_console()
        if getattr(console, "_live_stack", None) or getattr(console, "_live", None):
            return lambda line: console.print(
                line, markup=False, highlight=False, emoji=False, soft_wrap=True
            )
    tqdm = sys.modules.get("tqdm")
    bar_class = getattr(tqdm, "tqdm", None)
    if bar_class is not None and len(getattr(bar_class, "_instances", ())) > 0:
        return lambda line: bar_class.write(line, file=sys.stderr)
    return None


class BarAwareHandler(logging.StreamHandler):
    """A stderr handler that prints through the live progress bar's writer while a bar is on screen,
    so a line starts on a line of its own and the bar is redrawn below it; else to ``sys.stderr`` as it
    is at the time (a capture, or rich's redirection, replaces it after this handler was made).

    Example:
        >>> handler = BarAwareHandler()
        >>> handler.stream is sys.stderr
        True
    """

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> Any:
        return sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        write = _live_bar_writer()
        if write is None:
            super().emit(record)
            return
        try:
            write(self.format(record))
        except Exception:
            self.handleError(record)


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
    _added = BarAwareHandler()
    log.addHandler(_added)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    log.propagate = False


def raised_at(err: BaseException) -> str:
    """Where ``err`` was raised (the innermost frame: ``"file.py:12 in name"``), for a warning that
    carries on past an unexpected error without its traceback.

    Example:
        >>> try:
        ...     [][0]
        ... except IndexError as err:
        ...     raised_at(err).startswith("raised at ")
        True
    """
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return "raised at an unknown place"
    frame = frames[-1]
    return f"raised at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
