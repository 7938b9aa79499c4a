"""One JSON report line on stdout, written whole: the multi-rank test scripts share one pipe."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def print_line(report: dict[str, Any]) -> None:
    """``report`` as one JSON line in one write (under the pipe's atomic size): print() may split a
    line into two writes, and another rank's line then lands between them."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps(report) + "\n").encode())
