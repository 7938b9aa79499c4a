"""Benchmark: the project's payload transfers vs the raw S3 clients, on a fast and a cloud-shaped link.

In one run, interleaved (the client order rotates every repeat), for one file and for 8 files of
the same total size: ``CommitWriter.write_checkpoint`` / ``CheckpointStore.pull`` against raw
s3fs, boto3's TransferManager tuned and obstore (see ``_transfer_clients.py``). Each transfer
runs in a fresh process, measured for wall time, MB/s, CPU-s per GB (all its threads) and peak
extra RSS (the kernel's high-water mark over the RSS before it; no sampler thread in any client's
process); every pull is checked byte-exact against the source (xxh3), which checks that client's
upload too. Then a resume: a Lightning-style checkpoint found, pulled and ``torch.load``-ed on an
empty folder, vs obstore's download of the same bytes plus the same load.

Two links (``--link``), interleaved within each repeat: ``fast``, every client straight to the
local server; ``shaped``, every client through ``_shaping_proxy.py`` in front of it, a link shaped
like a cloud bucket's (``--conn-mbps`` per connection, ``--total-mbps`` in all, ``--latency-ms``
before each answer's first byte), where one stream per file is capped and parallel requests pay.
The proxy's own CPU per GB is in the table: it shares the box's cores with the clients.

The server is nanio (PyPI, pip-installed into this environment here if missing; it is no
dependency of the project): moto is 5-10x slower than any client and would hide their costs.

Usage::

    python benchmarks/transfer.py [--size-mb 2048] [--repeats 3] [--resume-mb 1024] [--link both]
    python benchmarks/transfer.py --quick --no-append      # a small check that it runs
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash
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
from _servers import free_port, stop_server
from _shaping_proxy import ShapingProxy
from _transfer_clients import KEY, SECRET

BENCH_NAMES = {
    ("fast",): "transfer: the project's upload and pull vs raw S3 clients (nanio on loopback)",
    (
        "shaped",
    ): "transfer: the project's upload and pull vs raw S3 clients (nanio behind a cloud-shaped link)",
    (
        "fast",
        "shaped",
    ): "transfer: the project's upload and pull vs raw S3 clients (nanio, fast and cloud-shaped links)",
}
LINKS = ("fast", "shaped")
CLIENTS = ("project", "project-written", "s3fs", "boto3", "obstore")
DEFAULT_CLIENTS = ("project", "s3fs", "boto3", "obstore")
RAW = ("s3fs", "boto3", "obstore")
LAYOUTS = (1, 8)
BUCKET = "spot-bench"
MiB = 2**20
QUICK = {"size_mb": 64, "repeats": 1, "resume_mb": 32}
WORKER = Path(__file__).with_name("_transfer_clients.py")


# ---------------------------------------------------------------------------------- the server
def ensure_nanio() -> None:
    if importlib.util.find_spec("nanio") is None:
        print("installing nanio (the benchmark's S3 server) with pip", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "nanio"], check=True)


@contextlib.contextmanager
def nanio_server(data_dir: Path, workers: int, key: str = KEY, secret: str = SECRET) -> Iterator[str]:
    """nanio on a free loopback port, its objects under ``data_dir``; stopped by the PID started."""
    port = free_port()
    env = {**os.environ, "NANIO_ACCESS_KEY": key, "NANIO_SECRET_KEY": secret}
    log = open(data_dir.parent / "nanio.log", "wb")  # noqa: SIM115 - closed below
    argv = [sys.executable, "-m", "nanio", "serve", "--data-dir", str(data_dir), "--host", "127.0.0.1",
            "--port", str(port), "--workers", str(workers), "--no-access-log", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _answers(endpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"nanio did not start: {(data_dir.parent / 'nanio.log').read_text()[-2000:]}"
                )
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
        yield endpoint
    finally:
        stop_server(proc)
        log.close()


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                        region_name="us-east-1")  # fmt: skip


def delete_prefix(client: Any, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


# ---------------------------------------------------------------------------------- the data
def make_sources(root: Path, size_bytes: int) -> dict[int, dict[str, str]]:
    """For each layout, a folder of incompressible files summing to ``size_bytes``; name -> xxh3."""
    sources: dict[int, dict[str, str]] = {}
    block = os.urandom(16 * MiB)
    for files in LAYOUTS:
        folder = root / f"src-{files}"
        folder.mkdir(parents=True)
        digests = {}
        for index in range(files):
            name = "state.ckpt" if files == 1 else f"shard-{index}.bin"
            hasher, left, salt = xxhash.xxh3_64(), size_bytes // files, 0
            with open(folder / name, "wb") as handle:
                while left:
                    piece = (salt.to_bytes(8, "little") + block[8:])[: min(left, len(block))]
                    handle.write(piece)
                    hasher.update(piece)
                    left, salt = left - len(piece), salt + 1
            digests[name] = hasher.hexdigest()
        sources[files] = digests
    return sources


def same_bytes(folder: Path, digests: dict[str, str]) -> bool:
    for name, expected in digests.items():
        hasher = xxhash.xxh3_64()
        with open(folder / name, "rb") as handle:
            while block := handle.read(8 * MiB):
                hasher.update(block)
        if hasher.hexdigest() != expected:
            return False
    return True


def run_worker(spec: dict[str, Any], tries: int = 2) -> dict[str, Any]:
    """One timed transfer in a fresh process; a failed one (a loaded box's server can drop a multipart
    upload) is tried once more on a fresh prefix and said, never silently counted."""
    for attempt in range(1, tries + 1):
        done = subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], capture_output=True, text=True)
        if done.returncode == 0:
            return json.loads(done.stdout.strip().splitlines()[-1])
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        print(f"{spec['client']} {spec.get('direction', 'resume')} failed (try {attempt} of {tries}): {last}",
              file=sys.stderr, flush=True)  # fmt: skip
        spec = {**spec, "prefix": f"{spec['prefix']}-retry{attempt}"}
        if spec.get("direction") == "pull":
            break  # the objects are under the upload's prefix: a pull is not retried elsewhere
    raise SystemExit(f"{spec['client']} {spec.get('direction', 'resume')} failed:\n{done.stderr[-3000:]}")


# ---------------------------------------------------------------------------------- the runs
class Link:
    """Where the clients of one link send their requests, and the proxy's CPU on the way (None: none)."""

    def __init__(self, name: str, endpoint: str, proxy: ShapingProxy | None = None) -> None:
        self.name, self.endpoint, self.proxy = name, endpoint, proxy

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        """:func:`run_worker` on this link, with the proxy's CPU seconds meanwhile (``proxy_cpu_s``)."""
        before = self.proxy.cpu_s() if self.proxy else 0.0
        measured = run_worker({**spec, "endpoint": self.endpoint})
        return {**measured, "proxy_cpu_s": self.proxy.cpu_s() - before if self.proxy else None}


