"""The manifest: what a committed checkpoint holds, built on write and validated on read.

A manifest read back from a store is untrusted input: its format and version, every payload
name (a plain relative path that cannot leave the checkpoint folder), every size and checksum
are checked before anything uses them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeGuard

from spot_callbacks.errors import ManifestError
from spot_callbacks.store.checksums import CHECKSUM_ALGORITHM, FileDigest, checksum_algorithm, kind_problem
from spot_callbacks.store.layout import MANIFEST_NAME
from spot_callbacks.store.manifest_limits import MAX_NAME_CHARS, ManifestLimits, load_bounded_json

MAX_PART_BYTES = 255  # NAME_MAX of ext4, xfs, btrfs, APFS, NTFS: one path part, in bytes

MANIFEST_FORMAT = "spot_callbacks.checkpoint"
FORMAT_VERSION = 1
REASONS = ("interval", "steps", "preemption", "exception", "end", "manual")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a committed checkpoint's manifest says about it.

    Example:
        >>> doc = new_manifest(7, {"state.pt": FileDigest(5, "xxh3_64:ab")}, reason="end", framework="demo")
        >>> info = parse_manifest(encode_manifest(doc), 7, "memory:///run/step-000000007")
        >>> info.step, info.reason, info.size_bytes, info.created.tzname()
        (7, 'end', 5, 'UTC')
    """

    step: int
    url: str
    created: datetime
    reason: str
    size_bytes: int
    framework: str
    epoch: int | None = None
    files: dict[str, FileDigest] = field(default_factory=dict, repr=False)
    metrics: dict[str, Any] = field(default_factory=dict, repr=False)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)


def new_manifest(
    step: int,
    files: dict[str, FileDigest],
    *,
    reason: str,
    framework: str,
    epoch: int | None = None,
    metrics: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    created: datetime | None = None,
) -> dict[str, Any]:
    """The manifest document for a checkpoint whose payload files are all durable."""
    if reason not in REASONS:
        raise ValueError(f"reason={reason!r} is not one of {list(REASONS)}")
    for name in files:
        check_payload_name(name)
    return {
        "format": MANIFEST_FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "epoch": epoch,
        "created": (created or datetime.now(timezone.utc)).isoformat(),
        "framework": framework,
        "reason": reason,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "files": {name: digest.to_json() for name, digest in sorted(files.items())},
        "metrics": metrics or {},
        "extra": extra or {},
    }


def encode_manifest(doc: dict[str, Any]) -> bytes:
    """The manifest's bytes; a NaN or infinite number (a diverged loss) is written as ``null``, which
    every JSON reader accepts (``NaN`` is no JSON, and a reader refuses it).

    Example:
        >>> encode_manifest({"metrics": {"loss": float("nan")}})
        b'{\\n "metrics": {\\n  "loss": null\\n }\\n}'
    """
    return json.dumps(_finite(doc), indent=1, sort_keys=True, allow_nan=False).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def check_payload_name(name: Any) -> str:
    """Reject payload names that would escape the checkpoint folder when joined to it.

    Example:
        >>> check_payload_name("model/shard-0.bin")
        'model/shard-0.bin'
        >>> check_payload_name("../escape.bin")
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.ManifestError: payload name '../escape.bin' is not a plain relative path inside the checkpoint folder
    """
    if (
        not isinstance(name, str)
        or not name
        or "\\" in name
        or "://" in name
        or name.startswith("/")
        or re.match(r"^[A-Za-z]:", name)
        or any(part in ("", ".", "..") for part in name.split("/"))
        or name == MANIFEST_NAME
        or len(name) > MAX_NAME_CHARS
    ):
        raise ManifestError(
            f"payload name {name!r:.80} is not a plain relative path inside the checkpoint folder"
        )
    if any(ord(char) < 32 or ord(char) == 127 for char in name) or any(
        len(part.encode("utf-8", "surrogatepass")) > MAX_PART_BYTES for part in name.split("/")
    ):
        raise ManifestError(
            f"payload name {name!r:.80} cannot be a file on a local disk (a control character, or a "
            f"part over {MAX_PART_BYTES} bytes)"
        )
    return name


