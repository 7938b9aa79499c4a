"""Numbers as people write and read them: durations ("90s", "1h30", "PT1H30M"), sizes, rates.

The bottom layer for text: :func:`parse_duration` is the one duration grammar (arguments, YAML,
``SPOT_*`` knobs and the command line all accept the same forms).
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
    position, total, last_unit_s = 0, 0.0, None
    while position < len(text):
        match = _DURATION_PART.match(text, position)
        if match is None or match.group(2) not in _DURATION_UNITS_S:
            tail = _BARE_TAIL.fullmatch(text, position)
            if tail is None or last_unit_s not in _NEXT_SMALLER_UNIT_S:
                raise ConfigError(f"{key}={original!r} is not a duration; {DURATION_HELP}")
            return total + float(tail.group(1)) * _NEXT_SMALLER_UNIT_S[last_unit_s]
        last_unit_s = _DURATION_UNITS_S[match.group(2)]
        total += float(match.group(1)) * last_unit_s
        position = match.end()
    if position == 0:
        raise ConfigError(f"{key}={original!r} is not a duration; {DURATION_HELP}")
    return total