def transfers(
    args: argparse.Namespace,
    links: list[Link],
    server: str,
    scratch: Path,
    sources: dict[int, dict[str, str]],
) -> list[dict]:
    client = s3_client(server)
    results = []
    for repeat in range(args.repeats):
        for link in links if repeat % 2 == 0 else links[::-1]:
            for files in args.layouts:
                order = (
                    args.clients[repeat % len(args.clients) :] + args.clients[: repeat % len(args.clients)]
                )
                for name in order:
                    results += one_client(args, link, repeat, files, name, scratch, sources)
                    delete_prefix(client, f"r{repeat}-{link.name}-{files}-{name}")  # and a retried upload's
    return results


def one_client(
    args: argparse.Namespace,
    link: Link,
    repeat: int,
    files: int,
    name: str,
    scratch: Path,
    sources: dict[int, dict[str, str]],
) -> list[dict]:
    """One client's upload then pull of one layout on one link, the pull checked byte-exact."""
    prefix = f"r{repeat}-{link.name}-{files}-{name}"
    base = {"client": name, "bucket": BUCKET, "prefix": prefix, "names": sorted(sources[files]),
            "scratch": str(scratch / f"w-{prefix}")}  # fmt: skip
    up = link.run({**base, "direction": "upload", "src": str(scratch / f"src-{files}")})
    dest = scratch / f"dest-{prefix}"
    down = link.run({**base, "prefix": up.get("prefix", prefix), "direction": "pull", "dest": str(dest)})
    if not same_bytes(dest, sources[files]):
        raise SystemExit(
            f"{name}: the pulled bytes of {files} file(s) differ from the source ({link.name} link)"
        )
    results = []
    for direction, measured in (("upload", up), ("pull", down)):
        results.append(
            {"link": link.name, "client": name, "files": files, "direction": direction, **measured}
        )
        rate = args.size_bytes / measured["wall_s"] / 1e6
        print(f"repeat {repeat + 1} {link.name:6s} {files} file(s) {name:8s} {direction:6s} {rate:7.0f} MB/s "
              f"{measured['cpu_s'] / (args.size_bytes / 1e9):5.2f} CPU-s/GB", flush=True)  # fmt: skip
    shutil.rmtree(dest)
    shutil.rmtree(scratch / f"w-{prefix}", ignore_errors=True)
    return results


