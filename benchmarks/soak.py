"""Soak: kill -9 a training run that checkpoints every step, hundreds of times, on S3 (moto) and a local folder.

Same harness as ``tests/test_crash.py`` (``tests/crash_harness.py``): after every kill, ``latest()``
is None or verifies deeply, never goes back, and the next run resumes exactly there; every
``--complete-every`` kills a lineage trains to the end. Prints a table and appends it to BENCHMARKS.md.

    python benchmarks/soak.py --kills 100          # split evenly over file and s3
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from _common import (
    REPO_ROOT,
    S3_KEY,
    S3_SECRET,
    append_markdown,
    machine_line,
    markdown_table,
    moto_server,
    print_rich_table,
    versions_line,
)

sys.path.insert(0, str(REPO_ROOT / "tests"))
from crash_harness import CrashHarness, CrashResult  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100, help="total kills, split over the backends")
    parser.add_argument("--backends", default="file,s3")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--max-delay-s", type=float, default=1.5)
    parser.add_argument("--complete-every", type=int, default=10)
    parser.add_argument("--no-record", action="store_true", help="do not append to BENCHMARKS.md")
    args = parser.parse_args()

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="spot-soak-"))
    started = time.monotonic()
    results: dict[str, CrashResult] = {}
    try:
        with moto_server(workdir) if "s3" in backends else _nothing() as endpoint:
            for index, backend in enumerate(backends):
                kills = args.kills // len(backends) + (1 if index < args.kills % len(backends) else 0)
                if backend == "file":
                    url, options = str(workdir / "store"), {}
                elif backend == "s3":
                    options = {"key": S3_KEY, "secret": S3_SECRET, "endpoint_url": endpoint}
                    import s3fs

                    s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir("soak")
                    url = "s3://soak/run"
                else:
                    raise SystemExit(f"backend {backend!r} is not one of file, s3")
                harness = CrashHarness(
                    url, options, workdir / backend, seed=args.seed + index, max_delay_s=args.max_delay_s,
                    max_epochs=40 if backend == "file" else 20,
                    log=lambda line, b=backend: print(f"[{b}] {line}", flush=True),
                )  # fmt: skip
                results[backend] = harness.run(kills, complete_every=args.complete_every)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    total_s = time.monotonic() - started

    headers = ["backend", "kills", "commits seen", "resumes", "runs to completion", "kills before any commit",
               "failures", "seconds"]  # fmt: skip
    rows = [
        [backend, str(r.kills), str(r.commits_seen), str(r.resumes), str(r.completions),
         str(r.empty_after_kill), str(len(r.failures)), f"{r.seconds:.0f}"]
        for backend, r in results.items()
    ]  # fmt: skip
    print_rich_table(headers, rows, "soak: kill -9 at random moments", left=["backend"])
    failures = [f for r in results.values() for f in r.failures]
    for failure in failures:
        print(f"FAILURE: {failure}")
    if not args.no_record:
        command = " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]])
        section = "\n".join(
            [
                "",
                "## soak: kill -9 at random moments while checkpointing every step",
                "",
                f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
                f"- Machine: {machine_line()}",
                f"- Versions: {versions_line()}",
                f"- Command: `{command}` ({total_s:.0f}s)",
                "- Harness: `tests/crash_harness.py` (`tests/scripts/lightning_run.py`, a checkpoint every step, "
                f"keep_last=2). Kill delay uniform in [0, {args.max_delay_s}] s after the first step past the "
                "resume point; after each kill `latest()` is None or verifies (every byte), never goes back, "
                f"and the next run resumes exactly at it; every {args.complete_every} kills a lineage trains "
                "to the end. S3 is moto on loopback.",
                "",
                *markdown_table(headers, rows),
                "",
                f"Result: **{'PASS' if not failures else 'FAIL'}** ({len(failures)} failures).",
                "",
            ]
        )
        print(f"appended to {append_markdown(section)}")
    return 1 if failures else 0


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
