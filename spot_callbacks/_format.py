"""Numbers as people write and read them: durations ("90s", "1h30", "PT1H30M"), sizes, rates, money.

The bottom layer for text. :func:`parse_duration` is the one duration grammar (arguments, YAML,
``SPOT_*`` knobs and the command line all accept the same forms). A duration is shown three ways,
each for its reader: :func:`format_seconds` in reports and log lines (``12.3 s``, ``4.5 min``),
:func:`human_duration` beside a moving transfer (``3m07s``), :func:`duration_setting` as a value
to paste back into ``interval=`` (``1h30min``).
"""

from __future__ import annotations

import math
import re

from spot_callbacks.errors import ConfigError

_DURATION_UNITS_S = {
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
    "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
}  # fmt: skip
# "1h30" and "5m30": a bare number after a unit counts in the next smaller one, as people write it.
_NEXT_SMALLER_UNIT_S = {86400.0: 3600.0, 3600.0: 60.0, 60.0: 1.0}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_DURATION_PART = re.compile(rf"\s*{_NUMBER}\s*([a-z]+)\s*")
_BARE_TAIL = re.compile(rf"\s*{_NUMBER}\s*$")
_ISO_8601 = re.compile(
    rf"p(?:{_NUMBER}w)?(?:{_NUMBER}d)?(?:t(?=[\d.])(?:{_NUMBER}h)?(?:{_NUMBER}m)?(?:{_NUMBER}s)?)?"
)
_ISO_UNITS_S = (604800.0, 86400.0, 3600.0, 60.0, 1.0)
DURATION_HELP = (
    "accepted forms: a number of seconds (90, '90'); numbers with units d, h, min or s (also m, hr, "
    "sec and the words day, hour, minute, second, singular or plural), spaces optional: '90s', '15min', "
    "'90 min', '1.5h', '1h30min', '1h 30m'; a bare number after a unit counts in the next smaller one: "
    "'1h30' (1h30min), '5m30' (5min30s); ISO-8601 in weeks, days, hours, minutes and seconds: 'PT1H30M', "
    "'P1DT2H'; 'auto'; or None (off)"
)


