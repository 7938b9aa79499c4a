"""Benchmark: the background persister vs raw fsspec transfers, against moto S3 and a local folder.

For every backend, in one run:

* **upload** -- ``Persister.submit`` of a local checkpoint folder (one big file + a medium one +
  a few small ones, like a model + optimizer state) timed from submit to commit, vs a raw
  ``fs.put`` of the same files to another prefix with the *same* filesystem object;
* **pull** -- ``CheckpointStore.pull`` into a fresh empty folder (no local-cache hit) vs a raw
  ``fs.get`` of the same remote objects.

Persister and raw measurements alternate inside every repeat (A/B/A/B), the page cache is flushed
(``os.sync``) before each timed step, and remote objects and local folders are deleted between
repeats. The table reports the median of the repeats; the ratio is persister / raw throughput.

Usage::

    python benchmarks/persist.py [--size-gb 1.0] [--repeats 3] [--backends s3,file] [--no-append]
    python benchmarks/persist.py --quick --results-file /tmp/bench.md   # a small check that it runs

The S3 server is ``python -m moto.server`` on a free loopback port, started and stopped here.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import xxhash
from _common import (
    add_common_args,
    apply_quick,
    check_scratch,
    choice_list,
    markdown_table,
    print_rich_table,
    record,
    section_head,
    versions_line,
)
from _servers import BACKENDS, open_store

from spot_callbacks.persist import Persister, PersistJob
from spot_callbacks.store import CheckpointStore
from spot_callbacks.store.layout import is_local_fs

BENCH_NAME = "persist: background persister vs raw fsspec put/get"
TARGET = "Target: ≥ 0.9× the raw throughput both ways"
BUCKET = "spot-bench"
WRITE_BLOCK = 64 * 2**20
READ_BLOCK = 8 * 2**20
QUICK = {"size_gb": 0.05, "repeats": 2}


# ---------------------------------------------------------------------------------- checkpoint
def checkpoint_layout(size_bytes: int) -> dict[str, int]:
    """File name -> size: ~90 % model weights, ~10 % optimizer extras, a few small files."""
    small = {"trainer_state.json": 4_096, "rng_state.pth": 16_384, "scheduler.pt": 1_024}
    big = int(size_bytes * 0.9)
    medium = max(size_bytes - big - sum(small.values()), 1)
    return {"model.pt": big, "optimizer_extra.pt": medium, **small}


def write_checkpoint_folder(folder: Path, layout: dict[str, int]) -> None:
    """Incompressible random bytes (so no layer can cheat with compression or sparse files)."""
    folder.mkdir(parents=True)
    block = os.urandom(WRITE_BLOCK)  # one random block reused with a per-block salt: fast to make
    for name, size in layout.items():
        with open(folder / name, "wb") as handle:
            written = 0
            while written < size:
                n = min(WRITE_BLOCK, size - written)
                handle.write(written.to_bytes(8, "little") + block[: n - 8] if n > 8 else os.urandom(n))
                written += n


def check_disk(scratch: Path, size_bytes: int, backends: list[str]) -> None:
    # Source + two downloads, + two remote copies for file://, + moto's spill files for s3
    # (it keeps objects over ~5 MB in temp files; set to the scratch dir).
    copies = 3 + (2 if "file" in backends else 0) + (3 if "s3" in backends else 0)
    check_scratch(
        scratch,
        copies * size_bytes + 512 * 2**20,
        3 * size_bytes,
        "page-cache misses will make the numbers noisier",
        hint="use --scratch or a smaller --size-gb",
    )


def xxh3_file(path: Path) -> str:
    """One xxh3 pass over a file, as ``pull`` makes over what it downloaded."""
    hasher = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        while block := handle.read(READ_BLOCK):
            hasher.update(block)
    return hasher.hexdigest()


# ------------------------------------------------------------------------------------- measure
@dataclass
class Samples:
    persister_s: list[float] = field(default_factory=list)
    raw_s: list[float] = field(default_factory=list)
    extra: dict[str, list[float]] = field(default_factory=dict)

    def add_extra(self, key: str, value: float) -> None:
        self.extra.setdefault(key, []).append(value)


@dataclass
class Target:
    name: str
    base_url: str
    storage_options: dict[str, Any]


def flush_page_cache_writes() -> None:
    """Write back dirty pages now, so one step's writeback is not billed to the next one."""
    os.sync()


