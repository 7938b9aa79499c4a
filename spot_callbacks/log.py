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
