"""``az://`` (``abfs://``) payload bytes through obstore, built from the adlfs filesystem the store has.

obstore speaks Azure Blob itself: its multipart ``put`` reads the scratch file in Rust (no GIL, no
Python copies) and its pulls go through :class:`~spot_callbacks.store.clients.obstores.ObstoreReader`.
The account, its endpoint and the key or SAS token come from adlfs' own client (so a connection
string, ``account_name``/``account_key``, ``sas_token``, ``account_host``, anonymous access and the
``AZURE_STORAGE_*`` variables adlfs reads all mean the same here). An Azure identity credential
(a service principal, ``DefaultAzureCredential``) is left to adlfs: :class:`Unsupported`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, cast

from spot_callbacks.store.checksums import CHECKSUM_ALGORITHM, FileDigest
from spot_callbacks.store.clients.base import PULL_STREAMS, TransferBudget, Unsupported
from spot_callbacks.store.clients.obstores import (
    ObstoreReader,
    StoreCache,
    client_options,
    obstore_installed,
    request_deadline_s,
    retry_config,
    translated,
)
from spot_callbacks.store.clients.options import azure_account_options, azure_timeouts
from spot_callbacks.store.meter import Moved, ignore_moved


def azure_plane(fs: Any, budget: TransferBudget) -> AzurePlane:
    """The Azure data plane for the adlfs filesystem ``fs``; :class:`Unsupported` names what it cannot honour."""
    if not obstore_installed():
        raise Unsupported("obstore is not installed (pip install 'spot-callbacks[azure]')")
    return AzurePlane(fs, budget)


class AzurePlane:
    """Payload files of one adlfs filesystem through obstore, both ways.

    Example:
        >>> AzurePlane.name
        'obstore (upload and pull)'
    """

    name = "obstore (upload and pull)"

    def __init__(self, fs: Any, budget: TransferBudget) -> None:
        self._fs = fs
        self._budget = budget
        self._options = azure_account_options(fs)
        self._connect_timeout_s, self._read_timeout_s = azure_timeouts(fs)
        self._reader = ObstoreReader(budget, self._read_timeout_s)
        self._stores: dict[str, StoreCache] = {}
        self._lock = threading.Lock()

    def serves(self, fs: Any) -> bool:
        return fs is self._fs

    def warm(self, remote_path: str) -> None:
        self._store(self._split(remote_path)[0])(request_deadline_s(0, self._read_timeout_s))

    hashes_as_it_sends = False  # obstore reads the file in Rust: the store hashes it beside the upload

    def upload(
        self, local_path: str, remote_path: str, moved: Moved = ignore_moved, *, digest: bool = False
    ) -> FileDigest | None:
        # obstore reads the file itself (in Rust) and tells no progress: the store counts the file
        # whole when it lands.
        import obstore

        container, key = self._split(remote_path)
        # Parts of one range each, a share of the budget per file in flight (PULL_STREAMS at once).
        concurrency = max(1, self._budget.range_permits() // PULL_STREAMS)
        deadline = request_deadline_s(os.path.getsize(local_path), self._read_timeout_s)
        try:
            obstore.put(
                self._store(container)(deadline), key, Path(local_path),
                chunk_size=self._budget.range_bytes(), max_concurrency=concurrency,
            )  # fmt: skip
        except Exception as err:  # noqa: BLE001 - re-raised as the class adlfs would raise
            raise translated(err, f"az://{container}/{key}") from err
        return None

    def download(
        self,
        remote_path: str,
        local_path: str,
        timeout_s: float | None,
        expected_size: int | None = None,
        moved: Moved = ignore_moved,
        checksum_kind: str = CHECKSUM_ALGORITHM,
    ) -> FileDigest:
        container, key = self._split(remote_path)
        store, url = self._store(container), f"az://{container}/{key}"
        return self._reader.download(
            store, key, url, local_path, timeout_s, expected_size, moved, checksum_kind
        )

    def digest(
        self,
        remote_path: str,
        timeout_s: float | None,
        expected_size: int | None = None,
        moved: Moved = ignore_moved,
        checksum_kind: str = CHECKSUM_ALGORITHM,
    ) -> FileDigest:
        container, key = self._split(remote_path)
        return self._reader.digest(
            self._store(container),
            key,
            f"az://{container}/{key}",
            timeout_s,
            expected_size,
            moved,
            checksum_kind,
        )

    def _split(self, remote_path: str) -> tuple[str, str]:
        container, key, _version = self._fs.split_path(remote_path)
        return container, key

    def _store(self, container: str) -> StoreCache:
        """obstore's stores for ``container``, one per whole-request deadline."""
        from obstore.store import AzureStore

        def build(total_timeout_s: float) -> Any:
            # obstore types these as TypedDicts; ours are plain dicts built from adlfs's options.
            return cast(Any, AzureStore)(
                container,
                config=self._options,
                client_options=client_options(
                    http=self._options["endpoint"].startswith("http://"),
                    connect_timeout_s=self._connect_timeout_s,
                    read_timeout_s=self._read_timeout_s,
                    total_timeout_s=total_timeout_s,
                ),
                retry_config=retry_config(total_timeout_s),
            )

        with self._lock:
            return self._stores.setdefault(container, StoreCache(build))
