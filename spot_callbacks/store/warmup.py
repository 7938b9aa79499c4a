"""Building a store's clients on a daemon thread while the user builds the model and the Trainer.

A remote store's first request pays for its client: s3fs builds aiobotocore's client (S3's service
model and endpoint rules) and the data plane builds boto3's and obstore's
(:mod:`~spot_callbacks.store.dataplane`). In a process that has imported torch and a framework that
is ~0.3 s of CPU, of which the build itself is ~0.06 s: its ~36,000 new objects set off a full pass of
Python's cyclic garbage collector over the ~400,000 the imports left (BENCHMARKS.md). A run starts the
warm-up when its engine is built, which in a real script comes seconds before the resume's first
request (``from_pretrained``, the Trainer), so that request finds the clients built. The collector's
pass holds the GIL: it overlaps the user's work only where that work releases it (reading weights,
torch's kernels), not pure Python.

The rules:

1. Nothing waits for the warm-up but the store's first use: :attr:`CheckpointStore.fs` waits for the
   filesystem's client (:meth:`ClientWarmUp.wait_for_client`), because two first requests racing
   would each build one (older s3fs has no lock around it). The data plane's clients keep their
   own locks; nothing waits for them.
2. A warm-up that fails changes nothing: its error is logged at debug level, by type only (a
   client's message may quote its configuration), and the first request builds the client again
   and raises what it raises without a warm-up, with the preflight's diagnosis.
3. A warm-up that hangs (a credential lookup that never answers) holds nothing up for long: the
   wait gives up after :func:`wait_limit_s`, and the first request then goes its own way, inside
   the preflight's bounds as without a warm-up (s3fs' own lock, where it has one, makes it wait
   there for the build in flight; an older s3fs builds a second client).
4. It never keeps the process alive: a daemon thread, not a pool (``concurrent.futures`` joins its
   workers at exit).
5. A store without a client to build (the local disk, ``memory://``) starts no thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import spot_callbacks.settings as settings

log = logging.getLogger("spot_callbacks")


def wait_limit_s() -> float:
    """How long a first use waits for a warm-up still building its client: twice
    ``$SPOT_CONNECT_TIMEOUT_S``, the time a store that accepts but never answers gets at start.

    Example:
        >>> wait_limit_s()
        10.0
    """
    return 2 * settings.CONNECT_TIMEOUT_S.value()


class ClientWarmUp:
    """A store's clients built on a daemon thread: the filesystem's (``connect(fs)``), then the data
    plane's (``warm_plane()``).

    Args:
        connect: builds the filesystem's client (``None``: the filesystem has none to build ahead).
        warm_plane: builds the data plane's clients (``None``: fsspec moves the payload bytes).
        name: what the debug line calls the store (its URL: no credentials).

    Example:
        >>> built = []
        >>> warm_up = ClientWarmUp(lambda: built.append("client"), lambda: built.append("plane"), "memory://x")
        >>> warm_up.start(); warm_up.wait_for_client(5.0); warm_up.thread.join(5.0); built
        ['client', 'plane']
    """

    def __init__(
        self, connect: Callable[[], Any] | None, warm_plane: Callable[[], Any] | None, name: str
    ) -> None:
        self._connect = connect
        self._warm_plane = warm_plane
        self._name = name
        self._client_built = threading.Event()  # set once the client is built, or its build failed
        self._waited = False
        self.thread = threading.Thread(target=self._run, name="spot-warm-up", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def client_built(self) -> bool:
        """The filesystem's client is built (or its build failed: the first request builds it again)."""
        return self._client_built.is_set()

    def wait_for_client(self, timeout_s: float | None = None) -> None:
        """Block until the filesystem's client is built, at most ``timeout_s`` (default
        :func:`wait_limit_s`) the first time; later calls return at once (rule 3)."""
        if self._waited:
            return
        if not self._client_built.wait(wait_limit_s() if timeout_s is None else timeout_s):
            log.debug("spot_callbacks: %s: the client's warm-up is still running; the first request goes on",
                      self._name)  # fmt: skip
        self._waited = True

    def _run(self) -> None:
        try:
            if self._connect is not None:
                self._step(self._connect, "client")
        finally:
            self._client_built.set()
        if self._warm_plane is not None:
            self._step(self._warm_plane, "data plane's clients")

    def _step(self, build: Callable[[], Any], what: str) -> None:
        try:
            build()
        except Exception as err:  # noqa: BLE001 - the first request meets it again and says it (rule 2)
            log.debug("spot_callbacks: building %s's %s ahead failed (%s); the first use builds it again",
                      self._name, what, type(err).__name__)  # fmt: skip