def check_names_fit_together(names: list[str], where: str) -> None:
    """Refuse payload names one folder cannot hold together: a file that is also another file's
    folder (``a`` and ``a/b``), or two names that differ only in case (one file on a
    case-insensitive disk, so a pull would write one over the other).

    Example:
        >>> check_names_fit_together(["model/a.bin", "model"], "memory://run/step-000000001/manifest.json")
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.ManifestError: memory://run/step-000000001/manifest.json lists 'model' both as a file and as the folder of 'model/a.bin'; a disk cannot hold both
    """
    files = set(names)
    for name in sorted(names):
        parts = name.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in files:
                raise ManifestError(
                    f"{where} lists {folder!r:.80} both as a file and as the folder of {name!r:.80}; "
                    "a disk cannot hold both"
                )
    folded: dict[str, str] = {}
    for name in sorted(names):
        other = folded.setdefault(name.casefold(), name)
        if other != name:
            raise ManifestError(
                f"{where} lists {other!r:.80} and {name!r:.80}, one file on a case-insensitive disk"
            )


def parse_manifest(raw: bytes, step: int, url: str, limits: ManifestLimits | None = None) -> CheckpointInfo:
    """Validate a manifest's bytes; raise :class:`ManifestError` saying what is wrong.

    Every field is checked for its type and range, and ``limits`` (default: from the environment)
    bound what it may declare, so nothing downstream meets a value it would choke on.
    """
    where = f"{url}/{MANIFEST_NAME}"
    limits = limits or ManifestLimits.from_env()
    limits.check_size(raw, where)
    doc = load_bounded_json(raw, where)
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{where} is not a spot_callbacks manifest")
    version = doc.get("format_version")
    if not _is_int(version) or version < 1:
        raise ManifestError(f"{where} has no valid format_version")
    if version > FORMAT_VERSION:
        raise ManifestError(
            f"{where} has format_version {version}, newer than this spot_callbacks "
            f"reads ({FORMAT_VERSION}); upgrade spot_callbacks to use it"
        )
    if not _is_int(doc.get("step")) or doc.get("step") != step:
        raise ManifestError(f"{where} says step {doc.get('step')!r} but lies in the folder of step {step}")
    files = _parse_files(doc.get("files"), where, limits)
    return CheckpointInfo(
        step=step,
        url=url,
        created=_parse_created(doc.get("created"), where),
        reason=_optional(doc, "reason", str, where) or "",
        size_bytes=sum(digest.size for digest in files.values()),
        framework=_optional(doc, "framework", str, where) or "",
        epoch=_parse_epoch(doc.get("epoch"), where),
        files=files,
        metrics=_optional(doc, "metrics", dict, where) or {},
        extra=_optional(doc, "extra", dict, where) or {},
    )


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(doc: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = doc.get(key)
    if value is not None and not isinstance(value, kind):
        raise ManifestError(f"{where}: {key!r} is {type(value).__name__} {value!r:.60}, not {kind.__name__}")
    return value


def _parse_epoch(epoch: Any, where: str) -> int | None:
    if epoch is not None and (not _is_int(epoch) or epoch < 0):
        raise ManifestError(f"{where}: 'epoch' is {epoch!r:.60}, not an integer >= 0")
    return epoch


def _parse_created(created: Any, where: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(created)
    except (TypeError, ValueError):
        raise ManifestError(f"{where} has no valid 'created' time") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=timezone.utc)


def _parse_files(files_doc: Any, where: str, limits: ManifestLimits) -> dict[str, FileDigest]:
    if not isinstance(files_doc, dict):
        raise ManifestError(f"{where} has no 'files' table")
    limits.check_files(files_doc, where)
    files: dict[str, FileDigest] = {}
    for name, entry in files_doc.items():
        check_payload_name(name)
        size = entry.get("size") if isinstance(entry, dict) else None
        checksum = entry.get("checksum") if isinstance(entry, dict) else None
        if not _is_int(size) or size < 0 or not isinstance(checksum, str):
            raise ManifestError(f"{where} has a bad entry for {name!r}: {entry!r:.120}")
        limits.check_file_size(name, size, where)
        problem = kind_problem(checksum_algorithm(checksum))
        if problem is not None:
            raise ManifestError(
                f"{where}: checksum of {name!r} is of kind {checksum_algorithm(checksum)!r:.40}: {problem}"
            )
        files[name] = FileDigest(size, checksum)
    limits.check_total_size(sum(digest.size for digest in files.values()), where)
    check_names_fit_together(list(files), where)
    return files
