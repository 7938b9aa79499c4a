"""A run that starts (the run lock, then the pull of its resume point) and is sent SIGTERM meanwhile.

argv: dirpath, storage_options as JSON. Used by tests/test_startup_notices.py.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import sys

from spot_callbacks import SpotConfig
from spot_callbacks.engine import SpotEngine

# Registered before the library's exit hook, so it runs after it: the objects the exit left uncollected.
atexit.register(lambda: print(f"GC FROZEN AT EXIT {gc.get_freeze_count()}", flush=True))
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
config = SpotConfig(
    dirpath=sys.argv[1], interval=None, preemption=["SIGTERM"], storage_options=json.loads(sys.argv[2])
)
engine = SpotEngine(config, "test")
try:
    engine.start()
    print("started", flush=True)
    engine.pull_latest()
    print("pulled", flush=True)
finally:
    engine.stop()
