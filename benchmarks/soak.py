"""Soak: kill -9 a training run that checkpoints every step, hundreds of times, on S3 (moto) and a local folder.

Same harness as ``tests/test_crash.py`` (``tests/helpers/crash_harness.py``): after every kill,
``latest()`` is None or verifies deeply, never goes back, and the next run resumes exactly there;
every ``--complete-every`` kills a lineage trains to the end. Prints a table and appends it to
BENCHMARKS.md.

    python benchmarks/soak.py --kills 100          # split evenly over file and s3
    python benchmarks/soak.py --quick --results-file /tmp/bench.md   # a check that it runs (4 kills)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    REPO_ROOT,
    add_common_args,
    apply_quick,
    choice_list,
    markdown_table,
    print_rich_table,
    record,
    section_head,
    versions_line,
)
from _servers import open_store

sys.path.insert(0, str(REPO_ROOT / "tests"))
from helpers import crash_harness  # noqa: E402
from helpers.crash_harness import CrashHarness, CrashResult  # noqa: E402

if not crash_harness.SCRIPT.exists():  # the harness moved to tests/helpers/, its training script did not
    crash_harness.SCRIPT = REPO_ROOT / "tests" / "scripts" / "lightning_run.py"

QUICK = {"kills": 4, "complete_every": 2, "max_delay_s": 0.5, "max_epochs": 2}
HEADERS = ["backend", "kills", "commits seen", "resumes", "runs to completion", "kills before any commit",
           "failures", "seconds"]  # fmt: skip
MAX_EPOCHS = {"file": 40, "s3": 20}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100, help="total kills, split over the backends")
    parser.add_argument("--backends", default="file,s3")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--max-delay-s", type=float, default=1.5)
    parser.add_argument("--complete-every", type=int, default=10)
    parser.add_argument(
        "--max-epochs", type=int, default=0, help="a lineage's length (default: 40 on file, 20 on s3)"
    )
    add_common_args(parser)
    args = parser.parse_args(argv)
    apply_quick(parser, args, QUICK)
    args.backends = choice_list(parser, args.backends, tuple(MAX_EPOCHS), "--backends")
    return args


def soak(args: argparse.Namespace, workdir: Path) -> dict[str, CrashResult]:
    """The kills split over the backends, each against its own fresh store."""
    results: dict[str, CrashResult] = {}
    for index, backend in enumerate(args.backends):
        kills = args.kills // len(args.backends) + (1 if index < args.kills % len(args.backends) else 0)
        with open_store(backend, workdir, "soak") as (base_url, options):
            harness = CrashHarness(
                f"{base_url}/run", options, workdir / backend, seed=args.seed + index,
                max_delay_s=args.max_delay_s, max_epochs=args.max_epochs or MAX_EPOCHS[backend],
                log=lambda line, b=backend: print(f"[{b}] {line}", flush=True),
            )  # fmt: skip
            results[backend] = harness.run(kills, complete_every=args.complete_every)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="spot-soak-"))
    started = time.monotonic()
    try:
        results = soak(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    total_s = time.monotonic() - started
    rows = [
        [backend, str(r.kills), str(r.commits_seen), str(r.resumes), str(r.completions),
         str(r.empty_after_kill), str(len(r.failures)), f"{r.seconds:.0f}"]
        for backend, r in results.items()
    ]  # fmt: skip
    print_rich_table(HEADERS, rows, "soak: kill -9 at random moments", left=["backend"])
    failures = [f for r in results.values() for f in r.failures]
    for failure in failures:
        print(f"FAILURE: {failure}")
    command = (
        f"python benchmarks/soak.py --kills {args.kills} --backends {','.join(args.backends)} --seed {args.seed} "
        f"--max-delay-s {args.max_delay_s:g} --complete-every {args.complete_every}"
        + (f" --max-epochs {args.max_epochs}" if args.max_epochs else "")
    )
    section = [
        "",
        *section_head(
            "soak: kill -9 at random moments while checkpointing every step",
            command,
            versions_line(),
            f" ({total_s:.0f}s)",
        ),
        "- Harness: `tests/helpers/crash_harness.py` (`tests/scripts/lightning_run.py`, a checkpoint every step, "
        f"keep_last=2). Kill delay uniform in [0, {args.max_delay_s}] s after the first step past the "
        "resume point; after each kill `latest()` is None or verifies (every byte), never goes back, "
        f"and the next run resumes exactly at it; every {args.complete_every} kills a lineage trains "
        "to the end. S3 is moto on loopback.",
        "",
        *markdown_table(HEADERS, rows),
        "",
        f"Result: **{'PASS' if not failures else 'FAIL'}** ({len(failures)} failures).",
        "",
    ]
    record(args, section)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
