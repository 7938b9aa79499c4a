"""What every benchmark script shares: machine lines, scratch checks, tables, the BENCHMARKS.md section.

Imported by ``benchmarks/*.py``, which run as scripts (``python benchmarks/NAME.py``), so this folder
is on ``sys.path``. Servers (moto S3) are in :mod:`_servers`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shutil
import statistics
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_ENV = "SPOT_BENCH_RESULTS"  # a path: where sections go instead of BENCHMARKS.md
DEFAULT_VERSIONS = ("torch", "fsspec", "s3fs", "moto", "xxhash")
RESULTS_PREAMBLE = (
    "# Benchmarks\n\nMeasured numbers from the scripts in `benchmarks/`, newest last. "
    "Loopback servers and small machines are noisy: compare ratios, not absolute speeds.\n\n"
)


# ------------------------------------------------------------------------------------ machine
def mem_info_bytes(field_name: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == field_name:
                return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def version_of(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_line() -> str:
    ram = mem_info_bytes("MemTotal")
    ram_s = f"{ram / 2**30:.1f} GiB RAM" if ram else "RAM unknown"
    return f"{platform.platform()}, {os.cpu_count()} CPUs, {ram_s}, Python {platform.python_version()}"


def versions_line(names: Sequence[str] = DEFAULT_VERSIONS) -> str:
    return ", ".join(f"{name} {version_of(name)}" for name in names)


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def check_scratch(scratch: Path, need_bytes: int, ram_bytes: int, ram_note: str, hint: str = "") -> None:
    """Exit if ``scratch`` has less free disk than ``need_bytes``; warn if less RAM is available than ``ram_bytes``."""
    free = shutil.disk_usage(scratch).free
    if free < need_bytes:
        raise SystemExit(
            f"not enough free disk under {scratch}: {free / 1e9:.1f} GB free, {need_bytes / 1e9:.1f} GB needed"
            + (f" ({hint})" if hint else "")
        )
    avail = mem_info_bytes("MemAvailable")
    if avail is not None and avail < ram_bytes:
        print(f"warning: only {avail / 1e9:.1f} GB of RAM available; {ram_note}", file=sys.stderr)


# ------------------------------------------------------------------------------ command line
def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--quick``, ``--results-file`` and ``--no-append`` (alias ``--no-record``), the same in every script."""
    parser.add_argument(
        "--quick", action="store_true", help="a small run (well under a minute) that checks the script works"
    )
    parser.add_argument(
        "--results-file",
        default=os.environ.get(RESULTS_ENV, str(REPO_ROOT / "BENCHMARKS.md")),
        help=f"where the section is appended (default ${RESULTS_ENV} or BENCHMARKS.md)",
    )
    parser.add_argument(
        "--no-append", "--no-record", dest="no_append", action="store_true", help="print only; append nothing"
    )


def choice_list(parser: argparse.ArgumentParser, text: str, allowed: Sequence[str], flag: str) -> list[str]:
    """``text`` split at commas; a parser error unless it names one or more of ``allowed``."""
    chosen = [item.strip() for item in text.split(",") if item.strip()]
    if not chosen or set(chosen) - set(allowed):
        parser.error(f"{flag} must be a subset of {','.join(allowed)}")
    return chosen


def apply_quick(parser: argparse.ArgumentParser, args: argparse.Namespace, quick: dict[str, Any]) -> None:
    """With ``--quick``, the ``quick`` values replace the options left at their defaults (explicit ones win)."""
    if args.quick:
        for dest, value in quick.items():
            if getattr(args, dest) == parser.get_default(dest):
                setattr(args, dest, value)


# ------------------------------------------------------------------------------------- report
def med(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "–" if value is None else format(value, spec)


def print_rich_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    title: str,
    left: Sequence[str] = (),
    width: int = 140,
) -> None:
    """A rich table (plain text if rich is missing); columns named in ``left`` are left-aligned."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(" | ".join(headers))
        for row in rows:
            print(" | ".join(row))
        return
    table = Table(title=title)
    for header in headers:
        table.add_column(header, justify="left" if header in left else "right")
    for row in rows:
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:
        console = Console(width=width)  # a pipe or a log: do not squeeze the columns to 80
    console.print(table)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def section_head(title: str, command: str, versions: str, after_command: str = "") -> list[str]:
    """The first lines of a BENCHMARKS.md section: title, date, machine, versions, the command (and its duration)."""
    return [
        f"## {title}",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {machine_line()}",
        f"- Versions: {versions}",
        f"- Command: `{command}`{after_command}",
    ]


def append_markdown(section: str, results_file: str | os.PathLike[str]) -> Path:
    """Append ``section`` to ``results_file`` (made with the BENCHMARKS.md preamble if missing)."""
    path = Path(results_file)
    if not path.exists():
        path.write_text(RESULTS_PREAMBLE)
    with open(path, "a") as handle:
        handle.write(section)
    return path


def record(args: argparse.Namespace, lines: Sequence[str]) -> None:
    """Append the section unless ``--no-append``; say where it went."""
    if not args.no_append:
        print(f"appended to {append_markdown(chr(10).join(lines) + chr(10), args.results_file)}")
