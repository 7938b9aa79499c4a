"""What a manifest read back from a store may make the loader allocate and parse, checked before trusting it.

A manifest is untrusted input: a few bytes of JSON can declare a billion files, a size of an
exabyte, a number with a million digits, nesting that exhausts the stack, or ``Infinity`` (which
``json.loads`` accepts). Every limit is checked before any payload is downloaded; a manifest that
breaks one is damaged (a :class:`~spot_callbacks.errors.ManifestError`: warn, fall back, never delete).

Limits (environment variable, default):

- ``SPOT_MANIFEST_MAX_BYTES`` (32 MiB): the bytes of ``manifest.json`` read at most.
- ``SPOT_MANIFEST_MAX_FILES`` (200000): payload files one checkpoint may list.
- ``SPOT_CHECKPOINT_MAX_FILE_BYTES`` (5 TiB, the largest S3 object): declared size of one file.
- ``SPOT_CHECKPOINT_MAX_BYTES`` (100 TiB): declared size of the whole checkpoint.

Fixed: JSON nesting depth 32, a payload name of 1024 characters (the S3 key limit), integers of 20 digits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import spot_callbacks.settings as settings
from spot_callbacks.errors import ManifestError

MAX_DEPTH = 32
MAX_NAME_CHARS = 1024
MAX_INT_DIGITS = 20  # 2**64 has 20 digits; a longer integer is no step, size or count

_KNOBS = {
    "max_manifest_bytes": settings.MANIFEST_MAX_BYTES,
    "max_files": settings.MANIFEST_MAX_FILES,
    "max_file_bytes": settings.CHECKPOINT_MAX_FILE_BYTES,
    "max_total_bytes": settings.CHECKPOINT_MAX_BYTES,
}


@dataclass(frozen=True)
class ManifestLimits:
    """The bounds a manifest must keep (see the module docstring for the variables and defaults).

    Example:
        >>> limits = ManifestLimits(max_files=2)
        >>> limits.check_files({"a": 1, "b": 2, "c": 3}, "memory:///run/step-000000001/manifest.json")
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.ManifestError: memory:///run/step-000000001/manifest.json lists 3 files, more than 2 (SPOT_MANIFEST_MAX_FILES)
    """

    max_manifest_bytes: int = _KNOBS["max_manifest_bytes"].default
    max_files: int = _KNOBS["max_files"].default
    max_file_bytes: int = _KNOBS["max_file_bytes"].default
    max_total_bytes: int = _KNOBS["max_total_bytes"].default

    @classmethod
    def from_env(cls) -> ManifestLimits:
        values = {field_name: knob.value() for field_name, knob in _KNOBS.items()}
        return cls(**values)

    def check_size(self, raw: bytes, where: str) -> None:
        if len(raw) > self.max_manifest_bytes:
            raise ManifestError(
                f"{where} is over {self.max_manifest_bytes} bytes (SPOT_MANIFEST_MAX_BYTES); not read"
            )

    def check_files(self, files_doc: dict[str, Any], where: str) -> None:
        if len(files_doc) > self.max_files:
            raise ManifestError(
                f"{where} lists {len(files_doc)} files, more than {self.max_files} (SPOT_MANIFEST_MAX_FILES)"
            )

    def check_file_size(self, name: str, size: int, where: str) -> None:
        if size > self.max_file_bytes:
            raise ManifestError(
                f"{where} declares {name!r} as {size} bytes, more than {self.max_file_bytes} "
                "(SPOT_CHECKPOINT_MAX_FILE_BYTES)"
            )

    def check_total_size(self, total: int, where: str) -> None:
        if total > self.max_total_bytes:
            raise ManifestError(
                f"{where} declares {total} bytes in all, more than {self.max_total_bytes} "
                "(SPOT_CHECKPOINT_MAX_BYTES)"
            )


def load_bounded_json(raw: bytes, where: str) -> Any:
    """``json.loads(raw)`` that refuses NaN/Infinity, integers over :data:`MAX_INT_DIGITS` digits and
    nesting deeper than :data:`MAX_DEPTH`, raising :class:`ManifestError`.

    Example:
        >>> load_bounded_json(b'{"ledger": {"train_s": 1.5}}', "m.json")
        {'ledger': {'train_s': 1.5}}
        >>> load_bounded_json(b'{"train_s": Infinity}', "m.json")
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.ManifestError: m.json holds 'Infinity', which is not a number JSON allows
    """
    _check_depth(raw, where)
    try:
        return json.loads(raw, parse_constant=_refuse_constant(where), parse_int=_bounded_int(where))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ManifestError(f"{where} is not valid JSON ({err})") from None


def _refuse_constant(where: str) -> Any:
    def refuse(name: str) -> Any:
        raise ManifestError(f"{where} holds {name!r}, which is not a number JSON allows")

    return refuse


def _bounded_int(where: str) -> Any:
    def parse(text: str) -> int:
        if len(text.lstrip("-")) > MAX_INT_DIGITS:
            raise ManifestError(f"{where} holds an integer of {len(text)} digits")
        return int(text)

    return parse


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")


def _check_depth(raw: bytes, where: str) -> None:
    """Count bracket nesting outside strings before parsing: the parser recurses once per level."""
    depth = 0
    for bracket in _BRACKET.findall(_STRING.sub(b"", raw)):
        depth += 1 if bracket in (b"[", b"{") else -1
        if depth > MAX_DEPTH:
            raise ManifestError(f"{where} nests deeper than {MAX_DEPTH} levels")