def lightning_checkpoint(path: Path, size_bytes: int) -> str:
    """A Lightning-shaped checkpoint of ~``size_bytes`` (weights plus Adam moments), saved with torch.save."""
    import torch

    layers = max(1, size_bytes // (3 * 4 * 1024 * 1024))
    weights = {f"model.layer{i}.weight": torch.randn(1024, 1024) for i in range(layers)}
    moments = {
        i: {"exp_avg": torch.randn(1024, 1024), "exp_avg_sq": torch.rand(1024, 1024)} for i in range(layers)
    }
    state = {"epoch": 3, "global_step": 1200, "pytorch-lightning_version": "2.6.6", "state_dict": weights,
             "optimizer_states": [{"state": moments, "param_groups": [{"lr": 1e-3, "params": list(range(layers))}]}],
             "lr_schedulers": [], "callbacks": {}, "loops": {}}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return "state.ckpt"


def resumes(args: argparse.Namespace, links: list[Link], server: str, scratch: Path) -> list[dict]:
    from spot_callbacks.store import CheckpointStore, CommitWriter

    folder = scratch / "resume-src"
    name = lightning_checkpoint(folder / "state.ckpt", args.resume_mb * MiB)
    store = CheckpointStore(f"s3://{BUCKET}/resume", storage_options={"key": KEY, "secret": SECRET,
                                                                      "endpoint_url": server})  # fmt: skip
    CommitWriter(store).write_checkpoint(1, folder, reason="interval", framework="lightning")
    size = (folder / name).stat().st_size
    results = []
    for repeat in range(args.repeats):
        for link in links if repeat % 2 == 0 else links[::-1]:
            for who in ("project", "obstore") if repeat % 2 == 0 else ("obstore", "project"):
                dest = scratch / f"resume-dest-{link.name}-{who}-{repeat}"
                spec = {"resume": True, "client": who, "bucket": BUCKET, "prefix": "resume", "names": [name],
                        "dest": str(dest), "scratch": str(scratch)}  # fmt: skip
                measured = link.run(spec)
                results.append({"link": link.name, "client": who, "size": size, **measured})
                print(f"resume {repeat + 1} {link.name:6s} {who:8s} {measured['wall_s']:.2f}s", flush=True)
                shutil.rmtree(dest)
    return results


# ---------------------------------------------------------------------------------- the report
def summarize(args: argparse.Namespace, results: list[dict]) -> tuple[list[list[str]], dict[str, float]]:
    gb = args.size_bytes / 1e9
    rows, rates = [], {}
    for link, files, direction in [
        (k, f, d) for k in args.links for f in args.layouts for d in ("upload", "pull")
    ]:
        cell: dict[str, dict[str, Any]] = {}
        for name in args.clients:
            runs = [
                r
                for r in results
                if (r["link"], r["client"], r["files"], r["direction"]) == (link, name, files, direction)
            ]
            proxy = [r["proxy_cpu_s"] / gb for r in runs if r["proxy_cpu_s"] is not None]
            cell[name] = {
                "wall": med([r["wall_s"] for r in runs]),
                "rate": med([args.size_bytes / r["wall_s"] / 1e6 for r in runs]),
                "cpu": med([r["cpu_s"] / gb for r in runs]),
                "rss": max(r["peak_rss"] - r["rss_before"] for r in runs) / 1e6,
                "rates": [args.size_bytes / r["wall_s"] / 1e6 for r in runs],
                "proxy": f"{med(proxy):.2f}" if proxy else "–",
            }
        raw = [n for n in args.clients if n in RAW]
        best = max(raw, key=lambda n: cell[n]["rate"]) if raw else None
        for name in args.clients:
            c = cell[name]
            ratio = f"{c['rate'] / cell[best]['rate']:.2f}×" if best else "–"
            cpu_ratio = f"{c['cpu'] / cell[best]['cpu']:.2f}×" if best else "–"
            spread = "–".join(f"{v:.0f}" for v in (min(c["rates"]), max(c["rates"])))
            rows.append([link, f"{files}", direction, name + (" (best raw)" if name == best else ""),
                         f"{c['wall']:.2f}", f"{c['rate']:.0f}", spread, ratio, f"{c['cpu']:.2f}", cpu_ratio,
                         f"{c['rss']:.0f}", c["proxy"]])  # fmt: skip
            rates[f"{link}/{name}/{files}/{direction}"] = c["rate"]
        if best:
            rates[f"{link}/best/{files}/{direction}"] = cell[best]["rate"]
    return rows, rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=int, default=2048, help="bytes per checkpoint, all files together")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", default=",".join(DEFAULT_CLIENTS))
    parser.add_argument("--layouts", default="1,8", help="numbers of files the checkpoint is split into")
    parser.add_argument(
        "--resume-mb", type=int, default=1024, help="the resume's checkpoint (0: no resume run)"
    )
    parser.add_argument("--server-workers", type=int, default=2, help="nanio worker processes")
    parser.add_argument("--link", default="both", choices=[*LINKS, "both"],
                        help="fast: straight to the server; shaped: through the cloud-shaped proxy; both (interleaved)")  # fmt: skip
    parser.add_argument("--conn-mbps", type=float, default=100.0, help="shaped link: MB/s per connection")
    parser.add_argument("--total-mbps", type=float, default=400.0, help="shaped link: MB/s in all, each way")
    parser.add_argument(
        "--latency-ms", type=float, default=25.0, help="shaped link: before each answer's first byte"
    )
    parser.add_argument("--scratch", default=None, help="folder for sources, copies and the server's objects")
    parser.add_argument("--note", default="", help="a line added to the section (e.g. what else ran)")
    add_common_args(parser)
    args = parser.parse_args()
    apply_quick(parser, args, QUICK)
    args.clients = choice_list(parser, args.clients, CLIENTS, "--clients")
    args.layouts = [int(n) for n in choice_list(parser, args.layouts, [str(n) for n in LAYOUTS], "--layouts")]
    args.size_bytes = args.size_mb * MiB
    args.links = list(LINKS) if args.link == "both" else [args.link]
    ensure_nanio()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the server and cleans up
    scratch = Path(tempfile.mkdtemp(prefix="spot-transfer-", dir=args.scratch))
    check_scratch(scratch, 5 * args.size_bytes + 3 * args.resume_mb * MiB, 2 * args.size_bytes,
                  "the page cache will not hold the server's copy")  # fmt: skip
    load_before, started = load_average(), time.time()
    try:
        sources = make_sources(scratch, args.size_bytes)
        (scratch / "objects" / BUCKET).mkdir(parents=True)
        with (
            nanio_server(scratch / "objects", args.server_workers) as server,
            contextlib.ExitStack() as stack,
        ):
            links = []
            for name in args.links:
                if name == "fast":
                    links.append(Link(name, server))
                else:
                    port = int(server.rsplit(":", 1)[1])
                    proxy = stack.enter_context(
                        ShapingProxy(port, args.conn_mbps, args.total_mbps, args.latency_ms)
                    )
                    links.append(Link(name, proxy.url, proxy))
                    args.shape = proxy.shape
            results = transfers(args, links, server, scratch, sources)
            resumed = resumes(args, links, server, scratch) if args.resume_mb else []
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(args, results, resumed, load_before, time.time() - started)