def check_local(folder: Path, layout: dict[str, int]) -> None:
    for name, size in layout.items():
        actual = (folder / name).stat().st_size
        if actual != size:
            raise RuntimeError(f"{folder / name} is {actual} bytes, expected {size}")


def check_remote(fs: fsspec.AbstractFileSystem, root: str, layout: dict[str, int]) -> None:
    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache()
    sizes = {Path(path).name: info["size"] for path, info in fs.find(root, detail=True).items()}
    for name, size in layout.items():
        if sizes.get(name) != size:
            raise RuntimeError(f"{root}/{name} is {sizes.get(name)} bytes remotely, expected {size}")


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def timed(samples: list[float], fn: Callable[[], object]) -> None:
    flush_page_cache_writes()
    started = time.perf_counter()
    fn()
    samples.append(time.perf_counter() - started)


@dataclass
class Repeat:
    """One repeat on one backend: a fresh prefix, the same filesystem object for both sides."""

    target: Target
    rep: int
    src: Path
    names: list[str]
    scratch: Path
    step: int = 1000

    def __post_init__(self) -> None:
        self.prefix = f"{self.target.base_url}/rep-{self.rep}-{uuid.uuid4().hex[:6]}"
        self.store = CheckpointStore(f"{self.prefix}/persister", self.target.storage_options)
        self.fs = self.store.fs  # the raw baseline uses the persister's filesystem object (its options too)
        _, self.raw_root = fsspec.core.url_to_fs(f"{self.prefix}/raw", **self.target.storage_options)
        self.local = is_local_fs(self.store.fs)
        self.folders: list[Path] = []

    def folder(self, kind: str) -> Path:
        self.folders.append(self.scratch / f"{self.target.name}-{kind}-{self.rep}")
        return self.folders[-1]

    def persister_upload(self, upload: Samples) -> None:
        persister = Persister(self.store, keep_last=3)
        started = time.perf_counter()
        persister.submit(
            PersistJob(
                step=self.step, reason="manual", framework="bench", local_dir=self.src, owns_local_dir=False
            )
        )
        persister.wait()
        idle_s = time.perf_counter() - started
        persister.close()
        if persister.failures:
            raise persister.failures[0]
        record = persister.records[-1]
        upload.persister_s.append(record.queued_s + record.upload_s)  # submit -> manifest written
        upload.add_extra("submit_to_idle_s", idle_s)  # + retention (prune) after the commit
        upload.add_extra("write_checkpoint_s", record.upload_s)

    def raw_put(self, sub: str, durable: bool = False) -> None:
        root = f"{self.raw_root}/{sub}"
        if self.local:
            self.fs.makedirs(root, exist_ok=True)
        self.fs.put([str(self.src / n) for n in self.names], [f"{root}/{n}" for n in self.names])
        if durable:
            for n in self.names:
                fsync_file(Path(root) / n)

    def pull(self, dest: Path) -> None:
        self.store.pull(self.step, dest)

    def raw_get(self, dest: Path, verify: bool = False) -> None:
        dest.mkdir(parents=True)
        step_root = self.store.step_path(self.step)
        self.fs.get([f"{step_root}/{n}" for n in self.names], [str(dest / n) for n in self.names])
        if verify:
            for n in self.names:
                xxh3_file(dest / n)

    def cleanup(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.prefix, recursive=True)
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)


