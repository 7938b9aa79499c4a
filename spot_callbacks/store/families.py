"""Protocol families: the one place where fsspec's protocol names (``"s3a"``, ``"abfss"``, ...) are spelled.

Every module asks :func:`family_of` / :func:`in_family` instead of listing names; the backend table
(:mod:`spot_callbacks.store.backends`) builds its rows from these families.
"""

from __future__ import annotations

# The one place protocol families are spelled: family -> the protocols fsspec answers to for it.
PROTOCOL_FAMILIES: dict[str, tuple[str, ...]] = {
    "s3": ("s3", "s3a"),
    "gs": ("gs", "gcs"),
    "az": ("az", "abfs", "abfss"),
    "adl": ("adl",),
    "file": ("file", "local"),
    "memory": ("memory",),
}


def family_of(protocol: str) -> str:
    """The family a protocol belongs to (``"s3a"`` -> ``"s3"``); an unknown protocol is its own.

    Example:
        >>> family_of("abfss"), family_of("gcs"), family_of("hdfs")
        ('az', 'gs', 'hdfs')
    """
    return next(
        (family for family, protocols in PROTOCOL_FAMILIES.items() if protocol in protocols), protocol
    )


def in_family(protocols: str | tuple[str, ...] | list[str] | set[str], *families: str) -> bool:
    """True when any of ``protocols`` (an fsspec ``fs.protocol``) belongs to one of ``families``.

    Example:
        >>> in_family(("s3", "s3a"), "s3"), in_family("gcs", "s3", "az")
        (True, False)
    """
    names = (protocols,) if isinstance(protocols, str) else tuple(protocols)
    return any(family_of(name) in families for name in names)
