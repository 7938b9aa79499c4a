"""From a ``dirpath`` to its fsspec filesystem: the URL checked, the backend found and installed, its options checked.

A ``dirpath`` that fsspec would misread (``s3:/bucket``: a local folder), a glob character, an
unknown protocol, a backend whose package is missing, or a ``storage_options`` key the backend
does not take are each refused here with the cause and the fix, before anything is written. What
each backend is (its package, extra, defaults) is :mod:`spot_callbacks.store.backends`' table.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import re
from typing import Any

import fsspec

from spot_callbacks.errors import ConfigError, StoreUnavailableError, UnknownStoreError
from spot_callbacks.store.backends import (
    BACKENDS,
    BARE_PATH_PROTOCOL,
    BUILT_IN,
    CLOUD_BACKENDS,
    LOCAL_PROTOCOLS,
    Backend,
    backend_of,
    with_backend_defaults,
)

# "word:" not followed by "//": fsspec reads it as a local path (a folder named "s3:" on a disk
# that dies with the VM). One letter is a Windows drive ("C:/runs").
_SCHEME_WITHOUT_SLASHES = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):(?!//)(.*)$", re.DOTALL)


def resolve_filesystem(dirpath: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """``fsspec.core.url_to_fs(dirpath, ...)`` with :func:`with_backend_defaults`, or an
    :class:`UnknownStoreError` naming ``dirpath``, the protocol, the installed backends and the extra to install.

    Example:
        >>> resolve_filesystem("memory://doc-backends/run", None)[1]
        '/doc-backends/run'
        >>> resolve_filesystem("s4://bucket/run", None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.UnknownStoreError: dirpath='s4://bucket/run' cannot hold checkpoints: ...
    """
    if (
        misread := misread_url(dirpath) or glob_in_dirpath(dirpath) or odd_segment_in_dirpath(dirpath)
    ) is not None:
        raise UnknownStoreError(dirpath, *misread)
    protocol, _ = fsspec.core.split_protocol(dirpath)
    if protocol is not None:
        check_protocol(dirpath, protocol)
        check_option_names(protocol, storage_options)
    try:
        return fsspec.core.url_to_fs(dirpath, **with_backend_defaults(protocol, storage_options))
    except (ImportError, TypeError, ValueError) as err:  # a backend refusing its options as it is built
        raise_diagnosed(dirpath, protocol or BARE_PATH_PROTOCOL, err)
        raise


GLOB_CHARACTERS = "*?["


def odd_segment_in_dirpath(dirpath: str) -> tuple[str, str] | None:
    """``(cause, fix)`` when an object-store ``dirpath`` has a ``.``, ``..`` or empty segment: s3fs and
    boto3 keep such a key literally, but obstore's path parser refuses it, so the run could write and
    commit checkpoints it can never pull.

    Example:
        >>> odd_segment_in_dirpath("s3://bucket/x/./run")[0]
        "has the path segment '.', which object stores keep literally but the fast client cannot read back"
        >>> odd_segment_in_dirpath("s3://bucket/x//run")[0][:30], odd_segment_in_dirpath("s3://bucket/x/run/") is None
        ("has an empty path segment ('//", True)
        >>> odd_segment_in_dirpath("./runs/../exp1") is None  # a local path: the OS resolves it
        True
    """
    protocol, path = fsspec.core.split_protocol(dirpath)
    if protocol is None or backend_of(protocol).extra is None:
        return None  # not an object store a spot-callbacks extra installs
    segments = path.rstrip("/").split("/")
    if "" in segments:
        cause = "has an empty path segment ('//'), which object stores keep literally but the fast client cannot read back"
        return cause, "write the URL with single slashes between folders"
    odd = next((segment for segment in segments if segment in (".", "..")), None)
    if odd is None:
        return None
    cause = f"has the path segment {odd!r}, which object stores keep literally but the fast client cannot read back"
    return cause, "write the folder path without '.' and '..' segments"


def glob_in_dirpath(dirpath: str) -> tuple[str, str] | None:
    """``(cause, fix)`` when ``dirpath`` holds a character fsspec expands as a glob (``*``, ``?``, ``[``):
    its deletes expand them, so retention could delete another folder's objects that match.

    Example:
        >>> glob_in_dirpath("s3://bucket/run[1]")[0]
        "contains '[', which fsspec expands as a glob when it deletes: retention could delete the objects of every folder it matches (s3://bucket/run1, ...)"
        >>> glob_in_dirpath("s3://bucket/run-1") is None
        True
    """
    found = [char for char in GLOB_CHARACTERS if char in dirpath]
    if not found:
        return None
    example = re.sub(r"\[([^\]]*)\]", r"\1", dirpath).replace("*", "").replace("?", "")
    cause = (
        f"contains {found[0]!r}, which fsspec expands as a glob when it deletes: retention could delete "
        f"the objects of every folder it matches ({example}, ...)"
    )
    return cause, "name the folder without *, ? and [ (e.g. with '-' or '_')"


def misread_url(dirpath: str) -> tuple[str, str] | None:
    """``(cause, fix)`` when ``dirpath`` looks like a URL with a slash missing after its scheme, which
    fsspec would silently read as a local folder (``s3:/bucket/run`` is the folder ``s3:``); else ``None``.

    Any scheme-like word (two characters or more) before ``:/`` counts, and a known protocol
    before a bare ``:`` too (``s3:bucket``). ``./s3:/x`` spells a local folder with a colon.

    Example:
        >>> misread_url("s3:/bucket/run")[1]
        "write 's3://bucket/run' (two slashes after 's3:'), or './s3:/bucket/run' if you do mean a local folder"
        >>> misread_url("runs/exp:1") is None and misread_url("C:/runs") is None
        True
    """
    if "://" in dirpath:
        return None
    match = _SCHEME_WITHOUT_SLASHES.match(dirpath)
    if match is None:
        return None
    scheme, rest = match.groups()
    known = scheme.lower() in (*CLOUD_BACKENDS, *LOCAL_PROTOCOLS, *fsspec.available_protocols())
    if not rest.startswith("/") and not known:
        return None  # "exp:1/run": a folder name with a colon, not a URL
    slashes = "one slash" if rest.startswith("/") and not rest.startswith("//") else "no slash"
    fixed = f"{scheme}://{rest}" if scheme.lower() in LOCAL_PROTOCOLS else f"{scheme}://{rest.lstrip('/')}"
    where = (
        "in the current directory"
        if scheme.lower() in LOCAL_PROTOCOLS
        else "(storage_options ignored, checkpoints on a disk that dies with the machine)"
    )
    cause = f"{slashes} after {scheme + ':'!r}, so it would be a local folder named {scheme + ':'!r} {where}"
    return (
        cause,
        f"write {fixed!r} (two slashes after {scheme + ':'!r}), or './{dirpath}' if you do mean a local folder",
    )


def is_local_path(dirpath: str) -> bool:
    """True when ``dirpath`` names a folder of the local filesystem (a bare path, ``file://``, ``local://``).

    Example:
        >>> is_local_path("runs/exp1"), is_local_path("file:///tmp/x"), is_local_path("s3://b/r")
        (True, True, False)
    """
    protocol, _ = fsspec.core.split_protocol(dirpath)
    return protocol is None or protocol in LOCAL_PROTOCOLS


def check_protocol(dirpath: str, protocol: str) -> None:
    """Raise :class:`UnknownStoreError` unless fsspec knows ``protocol`` and its package imports."""
    if protocol not in fsspec.available_protocols():
        close = difflib.get_close_matches(protocol, [*CLOUD_BACKENDS, *BUILT_IN], n=1, cutoff=0.5)
        suggestion = f"did you mean {close[0]}://? " if close else ""
        clouds = [backend for backend in BACKENDS if backend.extra]
        first, *others = (backend.extra for backend in clouds)
        raise UnknownStoreError(
            dirpath,
            f"fsspec knows no protocol {protocol!r} (installed backends: {', '.join(installed_protocols())})",
            f"{suggestion}use {', '.join(backend.url_prefix for backend in clouds)} or a local path; "
            f"pip install 'spot-callbacks[{first}]' (or {', '.join(f'[{extra}]' for extra in others)}) "
            "adds a cloud backend",
        )
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as err:
        package, extra = CLOUD_BACKENDS.get(protocol, (None, None))
        fix = (
            f"pip install 'spot-callbacks[{extra}]'" if extra else f"install the package fsspec names: {err}"
        )
        raise UnknownStoreError(
            dirpath,
            f"protocol {protocol!r} needs the package {package or 'behind it'}, which is not installed "
            f"(installed backends: {', '.join(installed_protocols())})",
            fix,
            err,
        ) from None


# Keys every fsspec filesystem takes beyond its class's own signature (fsspec.spec._Cached, AbstractFileSystem).
_FSSPEC_OPTION_NAMES = frozenset(
    {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "asynchronous", "loop"}
)


def option_names(protocol: str) -> frozenset[str]:
    """The ``storage_options`` keys the backend of ``protocol`` accepts: its class's signature (and its
    bases'), fsspec's own, and what it hands on to the client it builds.

    Example:
        >>> "endpoint_url" in option_names("s3"), "endpoint" in option_names("s3")
        (True, False)
    """
    cls = fsspec.get_filesystem_class(protocol)
    names: set[str] = set(_FSSPEC_OPTION_NAMES)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        names.update(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    names.discard("self")
    return frozenset(names | _row_of_package(cls).passed_on_options)


def _row_of_package(cls: type) -> Backend:
    """The table's row whose package implements the filesystem class ``cls`` (an empty row if none)."""
    package = cls.__module__.split(".")[0]
    return next((backend for backend in BACKENDS if backend.package == package), Backend(package, ()))


def check_option_names(protocol: str, storage_options: dict[str, Any] | None) -> None:
    """Raise :class:`ConfigError` for a ``storage_options`` key the backend of ``protocol`` does not take,
    with the closest one it does ("did you mean ..."): the backend's own error comes late and names
    its internals (``AioSession.__init__() got an unexpected keyword argument 'endpoint'``), and
    gcsfs or adlfs ignore a mistyped key silently.

    Example:
        >>> check_option_names("s3", {"endpoint": "http://localhost:9000"})
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.ConfigError: storage_options key 'endpoint' is not an option of s3fs.S3FileSystem; did you mean 'endpoint_url'?
    """
    if not storage_options:
        return
    try:
        cls = fsspec.get_filesystem_class(protocol)
        accepted = option_names(protocol)
    except (ImportError, ValueError):
        return  # check_protocol says what is missing
    package = cls.__module__.split(".")[0]
    for key in storage_options:
        if not isinstance(key, str) or key in accepted:
            continue
        close = difflib.get_close_matches(key, sorted(accepted), n=1, cutoff=0.75)
        # A strict backend (s3fs hands every other key to AioSession, which raises TypeError at the
        # first request) fails on any unknown key; elsewhere an unknown key may be read from
        # **kwargs, so only a near miss of a known one is an error.
        if not close and not _row_of_package(cls).strict_options:
            continue
        where = f"storage_options key {key!r} is not an option of {package}.{cls.__name__}"
        if close:
            raise ConfigError(f"{where}; did you mean {close[0]!r}?")
        shown = sorted(name for name in accepted if name not in _FSSPEC_OPTION_NAMES)
        raise ConfigError(f"{where}; its options are {', '.join(shown)}")


def raise_diagnosed(dirpath: str, protocol: str, err: BaseException) -> None:
    """Raise :class:`StoreUnavailableError` with the cause and fix of a backend's failure to build its
    filesystem (no credentials, say) when :func:`~spot_callbacks.store.diagnosis.diagnose` knows it;
    return otherwise (the caller re-raises the original)."""
    from spot_callbacks.store.diagnosis import diagnose

    found = diagnose(err, protocol, dirpath)
    if found.specific:
        raise StoreUnavailableError(dirpath, found.cause, found.fix, err) from None


def installed_protocols() -> list[str]:
    """The local protocols and every cloud protocol whose package is installed.

    Example:
        >>> installed_protocols()[:2]
        ['file', 'memory']
    """
    clouds = [p for p, (package, _) in CLOUD_BACKENDS.items() if importlib.util.find_spec(package)]
    return [*BUILT_IN, *clouds]
