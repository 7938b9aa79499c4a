"""One timed transfer of the emulator transfer benchmark (Azurite, fake-gcs-server), in a fresh process.

``python benchmarks/_emulator_clients.py SPEC_JSON`` prints one JSON line, as ``_transfer_clients.py``
does (wall seconds, CPU seconds of every thread, the RSS before and the peak during the transfer);
each client is built and warmed (its first request made) before the clock starts.

Clients (``spec["backend"]/spec["client"]``):

* ``az/project``, ``gs/project``: ``CommitWriter.write_checkpoint`` (digests computed while
  uploading) and ``CheckpointStore.pull`` into an empty folder (every checksum verified), default
  data plane (obstore moves az:// payload bytes, gcsfs gs://);
* ``az/adlfs``: ``AzureBlobFileSystem.put`` / ``get`` of all files (its ``_put_file`` /
  ``_get_file`` concurrently), default options;
* ``az/obstore``: ``obstore.put`` (16 MiB parts, 8 in flight) and one streamed GET per file, 8 files
  at once, on an ``AzureStore``;
* ``gs/gcsfs``: ``GCSFileSystem.put`` / ``get`` of all files, default options.
"""

from __future__ import annotations

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported

import json
import sys
from pathlib import Path
from typing import Any

from _servers import gcs_options
from _transfer_clients import measure, obstore_transfer

MiB = 2**20


def _url(spec: dict[str, Any]) -> str:
    return f"{spec['backend']}://{spec['bucket']}/{spec['prefix']}"


def _options(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["backend"] == "az":
        return {"connection_string": spec["connection_string"]}
    return gcs_options(spec["endpoint"])


def _remote(spec: dict[str, Any]) -> list[str]:
    return [f"{spec['bucket']}/{spec['prefix']}/step-000000001/{name}" for name in spec["names"]]


def project(spec: dict[str, Any]) -> Any:
    from spot_callbacks.store import CheckpointStore, CommitWriter

    store = CheckpointStore(_url(spec), storage_options=_options(spec))
    if spec["direction"] == "upload":
        warm = Path(spec["scratch"]) / "warm"
        warm.mkdir(parents=True, exist_ok=True)
        (warm / "w.bin").write_bytes(b"warm")
        CommitWriter(store).write_checkpoint(
            0, warm, reason="manual", framework="bench"
        )  # clients built, connections open
        return lambda: CommitWriter(store).write_checkpoint(
            1, Path(spec["src"]), reason="manual", framework="bench"
        )
    store.pull(0, Path(spec["scratch"]) / "warm-pull")  # the tiny step the upload's warm-up wrote
    return lambda: store.pull(1, Path(spec["dest"]))


def raw_fsspec(spec: dict[str, Any]) -> Any:
    """adlfs or gcsfs: ``fs.put`` / ``fs.get`` of the file list (the backend's own concurrency)."""
    import fsspec

    fs = fsspec.filesystem(spec["backend"], skip_instance_cache=True, **_options(spec))
    fs.ls(spec["bucket"])
    remote = _remote(spec)
    if spec["direction"] == "upload":
        local_src = [os.path.join(spec["src"], name) for name in spec["names"]]
        return lambda: fs.put(local_src, remote)
    local_dest = [os.path.join(spec["dest"], name) for name in spec["names"]]
    os.makedirs(spec["dest"], exist_ok=True)
    return lambda: fs.get(remote, local_dest)


def raw_obstore_azure(spec: dict[str, Any]) -> Any:
    from _servers import AZURITE_ACCOUNT, AZURITE_KEY
    from obstore.store import AzureStore

    endpoint = spec["connection_string"].split("BlobEndpoint=")[1].rstrip(";")
    store = AzureStore(
        spec["bucket"], config={"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY, "endpoint": endpoint},
        client_options={"allow_http": True, "timeout": "1h"},
    )  # fmt: skip
    return obstore_transfer(store, spec)


CLIENTS = {
    ("az", "project"): project,
    ("az", "adlfs"): raw_fsspec,
    ("az", "obstore"): raw_obstore_azure,
    ("gs", "project"): project,
    ("gs", "gcsfs"): raw_fsspec,
}


def main() -> None:
    spec = json.loads(sys.argv[1])
    run = CLIENTS[spec["backend"], spec["client"]](spec)
    if os.environ.get("SPOT_BENCH_PROFILE"):  # a cProfile of the timed part only, to this path
        import cProfile

        timed = run

        def run() -> None:
            cProfile.runctx("timed()", globals(), {"timed": timed}, os.environ["SPOT_BENCH_PROFILE"])

    print(json.dumps({**measure(run), "prefix": spec.get("prefix")}))


if __name__ == "__main__":
    main()
