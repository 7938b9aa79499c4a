"""Shared pieces of the benchmark scripts: machine/versions lines, a moto S3 server, tables, BENCHMARKS.md.

Imported by ``benchmarks/*.py`` (run as scripts, so this folder is on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
S3_KEY = S3_SECRET = "testing"
SERVER_START_TIMEOUT_S = 60.0
DEFAULT_VERSIONS = ("torch", "fsspec", "s3fs", "moto", "xxhash")


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


# ---------------------------------------------------------------------------------------- moto
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


@contextlib.contextmanager
def moto_server(workdir: Path) -> Iterator[str]:
    """Run ``python -m moto.server`` on a free loopback port; yield its endpoint URL; stop it by PID.

    moto keeps objects over ~5 MB in temp files: its ``TMPDIR`` is ``workdir/moto-tmp``, so they
    land in the benchmark's scratch folder (and go with it), not in RAM or the system temp dir.
    """
    spill = workdir / "moto-tmp"
    spill.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TMPDIR": str(spill)}
    for attempt in range(3):
        port = free_port()
        log_path = workdir / f"moto-{port}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        try:
            while _http_status(f"{endpoint}/moto-api/") is None:
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"moto did not answer on {endpoint} within {SERVER_START_TIMEOUT_S:.0f}s"
                    )
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.1)  # bounded poll interval that notices an early exit at once
                if proc.returncode is not None:
                    break
            if proc.returncode is not None:
                text = log_path.read_text(errors="replace")
                if "in use" in text and attempt < 2:
                    continue  # lost the free-port race
                raise SystemExit(f"moto exited at startup (code {proc.returncode}):\n{text[-2000:]}")
            yield endpoint
            return
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=15)


# -------------------------------------------------------------------------------------- report
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


def append_markdown(section: str) -> Path:
    path = REPO_ROOT / "BENCHMARKS.md"
    if not path.exists():
        path.write_text(
            "# Benchmarks\n\nMeasured numbers from the scripts in `benchmarks/`, newest last. "
            "Loopback servers and small machines are noisy: compare ratios, not absolute speeds.\n\n"
        )
    with open(path, "a") as handle:
        handle.write(section)
    return path