def run_target(
    target: Target, src: Path, layout: dict[str, int], repeats: int, scratch: Path
) -> dict[str, Samples]:
    """Measure one backend; keys are table directions, each with persister and raw samples.

    Inside a repeat the variants run back to back, persister first on even repeats and last on
    odd ones, so neither side always meets a fuller server or a dirtier page cache.
    For file:// two more raw baselines are timed: put + fsync (the persister makes a local
    upload durable) and get + one xxh3 pass (``pull`` verifies what it downloaded).
    """
    upload, pull = Samples(), Samples()
    upload_durable, pull_verified = Samples(upload.persister_s), Samples(pull.persister_s)
    local = target.name == "file"
    for rep in range(repeats):
        r = Repeat(target, rep, src, list(layout), scratch)
        try:
            pull_dest, get_dest = r.folder("pull") / "ckpt", r.folder("get")
            ups: list[Callable[[], None]] = [
                functools.partial(r.persister_upload, upload),
                functools.partial(timed, upload.raw_s, functools.partial(r.raw_put, "put")),
            ]
            pulls: list[Callable[[], None]] = [
                functools.partial(timed, pull.persister_s, functools.partial(r.pull, pull_dest)),
                functools.partial(timed, pull.raw_s, functools.partial(r.raw_get, get_dest)),
            ]
            if local:
                put_fsync = functools.partial(r.raw_put, "put-fsync", durable=True)
                get_xxh3 = functools.partial(r.raw_get, r.folder("get-xxh3"), verify=True)
                ups.append(functools.partial(timed, upload_durable.raw_s, put_fsync))
                pulls.append(functools.partial(timed, pull_verified.raw_s, get_xxh3))
            if rep % 2:
                ups.reverse()
                pulls.reverse()
            for measure in ups:
                measure()
            check_remote(r.fs, r.store.step_path(r.step), layout)
            check_remote(r.fs, f"{r.raw_root}/put", layout)
            for measure in pulls:
                measure()
            check_local(pull_dest, layout)
            check_local(get_dest, layout)
            print(
                f"  {target.name} repeat {rep + 1}/{repeats} ({'raw' if rep % 2 else 'persister'} first): "
                f"upload persister {upload.persister_s[-1]:.2f}s raw {upload.raw_s[-1]:.2f}s"
                + (f" raw+fsync {upload_durable.raw_s[-1]:.2f}s" if local else "")
                + f" | pull persister {pull.persister_s[-1]:.2f}s raw {pull.raw_s[-1]:.2f}s"
                + (f" raw+xxh3 {pull_verified.raw_s[-1]:.2f}s" if local else ""),
                flush=True,
            )
        finally:
            r.cleanup()
    results = {"upload": upload, "pull": pull}
    if local:
        results["upload vs put+fsync"] = upload_durable
        results["pull vs get+xxh3"] = pull_verified
    return results


# -------------------------------------------------------------------------------------- report
@dataclass
class Row:
    backend: str
    direction: str
    persister_s: float
    persister_mbs: float
    raw_s: float
    raw_mbs: float
    ratio: float
    ratio_range: str


def summarize(results: dict[str, dict[str, Samples]], total_bytes: int) -> list[Row]:
    rows = []
    for backend, by_dir in results.items():
        for direction, samples in by_dir.items():
            p = statistics.median(samples.persister_s)
            r = statistics.median(samples.raw_s)
            per_rep = [rs / ps for ps, rs in zip(samples.persister_s, samples.raw_s, strict=True)]
            rows.append(
                Row(
                    backend=backend,
                    direction=direction,
                    persister_s=p,
                    persister_mbs=total_bytes / 1e6 / p,
                    raw_s=r,
                    raw_mbs=total_bytes / 1e6 / r,
                    ratio=r / p,
                    ratio_range=f"{min(per_rep):.2f}–{max(per_rep):.2f}",
                )
            )
    return rows


