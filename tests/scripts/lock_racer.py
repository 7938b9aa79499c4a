"""One run racing for a run lock (tests/test_runlock_race.py): another process on another "host".

argv: dirpath, storage_options as JSON, stale seconds, host name. Prints ``ready`` once built, waits
for ``go`` on stdin, tries to acquire, prints one JSON line (won, run_id, error), then waits for
``release`` on stdin before releasing what it holds.
"""

from __future__ import annotations

import json
import socket
import sys

from spot_callbacks import CheckpointStore, RunLockedError
from spot_callbacks.store.runlock import RunLock

dirpath, options, stale_s, host = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
socket.gethostname = lambda: host  # each racer is its own machine
lock = RunLock(CheckpointStore(dirpath, storage_options=options), stale_s=stale_s)
print("ready", flush=True)
sys.stdin.readline()
try:
    lock.acquire()
    print(json.dumps({"won": True, "run_id": lock.run_id, "error": None}), flush=True)
except RunLockedError as err:
    print(json.dumps({"won": False, "run_id": lock.run_id, "error": str(err)}), flush=True)
sys.stdin.readline()
lock.release()
