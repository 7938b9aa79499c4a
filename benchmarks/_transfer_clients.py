"""One timed transfer of the transfer benchmark, run in a fresh process: the project or a raw client.

``python benchmarks/_transfer_clients.py SPEC_JSON`` prints one JSON line: wall seconds, CPU
seconds (every thread of the process), the RSS before the transfer and the peak during it. Each
client is built and warmed (its first connection made) before the clock starts, so only moving
the bytes is timed, for the project as for the raw clients.

Nothing runs in the measured process but the client: no sampler thread. CPU is the kernel's count
for the process (``getrusage`` before and after); the peak RSS is the kernel's high-water mark
(``VmHWM``), reset to the current RSS just before the clock (``/proc/self/clear_refs``) and read
once the transfer is done, so set-up does not count and no sample can miss a peak.

Clients (``--clients`` of ``transfer.py``):

* ``project``: ``CommitWriter.write_checkpoint`` with no digests handed over, so every file is
  hashed by the upload (on s3://, each part from the bytes s3transfer reads to send it: the path of
  a Hugging Face checkpoint folder, whose files the Trainer writes), and ``CheckpointStore.pull``
  into an empty folder (every checksum verified);
* ``project-written``: the same with every file's digest handed over, the path of a Lightning or
  engine checkpoint and of a sharded (DCP) one, hashed as they are written (that hash is the
  writer's cost, not the upload's: taken before the clock here); its pull is ``project``'s;
* ``s3fs``: ``fs.put`` / ``fs.get`` of all files (s3fs' own concurrency), default options;
* ``boto3``: s3transfer's TransferManager, 16 threads, 32 MiB parts, no payload signing and no CRC
  on the http endpoint, all files submitted at once;
* ``obstore``: ``obstore.put`` (16 MiB parts, 8 in flight) and, as its users pull, one plain
  ``obstore.get(store, path).stream()`` per file written to disk as chunks arrive (its default
  chunks); one file in the calling thread, 8 files at once in 8 threads.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MiB = 2**20
KEY, SECRET = "bench", "bench-secret-key"


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Set the kernel's peak RSS of this process (VmHWM) to its RSS now; False where Linux does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The kernel's high-water mark of this process' RSS (``VmHWM``; ``ru_maxrss`` where /proc lacks it)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def s3_options(endpoint: str) -> dict[str, Any]:
    return {"key": KEY, "secret": SECRET, "endpoint_url": endpoint}


# ---------------------------------------------------------------------------------- clients
def project(spec: dict[str, Any], digests: dict[str, Any] | None = None) -> Any:
    from spot_callbacks.store import CheckpointStore, CommitWriter

    store = CheckpointStore(
        f"s3://{spec['bucket']}/{spec['prefix']}", storage_options=s3_options(spec["endpoint"])
    )
    if spec["direction"] == "upload":
        warm = Path(spec["scratch"]) / "warm"
        warm.mkdir(parents=True, exist_ok=True)
        (warm / "w.bin").write_bytes(b"warm")
        CommitWriter(store).write_checkpoint(
            0, warm, reason="manual", framework="bench"
        )  # clients built, connections open
        return lambda: CommitWriter(store).write_checkpoint(
            1, Path(spec["src"]), reason="manual", framework="bench", digests=digests
        )
    store.pull(0, Path(spec["scratch"]) / "warm-pull")  # the tiny step the upload's warm-up wrote
    return lambda: store.pull(1, Path(spec["dest"]))


def project_written(spec: dict[str, Any]) -> Any:
    """The project with every file's digest handed over, as the writer hands them for a Lightning or
    engine checkpoint (hashed while ``torch.save`` wrote it) and a sharded one (hashed while
    ``dcp.save`` wrote it): hashed here before the clock, so the upload alone is timed."""
    from spot_callbacks.store.checksums import digest_local_file

    if spec["direction"] != "upload":
        return project(spec)
    return project(spec, {name: digest_local_file(Path(spec["src"]) / name) for name in spec["names"]})


def raw_s3fs(spec: dict[str, Any]) -> Any:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_options(spec["endpoint"]))
    fs.ls(spec["bucket"])
    remote = [f"{spec['bucket']}/{spec['prefix']}/step-000000001/{name}" for name in spec["names"]]
    if spec["direction"] == "upload":
        local_src = [os.path.join(spec["src"], name) for name in spec["names"]]
        return lambda: fs.put(local_src, remote)
    local_dest = [os.path.join(spec["dest"], name) for name in spec["names"]]
    os.makedirs(spec["dest"], exist_ok=True)
    return lambda: fs.get(remote, local_dest)


def boto3_tuned(spec: dict[str, Any]) -> Any:
    import boto3
    from botocore.config import Config
    from s3transfer.manager import TransferConfig, TransferManager

    config = Config(
        max_pool_connections=32,
        s3={"payload_signing_enabled": False},
        request_checksum_calculation="when_required",
    )  # response validation stays: off, s3transfer's first GET asks a range past a small object's end
    client = boto3.client(
        "s3", endpoint_url=spec["endpoint"], aws_access_key_id=KEY, aws_secret_access_key=SECRET,
        region_name="us-east-1", config=config,
    )  # fmt: skip
    client.list_objects_v2(Bucket=spec["bucket"], MaxKeys=1)
    manager = TransferManager(
        client,
        TransferConfig(
            multipart_threshold=32 * MiB, multipart_chunksize=32 * MiB, max_request_concurrency=16
        ),
    )
    keys = [f"{spec['prefix']}/step-000000001/{name}" for name in spec["names"]]
    if spec["direction"] == "upload":
        srcs = [os.path.join(spec["src"], name) for name in spec["names"]]
        return lambda: [
            f.result()
            for f in [manager.upload(s, spec["bucket"], k) for s, k in zip(srcs, keys, strict=True)]
        ]
    os.makedirs(spec["dest"], exist_ok=True)
    dests = [os.path.join(spec["dest"], name) for name in spec["names"]]
    return lambda: [
        f.result() for f in [manager.download(spec["bucket"], k, d) for k, d in zip(keys, dests, strict=True)]
    ]


def raw_obstore(spec: dict[str, Any]) -> Any:
    from obstore.store import S3Store

    store = S3Store(
        spec["bucket"], endpoint=spec["endpoint"], access_key_id=KEY, secret_access_key=SECRET,
        region="us-east-1", unsigned_payload=True, client_options={"allow_http": True, "timeout": "1h"},
    )  # fmt: skip
    return obstore_transfer(store, spec)


def obstore_transfer(store: Any, spec: dict[str, Any]) -> Any:
    """The timed transfer of raw obstore on ``store`` (any obstore store): one ``obstore.put`` per file
    (16 MiB parts, 8 in flight), or one plain streamed GET per file; 8 files at once (in a pool of 8)."""
    import obstore

    obstore.list(store, prefix="nothing").collect()
    keys = [f"{spec['prefix']}/step-000000001/{name}" for name in spec["names"]]
    pool = ThreadPoolExecutor(8)
    if spec["direction"] == "upload":
        srcs = [Path(spec["src"]) / name for name in spec["names"]]

        def put(pair: tuple[Path, str]) -> None:
            obstore.put(store, pair[1], pair[0], chunk_size=16 * MiB, max_concurrency=8)

        return lambda: list(pool.map(put, zip(srcs, keys, strict=True)))
    os.makedirs(spec["dest"], exist_ok=True)

    def get(pair: tuple[str, str]) -> None:
        with open(pair[1], "wb") as handle:
            for chunk in obstore.get(store, pair[0]).stream():
                handle.write(chunk)

    pairs = list(zip(keys, [os.path.join(spec["dest"], name) for name in spec["names"]], strict=True))
    if len(pairs) == 1:
        return lambda: get(pairs[0])
    return lambda: list(pool.map(get, pairs))


CLIENTS = {
    "project": project,
    "project-written": project_written,
    "s3fs": raw_s3fs,
    "boto3": boto3_tuned,
    "obstore": raw_obstore,
}


def resume(spec: dict[str, Any]) -> Any:
    """A fresh machine's resume: find the newest checkpoint, pull it, ``torch.load`` it; or the best
    raw client's download of the same bytes and the same load."""
    import torch

    if spec["client"] == "project":
        from spot_callbacks.store import CheckpointStore

        store = CheckpointStore(
            f"s3://{spec['bucket']}/{spec['prefix']}", storage_options=s3_options(spec["endpoint"])
        )
        # As in training, where the preflight and the run lock come before the resume's pull and the
        # data plane's clients are built meanwhile (CheckpointStore.warm_data_plane): the raw client
        # below is built before the clock too.
        warming = store.warm_data_plane()
        store.committed()  # the first listing: connections open
        if warming is not None:
            warming.join()

        def run() -> None:
            info = store.latest()
            folder = store.pull(info.step, Path(spec["dest"]))
            torch.load(folder / spec["names"][0], weights_only=True, map_location="cpu")

        return run
    download = raw_obstore({**spec, "direction": "pull"})

    def run_raw() -> None:
        download()
        torch.load(Path(spec["dest"]) / spec["names"][0], weights_only=True, map_location="cpu")

    return run_raw


def measure(run: Any) -> dict[str, Any]:
    """Run the transfer ``run`` once: wall and CPU seconds, the RSS before it and the peak during it."""
    rss_before = rss_bytes()
    peak_reset = reset_peak_rss()
    cpu_before, started = cpu_s(), time.perf_counter()
    run()
    wall_s, cpu = time.perf_counter() - started, cpu_s() - cpu_before
    return {"wall_s": wall_s, "cpu_s": cpu, "rss_before": rss_before, "peak_rss": peak_rss_bytes(),
            "peak_reset": peak_reset}  # fmt: skip


def main() -> None:
    spec = json.loads(sys.argv[1])
    run = resume(spec) if spec.get("resume") else CLIENTS[spec["client"]](spec)
    print(json.dumps({**measure(run), "prefix": spec.get("prefix")}))


if __name__ == "__main__":
    main()