def parse_duration(value: str | float | int | None, key: str = "interval") -> float | None:
    """Seconds in a duration such as ``"90s"``, ``"1h30"``, ``"1h 30m"``, ``"PT1H30M"`` or ``120``.

    ``None`` stays ``None``. ``"auto"`` is not a duration: callers check for it first.

    Example:
        >>> parse_duration("1h30min")
        5400.0
        >>> parse_duration("1h30"), parse_duration("90 min"), parse_duration("PT1H30M")
        (5400.0, 5400.0, 5400.0)
        >>> parse_duration(90)
        90.0
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} is not a duration; {DURATION_HELP}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            seconds = _parse_unit_string(text, value, key)
    else:
        raise ConfigError(f"{key}={value!r} is not a duration; {DURATION_HELP}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{key}={value!r} must be a positive duration; {DURATION_HELP}")
    return seconds


def _parse_unit_string(text: str, original: str, key: str) -> float:
    iso = _ISO_8601.fullmatch(text)
    if iso is not None and any(iso.groups()):
        return sum(
            float(amount) * unit for amount, unit in zip(iso.groups(), _ISO_UNITS_S, strict=True) if amount
        )
    position, total = 0, 0.0
    last_unit_s: float | None = None
    while position < len(text):
        match = _DURATION_PART.match(text, position)
        if match is None or match.group(2) not in _DURATION_UNITS_S:
            tail = _BARE_TAIL.fullmatch(text, position)
            if tail is None or last_unit_s is None or last_unit_s not in _NEXT_SMALLER_UNIT_S:
                raise ConfigError(f"{key}={original!r} is not a duration; {DURATION_HELP}")
            return total + float(tail.group(1)) * _NEXT_SMALLER_UNIT_S[last_unit_s]
        last_unit_s = _DURATION_UNITS_S[match.group(2)]
        total += float(match.group(1)) * last_unit_s
        position = match.end()
    if position == 0:
        raise ConfigError(f"{key}={original!r} is not a duration; {DURATION_HELP}")
    return total


# C0 and C1 controls (ESC starts every ANSI sequence, 0x9b is a one-byte CSI), DEL, and the
# Unicode line separators and bidirectional overrides that reorder what a terminal shows.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: object, *, keep_newlines: bool = False) -> str:
    """``text`` safe to show on a terminal or in a pipe: every control character escaped (``\\x1b``).

    The one helper for text that came from a store (a manifest's ``reason``, ``framework``,
    ``extra`` values and file names, a lock's host): whoever can write the bucket must not be able
    to clear the screen, retitle the terminal or forge lines of the output. ``keep_newlines``
    keeps ``\\n`` and ``\\t`` (a log message of ours may span lines).

    Example:
        >>> printable("interval\\x1b[2J\\x1b]0;pwned\\x07")
        'interval\\\\x1b[2J\\\\x1b]0;pwned\\\\x07'
        >>> printable("a\\nb"), printable("a\\nb", keep_newlines=True)
        ('a\\\\x0ab', 'a\\nb')
    """
    string = text if isinstance(text, str) else str(text)
    if _UNPRINTABLE.search(string) is None:
        return string

    def escape(match: re.Match[str]) -> str:
        char = match.group()
        if keep_newlines and char in "\n\t":
            return char
        code = ord(char)
        return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"

    return _UNPRINTABLE.sub(escape, string)


# ------------------------------------------------------------------ shown to people
def format_seconds(seconds: float | None) -> str:
    """A duration for people: ``0.42 s``, ``12.3 s``, ``4.5 min``, ``3.25 h``.

    Example:
        >>> format_seconds(0.4213), format_seconds(75), format_seconds(4 * 3600), format_seconds(None)
        ('0.42 s', '1.2 min', '4.00 h', 'unknown')
    """
    if seconds is None:
        return "unknown"
    if math.isinf(seconds):
        return "never" if seconds > 0 else "-inf"
    if abs(seconds) < 10:
        return f"{seconds:.2f} s"
    if abs(seconds) < 60:
        return f"{seconds:.1f} s"
    if abs(seconds) < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def format_money(amount: float) -> str:
    """Example:
    >>> format_money(1234.5), format_money(-3.2)
    ('$1,234.50', '-$3.20')
    """
    return f"{'-' if amount < 0 else ''}${abs(amount):,.2f}"


def count_of(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, the noun singular for exactly one (``plural`` when adding "s" is wrong).

    Example:
        >>> count_of(1, "file"), count_of(0, "file"), count_of(3, "folder"), count_of(2, "entry", "entries")
        ('1 file', '0 files', '3 folders', '2 entries')
    """
    return f"{count} {noun if count == 1 else (plural or noun + 's')}"


def human_size(size_bytes: int) -> str:
    """A byte count in decimal units, as storage consoles show it.

    Example:
        >>> human_size(512), human_size(12_345_678), human_size(3 * 10**12)
        ('512 B', '12.3 MB', '3.0 TB')
    """
    if size_bytes < 1000:
        return f"{size_bytes} B"
    value = float(size_bytes)
    for unit in ("kB", "MB", "GB", "TB", "PB"):
        value /= 1000
        if value < 999.95 or unit == "PB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def human_rate(nbytes: int, seconds: float) -> str:
    """Bytes per second in decimal units; ``"-"`` before any time has passed.

    Example:
        >>> human_rate(300_000_000, 4.0), human_rate(10, 0.0)
        ('75.0 MB/s', '-')
    """
    if seconds <= 0:
        return "-"
    return f"{human_size(round(nbytes / seconds))}/s"


def human_duration(seconds: float | None) -> str:
    """``"42s"``, ``"3m07s"``, ``"1h02m"``; ``"?"`` when unknown.

    Example:
        >>> human_duration(42.4), human_duration(187), human_duration(3720), human_duration(None)
        ('42s', '3m07s', '1h02m', '?')
    """
    if seconds is None or not math.isfinite(seconds):
        return "?"
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def duration_setting(seconds: float) -> str:
    """``seconds`` as an ``interval`` value SpotConfig accepts, rounded up (to seconds below 2 min, else minutes).

    Example:
        >>> duration_setting(41.2), duration_setting(150), duration_setting(5400), duration_setting(7200)
        ('42s', '3min', '1h30min', '2h')
    """
    if seconds < 120:
        return f"{max(1, math.ceil(seconds))}s"
    minutes = math.ceil(seconds / 60)
    hours, minutes = divmod(minutes, 60)
    if not hours:
        return f"{minutes}min"
    return f"{hours}h{minutes}min" if minutes else f"{hours}h"