def report(
    args: argparse.Namespace, results: list[dict], resumed: list[dict], load_before: str, took_s: float
) -> None:
    headers = ["link", "files", "direction", "client", "wall s", "MB/s", "MB/s range", "× best raw", "CPU-s/GB",
               "CPU × best raw", "peak extra RSS MB", "proxy CPU-s/GB"]  # fmt: skip
    rows, rates = summarize(args, results)
    bench_name = BENCH_NAMES[tuple(args.links)]
    print_rich_table(headers, rows, bench_name, left=["link", "direction", "client"])
    lines = section_head(
        bench_name,
        "python " + shlex.join(sys.argv),
        versions_line(("torch", "fsspec", "s3fs", "boto3", "s3transfer", "obstore", "nanio", "xxhash")),
        f" ({took_s:.0f}s)",
    )
    lines += [
        f"- Checkpoint: {args.size_mb} MiB as 1 file and as 8 files; median of {args.repeats} interleaved repeats "
        "(client order rotated); each transfer a fresh process, clients built and warmed before the clock; "
        "every pull checked byte-exact (xxh3) against the source. Server: nanio "
        f"({args.server_workers} workers) on loopback, same 2 cores.",
        "- Measured without a sampler in any client's process: CPU from the kernel's rusage of the process "
        "(all threads), peak extra RSS = the kernel's VmHWM, reset to the RSS just before the clock "
        "(`/proc/self/clear_refs`), minus that RSS. Raw obstore = plain `obstore.get(store, key).stream()` "
        "per file (8 files in 8 threads); boto3 = TransferManager, 16 threads, 32 MiB parts.",
        "- Project = `CommitWriter.write_checkpoint` with no digests handed over (each part hashed from the "
        "bytes the upload reads to send it: the path of a Hugging Face checkpoint folder) and "
        "`CheckpointStore.pull` (every checksum "
        "verified) with the default data plane (`SPOT_DATA_PLANE=auto`); project-written = the same upload "
        "with the digests handed over, as a Lightning or engine checkpoint (hashed by `torch.save`'s writer) "
        "and a sharded DCP one (hashed as `dcp.save` writes) hand them: no pass beside the upload.",
        f"- Load average (1/5/15 min) at start: {load_before}; at end: {load_average()}.",
    ]
    if "shaped" in args.links:
        lines.append(
            f"- Links: fast = straight to nanio; shaped = through `benchmarks/_shaping_proxy.py` "
            f"({args.shape}; its own process, splice, its CPU per GB in the last column)."
        )
    if args.note:
        lines.append(f"- Note: {args.note}")
    lines += ["", *markdown_table(headers, rows), ""]
    for link in args.links:
        if "project" in args.clients and 8 in args.layouts and f"{link}/best/8/upload" in rates:
            mine, best = rates[f"{link}/project/8/upload"], rates[f"{link}/best/8/upload"]
            lines.append(
                f"GB persisted within 30 s and 120 s ({link} link, 8-file upload rate, median): project "
                f"{mine * 30 / 1e3:.1f} GB / {mine * 120 / 1e3:.1f} GB; best raw client {best * 30 / 1e3:.1f} GB "
                f"/ {best * 120 / 1e3:.1f} GB."
            )
            lines.append("")
    for link in args.links if resumed else []:
        project_s = med([r["wall_s"] for r in resumed if (r["link"], r["client"]) == (link, "project")])
        raw_s = med([r["wall_s"] for r in resumed if (r["link"], r["client"]) == (link, "obstore")])
        size_mb = resumed[0]["size"] / 1e6
        line = (f"Resume of a {size_mb:.0f} MB Lightning checkpoint on an empty folder, {link} link (latest + "
                f"pull + `torch.load(weights_only=True)`): project {project_s:.2f} s vs obstore download + load "
                f"{raw_s:.2f} s: {project_s / raw_s:.2f}× (median of {args.repeats}; target ≤ 1.1×).")  # fmt: skip
        print(line)
        lines += [line, ""]
    lines.append("Targets: ≥ 0.9× the best raw client's MB/s for upload and pull, CPU-s/GB ≤ 1.3× its, "
                 "peak extra RSS ≤ 1.1× the largest payload file.")  # fmt: skip
    lines.append("")
    record(args, lines)


if __name__ == "__main__":
    main()
