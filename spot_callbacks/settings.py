"""Every ``SPOT_*`` environment knob, in one table: name, default, parser, one line of what it does.

The arguments of the callbacks (:class:`~spot_callbacks.config.SpotConfig`) are the configuration;
these knobs are for what a deployment sets once for all its runs (timeouts, limits, switches).
Precedence is stated once: an explicit argument where one exists, else the variable, else the
default. A knob is read where it is used (so a test or launcher may set it before the run
starts), and :func:`check_all` parses every one when an engine is built: a bad value is a
:class:`~spot_callbacks.errors.ConfigError` naming the variable and the accepted values, before
the first training step, never a silent default.

This is also the one module that reads the process environment: the variables other programs
set (launchers' ranks, SLURM, the clouds' metadata endpoints, Lightning's seed) and the user's
``${NAME}`` references in ``storage_options`` are read through :func:`environment_variable`.

Example:
    >>> LOCK_STALE_S.value({"SPOT_LOCK_STALE_S": "2min"})
    120.0
    >>> STORE_TIMEOUT_S.value({"SPOT_STORE_TIMEOUT_S": "off"}) is None
    True
    >>> PREFLIGHT.value({"SPOT_PREFLIGHT": "maybe"})
    Traceback (most recent call last):
    ...
    spot_callbacks.errors.ConfigError: SPOT_PREFLIGHT='maybe' is not a switch; use 1/true/yes/on or 0/false/no/off
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from spot_callbacks._format import parse_duration
from spot_callbacks.errors import ConfigError

T = TypeVar("T")
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Knob(Generic[T]):
    """One ``SPOT_*`` variable: its name, default, parser and one line of documentation.

    Example:
        >>> Knob("SPOT_EXAMPLE_S", 5.0, seconds, "an example").value({"SPOT_EXAMPLE_S": "90s"})
        90.0
    """

    name: str
    default: T
    parse: Callable[[str, str], T]
    doc: str
    accepts: str = ""  # the knob table's "accepts" column; from the parser when empty

    def value(self, environ: Mapping[str, str] | None = None) -> T:
        """The parsed value from ``environ`` (default: the process environment), else the default."""
        raw = (os.environ if environ is None else environ).get(self.name, "").strip()
        return self.parse(self.name, raw) if raw else self.default

    @property
    def readme_row(self) -> str:
        """This knob as a row of the table of knobs in docs/configuration.md."""
        default = "unset" if self.default is None else _shown(self.default)
        return f"| `{self.name}` | {self.accepts or _ACCEPTS[self.parse]} | {default} | {self.doc} |"


# ------------------------------------------------------------------ parsers: (name, text) -> value
def seconds(name: str, text: str) -> float:
    """A positive duration: ``"90"``, ``"90s"``, ``"2min"``, ``"1h"`` (:func:`parse_duration`)."""
    return _duration(name, text, "")


def seconds_or_off(name: str, text: str) -> float | None:
    """A duration, or ``0``/``off``/``none`` for no limit (``None``)."""
    return None if text.lower() in ("0", "off", "none") else _duration(name, text, ", or 0/off for no limit")


def _duration(name: str, text: str, off: str) -> float:
    try:
        value = parse_duration(text, key=name)
    except ConfigError as err:  # parse_duration's help is about arguments ('auto', None): say a knob's forms
        problem = "must be a positive duration" if "must be a positive" in str(err) else "is not a duration"
        raise ConfigError(f"{name}={text!r} {problem}; use e.g. '90', '90s', '2min' or '1h'{off}") from None
    assert value is not None
    return value


def switch(name: str, text: str) -> bool:
    """On (``1``, ``true``, ``yes``, ``on``) or off (``0``, ``false``, ``no``, ``off``)."""
    if text.lower() in _ON:
        return True
    if text.lower() in _OFF:
        return False
    raise ConfigError(f"{name}={text!r} is not a switch; use 1/true/yes/on or 0/false/no/off")


def positive_int(name: str, text: str) -> int:
    """A whole number above 0 (``_`` separators allowed: ``200_000``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{name}={text!r} is not a positive whole number; use e.g. 1000")
    return value


def positive_number(name: str, text: str) -> float:
    """A finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ConfigError(f"{name}={text!r} is not a positive number; use e.g. 4 or 2.5")
    return value


def text(name: str, value: str) -> str:
    """Any text (a path, a URL)."""
    return value


def choice(*options: str) -> Callable[[str, str], str]:
    """One of ``options`` (case-insensitive)."""

    def parse(name: str, text: str) -> str:
        if text.lower() not in options:
            accepted = " or ".join(repr(option) for option in options)
            raise ConfigError(f"{name}={text!r}: expected {accepted}")
        return text.lower()

    parse.__doc__ = " or ".join(f"`{option}`" for option in options)
    return parse


_ACCEPTS: dict[Callable[..., Any], str] = {
    seconds: "duration (`90`, `90s`, `2min`, `1h`)",
    seconds_or_off: "duration, or `0`/`off` (no limit)",
    switch: "`1`/`0` (also true/false, yes/no, on/off)",
    positive_int: "whole number > 0",
    positive_number: "number > 0",
    text: "text",
}


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return f"{value:.0f}"
    if isinstance(value, int) and value >= 1024**2 and value % 1024**2 == 0:
        for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2)):
            if value % size == 0:
                return f"{value // size} {unit} ({value})"
    return f"`{value}`" if isinstance(value, str) else f"{value:_}" if isinstance(value, int) else str(value)


# ------------------------------------------------------------------------------------ the table
SCRATCH = Knob(
    "SPOT_SCRATCH", None, text,
    "fast local disk for staging when `scratch_dir` is not given (default: a per-user folder in the temp dir)",
    "folder",
)  # fmt: skip
SCRATCH_KEEP_S: Knob[float | None] = Knob(
    "SPOT_SCRATCH_KEEP_S", 7 * 86400.0, seconds_or_off,
    "when a run starts, other dirpaths' scratch folders unused this long and held by no live run are "
    "deleted (`off`: keep them; `spot-callbacks scratch` lists them)",
)  # fmt: skip
STORE_TIMEOUT_S: Knob[float | None] = Knob(
    "SPOT_STORE_TIMEOUT_S", 60.0, seconds_or_off,
    "how long one attempt of a storage call (list, read, manifest) may take before it is retried",
)  # fmt: skip
UPLOAD_TIMEOUT_S: Knob[float | None] = Knob(
    "SPOT_UPLOAD_TIMEOUT_S", 120.0, seconds_or_off,
    "the floor of one upload attempt's timeout; its size at `SPOT_UPLOAD_MIN_MBPS` is added",
)  # fmt: skip
UPLOAD_MIN_MBPS = Knob(
    "SPOT_UPLOAD_MIN_MBPS", 4.0, positive_number,
    "the slowest upload (MB/s) that still counts as progress, for the upload timeout",
)  # fmt: skip
PREFLIGHT = Knob(
    "SPOT_PREFLIGHT", True, switch,
    "prove the store usable (write, read, list, delete a probe) before the first step",
)  # fmt: skip
PREFLIGHT_TIMEOUT_S = Knob(
    "SPOT_PREFLIGHT_TIMEOUT_S", 60.0, seconds, "how long the preflight may retry a transient failure"
)
CONNECT_TIMEOUT_S = Knob(
    "SPOT_CONNECT_TIMEOUT_S", 5.0, seconds,
    "how long a connection to the store may take to open; at start, a store that accepts nothing (refused) "
    "fails after half this, and one that accepts but answers nothing after twice this, with the cause",
)  # fmt: skip
LOCK_STALE_S = Knob(
    "SPOT_LOCK_STALE_S", 10.0, seconds,
    "a run lock not rewritten for this long, by the store's own clock, belongs to a dead run and is taken "
    "over at once (its owner rewrites it every quarter of this); raise it on a store with long stalls",
)  # fmt: skip
ATTEMPT_RECORD_S = Knob(
    "SPOT_ATTEMPT_RECORD_S", 1.0, seconds,
    "how often a run rewrites its attempt record (`.spot-attempts/` in `dirpath`: process start, lock wait, "
    "last step), from which `spot-callbacks report` counts billed time and lost work; one small PUT each",
)  # fmt: skip
FORCE_LOCK = Knob(
    "SPOT_FORCE_LOCK", False, switch,
    "take the run lock of `dirpath` even from a live owner (you know the other run is gone)",
)  # fmt: skip
STRICT = Knob(
    "SPOT_STRICT", False, switch,
    "fail the run at its end when any checkpoint could not be persisted, not only the newest",
)  # fmt: skip
REGION_CHECK = Knob(
    "SPOT_REGION_CHECK", True, switch,
    "warn once when the bucket is in another region than the instance (cross-region traffic costs)",
)  # fmt: skip
HF_SAVE = Knob(
    "SPOT_HF_SAVE", "staged", choice("staged", "trainer"),
    "Hugging Face: `staged` (a RAM snapshot, written in the background) where it applies, "
    "or `trainer` (always the Trainer's own save)",
    "`staged` or `trainer`",
)  # fmt: skip
SHARDED_TIMEOUT_S = Knob(
    "SPOT_SHARDED_TIMEOUT_S", 7200.0, seconds,
    "how long the checkpoint's own process groups wait for the slowest rank's upload",
)  # fmt: skip
SIGNAL_GRACE_S = Knob(
    "SPOT_SIGNAL_GRACE_S", 30.0, seconds,
    "seconds between SIGTERM/SIGUSR1 and SIGKILL (Kubernetes' default), the emergency checkpoint's deadline",
)  # fmt: skip
METADATA_POLL_S = Knob(
    "SPOT_METADATA_POLL_S", 5.0, seconds, "seconds between two polls of the cloud's preemption notice"
)
NOTICE_FILE = Knob(
    "SPOT_NOTICE_FILE", None, text,
    "the file whose appearance is a preemption notice (`preemption` source `file`, e.g. touched by a "
    "Kubernetes preStop hook); its content, if any, is the time left, else `SPOT_SIGNAL_GRACE_S`", "path",
)  # fmt: skip
AZURE_METADATA_ENDPOINT = Knob(
    "SPOT_AZURE_METADATA_ENDPOINT", None, text,
    "Azure's metadata service for Scheduled Events (default `http://169.254.169.254`)", "URL",
)  # fmt: skip
MANIFEST_MAX_BYTES = Knob(
    "SPOT_MANIFEST_MAX_BYTES", 32 * 1024**2, positive_int, "the largest manifest.json read from a store"
)
MANIFEST_MAX_FILES = Knob(
    "SPOT_MANIFEST_MAX_FILES", 200_000, positive_int, "the most payload files one manifest may list"
)
CHECKPOINT_MAX_FILE_BYTES = Knob(
    "SPOT_CHECKPOINT_MAX_FILE_BYTES", 5 * 1024**4, positive_int,
    "the largest payload file a manifest may announce (bytes)",
)  # fmt: skip
CHECKPOINT_MAX_BYTES = Knob(
    "SPOT_CHECKPOINT_MAX_BYTES", 100 * 1024**4, positive_int,
    "the largest checkpoint (all its files, bytes) a manifest may announce",
)  # fmt: skip

DATA_PLANE = Knob(
    "SPOT_DATA_PLANE", "auto", choice("auto", "fsspec", "boto3", "obstore"),
    "which client moves payload bytes: `auto` (s3: boto3 uploads, obstore pulls; az: obstore), `fsspec` "
    "(all through fsspec), `boto3` or `obstore` (s3: the one that pulls)",
    "`auto`, `fsspec`, `boto3` or `obstore`",
)  # fmt: skip
TRANSFER_BUFFER_MB = Knob(
    "SPOT_TRANSFER_BUFFER_MB", 96, positive_int,
    "MiB of payload the data plane holds in memory at once, all files together (at least 4)",
)  # fmt: skip
PULL_SEGMENT_MB = Knob(
    "SPOT_PULL_SEGMENT_MB", 128, positive_int,
    "the smallest segment (MiB) of a pulled file: a file of two or more is fetched as up to 8 parallel streamed GETs while streams are free",
)  # fmt: skip
TRIM_HEAP = Knob(
    "SPOT_TRIM_HEAP", True, switch,
    "after each checkpoint's upload, hand the C heap's free pages back to the OS (glibc `malloc_trim`; "
    "elsewhere nothing): the writer's and FSDP's freed blocks otherwise stay resident",
)  # fmt: skip

PROGRESS_EVERY_S = Knob(
    "SPOT_PROGRESS_EVERY_S", 10.0, seconds,
    "how often a transfer not shown on a terminal (a log, a pipe) gets a line with its bytes, rate and ETA",
)  # fmt: skip

KNOBS: dict[str, Knob[Any]] = {knob.name: knob for knob in list(globals().values()) if isinstance(knob, Knob)}


def override(values: Mapping[Knob[Any], float]) -> Callable[[], None]:
    """Give the knobs in ``values`` these values until the returned function is called (through the
    environment, where every reader looks: a command-line flag such as ``--timeout``).

    Example:
        >>> restore = override({STORE_TIMEOUT_S: 7.0}); STORE_TIMEOUT_S.value()
        7.0
        >>> restore()
    """
    before = {knob.name: os.environ.get(knob.name) for knob in values}
    os.environ.update({knob.name: f"{value:g}" for knob, value in values.items()})

    def restore() -> None:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    return restore


def check_all(environ: Mapping[str, str] | None = None) -> None:
    """Parse every knob set in ``environ``; the first bad value raises its :class:`ConfigError`.

    Example:
        >>> check_all({"SPOT_SIGNAL_GRACE_S": "30 fortnights"})
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.ConfigError: SPOT_SIGNAL_GRACE_S='30 fortnights' is not a duration; use e.g. '90', '90s', '2min' or '1h'
    """
    for knob in KNOBS.values():
        knob.value(environ)


def environment_variable(name: str) -> str | None:
    """A variable another program set (a launcher's rank, SLURM, a cloud endpoint, Lightning's
    seed) or a ``${NAME}`` reference of the user's; ``None`` when unset."""
    return os.environ.get(name)


def readme_table() -> str:
    """The table of knobs in docs/configuration.md (tests/test_settings.py keeps the page in step with it)."""
    head = "| variable | accepts | default | what it does |\n|---|---|---|---|"
    return "\n".join([head, *(knob.readme_row for knob in KNOBS.values())])


__all__ = ["KNOBS", "Knob", "check_all", "environment_variable", "readme_table"]