HEADERS = (
    "backend",
    "direction",
    "persister s",
    "persister MB/s",
    "raw s",
    "raw MB/s",
    "ratio (persister/raw)",
    "per-repeat ratios",
)


def row_cells(row: Row) -> list[str]:
    return [
        row.backend,
        row.direction,
        f"{row.persister_s:.2f}",
        f"{row.persister_mbs:.0f}",
        f"{row.raw_s:.2f}",
        f"{row.raw_mbs:.0f}",
        f"{row.ratio:.2f}×",
        row.ratio_range,
    ]


def markdown_section(
    rows: list[Row], args: argparse.Namespace, layout: dict[str, int], details: str
) -> list[str]:
    command = (
        f"python benchmarks/persist.py --size-gb {args.size_gb} --repeats {args.repeats} "
        f"--backends {','.join(args.backends)}"
    )
    return [
        *section_head(BENCH_NAME, command, args.versions),
        f"- Checkpoint: {sum(layout.values()) / 1e6:.0f} MB in {len(layout)} files "
        f"(largest {max(layout.values()) / 1e6:.0f} MB); median of {args.repeats} interleaved repeats; "
        "S3 is moto on loopback. Persister upload = submit → manifest committed (digests computed "
        "during the upload); pull = `store.pull` into an empty folder (download + checksum).",
        "",
        *markdown_table(HEADERS, [row_cells(row) for row in rows]),
        "",
        details,
        "",
        TARGET,
        "",
    ]


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gb", type=float, default=1.0, help="checkpoint size in GB (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per backend (default 3)")
    parser.add_argument("--backends", default="s3,file", help="comma-separated subset of s3,file")
    parser.add_argument("--scratch", default=tempfile.gettempdir(), help="where the temp folder goes")
    add_common_args(parser)
    args = parser.parse_args(argv)
    apply_quick(parser, args, QUICK)
    args.backends = choice_list(parser, args.backends, BACKENDS, "--backends")
    if args.size_gb <= 0 or args.repeats < 1:
        parser.error("--size-gb must be > 0 and --repeats >= 1")
    return args


def measure(args: argparse.Namespace, scratch: Path, layout: dict[str, int]) -> dict[str, dict[str, Samples]]:
    """Write the source checkpoint, then every backend in turn, each against its own fresh store."""
    src = scratch / "checkpoint"
    print(f"writing a {sum(layout.values()) / 1e6:.0f} MB checkpoint into {src} ...", flush=True)
    write_checkpoint_folder(src, layout)
    results: dict[str, dict[str, Samples]] = {}
    for backend in args.backends:
        with open_store(backend, scratch, BUCKET) as (base_url, options):
            target = Target(backend, f"{base_url}/bench", options)
            print(f"{backend}: {args.repeats} repeats ...", flush=True)
            results[backend] = run_target(target, src, layout, args.repeats, scratch)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.versions = versions_line()  # now, so a failure here costs no measurement
    layout = checkpoint_layout(int(args.size_gb * 1e9))
    total = sum(layout.values())
    check_disk(Path(args.scratch), total, args.backends)
    scratch = Path(tempfile.mkdtemp(prefix="spot-bench-persist-", dir=args.scratch))
    began = time.perf_counter()
    try:
        results = measure(args, scratch, layout)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = summarize(results, total)
    title = f"{BENCH_NAME} ({total / 1e6:.0f} MB, median of {args.repeats})"
    print_rich_table(HEADERS, [row_cells(row) for row in rows], title, left=("backend", "direction"))
    details = "Details (medians): " + "; ".join(
        f"{backend} upload submit→idle incl. retention {statistics.median(r['upload'].extra['submit_to_idle_s']):.2f}s, "
        f"write_checkpoint {statistics.median(r['upload'].extra['write_checkpoint_s']):.2f}s"
        for backend, r in results.items()
    )
    print(details)
    print(f"total time {time.perf_counter() - began:.0f}s")
    record(args, markdown_section(rows, args, layout, details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
