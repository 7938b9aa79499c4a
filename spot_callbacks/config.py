"""`SpotConfig`: the arguments both adapters take, their parsing and validation."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import yaml

import spot_callbacks.settings as settings
from spot_callbacks._format import parse_duration
from spot_callbacks.errors import ConfigError
from spot_callbacks.preemption.sources import NOTICE_SOURCES
from spot_callbacks.store.backends import EXAMPLE_URLS
from spot_callbacks.store.resolve import glob_in_dirpath, is_local_path, misread_url, odd_segment_in_dirpath

PREEMPTION_SOURCES = tuple(NOTICE_SOURCES)  # the one table of notice sources' names
ON_PREEMPTION_CHOICES = ("stop", "continue")


@dataclass
class SpotConfig:
    """Everything the spot checkpoint callbacks are configured with.

    The same fields are the keyword arguments of ``spot_callbacks.lightning.SpotCheckpoint`` and
    ``spot_callbacks.hf.SpotCheckpointCallback``, the keys of their YAML files, and a dataclass
    that ``transformers.HfArgumentParser`` and jsonargparse read.

    Args:
        dirpath: fsspec URL or local path where committed checkpoints live.
        interval: wall-clock time between checkpoints: ``"90s"``, ``"15min"``, ``"1h30"``,
            ``"1h 30m"``, ISO-8601 ``"PT1H30M"``, seconds as a number (see :func:`parse_duration`),
            ``"auto"`` (from measured checkpoint cost and the interruption rate) or ``None`` (off).
        every_n_steps: also checkpoint every N optimizer steps.
        keep_last: committed checkpoints kept in ``dirpath`` (0 keeps all); the newest valid one
            is never deleted.
        scratch_dir: fast local disk for staging; default ``$SPOT_SCRATCH``, else a temp dir.
        storage_options: passed to fsspec (endpoint, credentials, ...): a dict, a JSON object
            string, or ``"@FILE"`` (a JSON or YAML file read at construction); ``${NAME}`` in a
            value is the environment variable ``NAME``. Keep credentials out of configs that are
            saved (LightningCLI's ``config.yaml``) with either; see :func:`load_storage_options`.
        preemption: notice sources: ``"SIGTERM"``, ``"SIGUSR1"``, ``"SIGINT"`` (Ctrl-C: the first
            checkpoints and stops, a second stops at once), ``"aws"``, ``"gcp"``, ``"azure"``,
            ``"file"`` (``$SPOT_NOTICE_FILE`` appears); ``"auto"`` is SIGTERM (and SIGUSR1 inside
            a SLURM job), SIGINT, plus the cloud detected and the notice file if one is set;
            ``[]`` is none. The names are those of ``preemption.sources.NOTICE_SOURCES``.
        on_preemption: after the emergency checkpoint commits, ``"stop"`` training gracefully
            or ``"continue"``.
        interruptions_per_hour: expected interruption rate, for ``interval="auto"``; ``None``:
            learned from the run's own interruptions (recorded in its manifests), from 0.1/h.
        verbose: also log a line per checkpoint ("committed ...", "retention deleted ...");
            off, as Lightning's ``ModelCheckpoint(verbose=False)``, they are debug lines. Warnings,
            the resume line and the emergency lines are always shown.

    Raises:
        ConfigError: a value is out of range or of the wrong kind; the message names the key,
            the value and what is accepted.

    Example:
        >>> cfg = SpotConfig(dirpath="s3://bucket/run", interval="1h30min", keep_last=2)
        >>> cfg.interval_seconds
        5400.0
        >>> SpotConfig(dirpath="runs/a", interval="30 mins").interval_seconds
        1800.0
    """

    dirpath: str = field(metadata={"help": "fsspec URL or local path where committed checkpoints live"})
    # Union member order matters to HfArgumentParser: it keeps the member after the first for
    # command-line parsing, so str must come second to accept "30min".
    interval: Union[float, str, None] = field(  # noqa: UP007 - HfArgumentParser reads typing.Union
        default="30min",
        metadata={"help": "time between checkpoints: '90s', '15min', '1h', seconds, 'auto', or None"},
    )
    every_n_steps: Union[int, None] = field(  # noqa: UP007
        default=None, metadata={"help": "also checkpoint every N optimizer steps"}
    )
    keep_last: int = field(default=3, metadata={"help": "committed checkpoints kept (0 keeps all)"})
    scratch_dir: Union[str, None] = field(  # noqa: UP007
        default=None, metadata={"help": "fast local staging disk; default $SPOT_SCRATCH, else a temp dir"}
    )
    storage_options: Union[dict, str, None] = field(  # noqa: UP007
        default=None,
        metadata={
            "help": "fsspec storage options: a dict, a JSON string or @FILE; ${NAME} reads the environment"
        },
    )
    preemption: Union[str, list[str]] = field(  # noqa: UP007
        default="auto",
        metadata={"help": f"notice sources: {' '.join(PREEMPTION_SOURCES)}, 'auto' or none"},
    )
    on_preemption: Literal["stop", "continue"] = field(
        default="stop", metadata={"help": "after the emergency checkpoint: stop or continue"}
    )
    interruptions_per_hour: Union[float, None] = field(  # noqa: UP007
        default=None, metadata={"help": "interruption rate for interval='auto'; None: learned from the run"}
    )
    verbose: bool = field(
        default=False, metadata={"help": "log a line per checkpoint (committed, retention deleted)"}
    )

    def __post_init__(self) -> None:
        self.dirpath = _check_dirpath(self.dirpath)
        self.interval = _normalize_interval(self.interval)
        self.every_n_steps = _check_optional_positive_int("every_n_steps", self.every_n_steps)
        self.keep_last = _check_non_negative_int("keep_last", self.keep_last)
        if self.scratch_dir is not None and not isinstance(self.scratch_dir, (str, os.PathLike)):
            raise ConfigError(f"scratch_dir={self.scratch_dir!r} must be a local folder path or None")
        if self.scratch_dir is not None:
            self.scratch_dir = os.fspath(self.scratch_dir)
        self.storage_options = load_storage_options(self.storage_options)
        _check_options_fit_dirpath(self.dirpath, self.storage_options)
        self.preemption = _normalize_preemption(self.preemption)
        if self.on_preemption not in ON_PREEMPTION_CHOICES:
            raise ConfigError(
                f"on_preemption={self.on_preemption!r} is not accepted; use one of {list(ON_PREEMPTION_CHOICES)}"
            )
        self.interruptions_per_hour = _check_rate(self.interruptions_per_hour)
        if not isinstance(self.verbose, bool):
            raise ConfigError(f"verbose={self.verbose!r} must be true or false")

    @property
    def interval_seconds(self) -> float | None:
        """The fixed interval in seconds; ``None`` when off or ``"auto"`` (see :attr:`interval_is_auto`)."""
        if self.interval == "auto":
            return None
        return parse_duration(self.interval)

    @property
    def interval_is_auto(self) -> bool:
        return self.interval == "auto"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> SpotConfig:
        """Build from a mapping, rejecting unknown keys with the closest accepted name.

        Example:
            >>> SpotConfig.from_dict({"dirpath": "runs/a", "keep_last": 5}).keep_last
            5
        """
        if not isinstance(values, dict):
            raise ConfigError(f"{source} must be a mapping of SpotConfig keys, got {type(values).__name__}")
        accepted = cls.field_names()
        for key in values:
            if key not in accepted:
                raise ConfigError(
                    f"unknown key {key!r} in {source}{closest_hint(key, accepted)}; "
                    f"accepted keys: {', '.join(accepted)}"
                )
        if "dirpath" not in values:
            raise ConfigError(f"{source} has no 'dirpath'; set it to an fsspec URL or a local folder")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> SpotConfig:
        """Read a YAML file whose top-level keys are the SpotConfig fields.

        Example:
            >>> import tempfile, pathlib
            >>> p = pathlib.Path(tempfile.mkdtemp()) / "spot.yaml"
            >>> _ = p.write_text("dirpath: runs/exp1\\ninterval: 15min\\n")
            >>> SpotConfig.from_yaml(p).interval_seconds
            900.0
        """
        text = Path(path).read_text()
        try:
            values = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{os.fspath(path)} is not valid YAML: {err}") from err
        return cls.from_dict(values, source=os.fspath(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def redacted(self) -> dict[str, Any]:
        """The config as a dict with storage option values hidden, safe for logs and files; an endpoint
        URL stays readable ("which endpoint am I hitting" is the first question), less its credentials."""
        values = self.to_dict()
        if values["storage_options"]:
            values["storage_options"] = {
                key: shown_option_value(key, value) for key, value in values["storage_options"].items()
            }
        return values

    def __repr__(self) -> str:
        # storage_options carry credentials; a repr ends up in logs and tracebacks.
        fields = ", ".join(f"{key}={value!r}" for key, value in self.redacted().items())
        return f"SpotConfig({fields})"


# Option values that locate a store and authorise nothing: shown (a URL less its credentials).
PUBLIC_OPTION_NAMES = frozenset(
    {"endpoint_url", "region", "region_name", "project", "account_name", "account_host"}
)
_CREDENTIAL_QUERY = re.compile(r"sig|token|key|secret|pass|cred|auth|sas|session|x-amz-", re.IGNORECASE)


def shown_option_value(name: str, value: Any) -> str:
    """What a log may show of the storage option ``name``: a public one's value (a URL without its
    user, password and credential query parameters), ``***`` for any other.

    Example:
        >>> shown_option_value("endpoint_url", "https://user:pw@minio:9000/?X-Amz-Signature=abc&x=1")
        'https://minio:9000/?x=1'
        >>> shown_option_value("secret", "hunter2")
        '***'
    """
    if name not in PUBLIC_OPTION_NAMES or not isinstance(value, str):
        return "***"
    return without_credentials(value)


def without_credentials(url: str) -> str:
    """``url`` less its userinfo and the query parameters that may be credentials (``sig``, ``token``...).

    Example:
        >>> without_credentials("http://127.0.0.1:9000")
        'http://127.0.0.1:9000'
    """
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "***"
    if ":" in host:  # IPv6
        host = f"[{host}]"
    query = "&".join(
        f"{name}={value}" if value else name
        for name, value in parse_qsl(parts.query, keep_blank_values=True)
        if not _CREDENTIAL_QUERY.search(name)
    )
    netloc = f"{host}{port}" if parts.netloc else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def closest_hint(name: object, accepted: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the accepted name closest to a mistyped one, else ``""``.

    Example:
        >>> closest_hint("intervall", ["dirpath", "interval"])
        " (did you mean 'interval'?)"
    """
    close = difflib.get_close_matches(str(name), accepted, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_Init = TypeVar("_Init", bound=Callable[..., None])


def checked_arguments(owner: str) -> Callable[[_Init], _Init]:
    """Decorate an ``__init__`` so a wrong argument raises a TypeError that names ``owner`` (the
    public class, not the class the hooks live in) and the closest accepted keyword.

    The signature stays the decorated one (``inspect.signature``, jsonargparse and LightningCLI
    read it through ``__wrapped__``).

    Example:
        >>> class Spot:
        ...     @checked_arguments("SpotCheckpoint")
        ...     def __init__(self, dirpath: str, interval: str = "30min") -> None:
        ...         self.interval = interval
        >>> Spot("runs/a", intervall="1h")
        Traceback (most recent call last):
        TypeError: SpotCheckpoint() got an unexpected keyword argument 'intervall' (did you mean 'interval'?); accepted: dirpath, interval
    """

    def decorate(init: _Init) -> _Init:
        signature = inspect.signature(init)
        accepted = [name for name in signature.parameters if name != "self"]

        @functools.wraps(init)
        def checked(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                signature.bind(self, *args, **kwargs)
            except TypeError as err:
                unknown = next((key for key in kwargs if key not in accepted), None)
                problem = (
                    f"got an unexpected keyword argument {unknown!r}{closest_hint(unknown, accepted)}"
                    if unknown is not None
                    else str(err)
                )
                raise TypeError(f"{owner}() {problem}; accepted: {', '.join(accepted)}") from None
            init(self, *args, **kwargs)

        return checked  # type: ignore[return-value]

    return decorate


def _check_dirpath(dirpath: Any) -> str:
    if isinstance(dirpath, os.PathLike):
        dirpath = os.fspath(dirpath)
    if not isinstance(dirpath, str) or not dirpath.strip():
        raise ConfigError(
            f"dirpath={dirpath!r} must be a non-empty fsspec URL or local path, e.g. {EXAMPLE_URLS[0]!r} or 'runs/exp1'"
        )
    if (misread := misread_url(dirpath)) is not None:
        cause, fix = misread
        raise ConfigError(f"dirpath={dirpath!r} has {cause}; {fix}")
    if (glob := glob_in_dirpath(dirpath)) is not None:
        cause, fix = glob
        raise ConfigError(f"dirpath={dirpath!r} {cause}; {fix}")
    if (odd := odd_segment_in_dirpath(dirpath)) is not None:
        cause, fix = odd
        raise ConfigError(f"dirpath={dirpath!r} {cause}; {fix}")
    return dirpath


def _check_options_fit_dirpath(dirpath: str, storage_options: dict[str, Any] | None) -> None:
    # A local folder takes no credentials or endpoint: options given for one mean the URL is not
    # what the user meant (a bucket name without its scheme), and they would be ignored silently.
    if storage_options and is_local_path(dirpath):
        raise ConfigError(
            f"storage_options ({', '.join(sorted(map(str, storage_options)))}) were given but "
            f"dirpath={dirpath!r} is a local folder, where they would be ignored; write the store's URL "
            f"(e.g. {', '.join(map(repr, EXAMPLE_URLS))}) or drop storage_options"
        )


def _normalize_interval(interval: Any) -> float | str | None:
    if interval is None or (
        isinstance(interval, str) and interval.strip().lower() in ("none", "null", "off")
    ):
        return None
    if isinstance(interval, str) and interval.strip().lower() == "auto":
        return "auto"
    seconds = parse_duration(interval, key="interval")
    return interval if isinstance(interval, str) else seconds


def _check_optional_positive_int(key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r} must be a positive integer or None (off)")
    return value


def _check_non_negative_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key}={value!r} must be an integer >= 0 (0 keeps all checkpoints)")
    return value


_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_OPTIONS_EXAMPLE = '\'{"endpoint_url": "http://localhost:9000"}\''


def load_storage_options(value: Any, source: str = "storage_options") -> dict[str, Any] | None:
    """fsspec storage options from a dict, a JSON object string or ``"@FILE"``, with ``${NAME}`` resolved.

    ``"@FILE"`` reads a JSON (or, for ``.yaml``/``.yml``, YAML) mapping when called. In every
    string value, ``${NAME}`` is replaced with the environment variable ``NAME``. Both keep
    credentials out of what a config records (LightningCLI's saved ``config.yaml`` holds the
    reference, not the secret). Error messages never quote a value: any may be a credential.

    Example:
        >>> import os
        >>> os.environ["DOC_SPOT_SECRET"] = "s3cr3t"
        >>> load_storage_options({"secret": "${DOC_SPOT_SECRET}", "client_kwargs": {"region_name": "x"}})
        {'secret': 's3cr3t', 'client_kwargs': {'region_name': 'x'}}
        >>> load_storage_options('{"anon": true}')
        {'anon': True}
        >>> load_storage_options({"secret": "${DOC_SPOT_UNSET}"})
        Traceback (most recent call last):
        ...
        spot_callbacks.errors.ConfigError: storage_options refers to ${DOC_SPOT_UNSET}, which is not set in the environment; export it before the run starts
    """
    if value is None:
        return None
    if isinstance(value, str):
        value = _parse_options_text(value, source)
    if not isinstance(value, dict):
        raise ConfigError(
            f"{source} must be a dict, a JSON object string or '@FILE', got {type(value).__name__}"
        )
    return _resolve_env_references(value, source)


def _parse_options_text(text: str, source: str) -> Any:
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        source = f"{source} file {path}"
        try:
            text = path.read_text()
        except OSError as err:
            raise ConfigError(f"cannot read {source}: {err.strerror or err}") from None
        if path.suffix.lower() in (".yaml", ".yml"):
            try:
                return _require_mapping(yaml.safe_load(text), source, "YAML mapping")
            except yaml.YAMLError as err:
                mark = getattr(err, "problem_mark", None)
                where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
                raise ConfigError(
                    f"{source} is not valid YAML{where}; write a mapping of option names"
                ) from None
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        # The message and the position only: never quote the document.
        raise ConfigError(
            f"{source} is not valid JSON ({err.msg}: line {err.lineno} column {err.colno}); "
            f"pass a JSON object such as {_OPTIONS_EXAMPLE}"
        ) from None
    return _require_mapping(options, source, "JSON object ({...})")


def _require_mapping(options: Any, source: str, what: str) -> dict[str, Any]:
    if not isinstance(options, dict):
        kind = "list" if isinstance(options, list) else type(options).__name__
        raise ConfigError(f"{source} must be a {what}, not a {kind}; e.g. {_OPTIONS_EXAMPLE}")
    return options


def _resolve_env_references(value: Any, source: str) -> Any:
    if isinstance(value, dict):
        return {key: _resolve_env_references(item, source) for key, item in value.items()}
    if isinstance(value, list):
        return [_resolve_env_references(item, source) for item in value]
    if isinstance(value, str):
        return _ENV_REFERENCE.sub(lambda match: _environment_value(match.group(1), source), value)
    return value


def _environment_value(name: str, source: str) -> str:
    value = settings.environment_variable(name)
    if value is None:
        raise ConfigError(
            f"{source} refers to ${{{name}}}, which is not set in the environment; "
            "export it before the run starts"
        )
    return value


def _normalize_preemption(value: Any) -> str | list[str]:
    if isinstance(value, str):
        value = value.strip()
        if value.lower() == "auto":
            return "auto"
        value = [part for part in re.split(r"[,\s]+", value) if part]
    if isinstance(value, (list, tuple)):
        if [str(v).lower() for v in value] == ["auto"]:
            return "auto"
        normalized = []
        canonical = {name.lower(): name for name in PREEMPTION_SOURCES}
        for source in value:
            name = canonical.get(str(source).lower())
            if name is None:
                raise ConfigError(
                    f"preemption source {source!r} is not known; use 'auto', [] (none) or a list of "
                    f"{list(PREEMPTION_SOURCES)}"
                )
            problem = NOTICE_SOURCES[name].problem()
            if problem is not None:
                raise ConfigError(f"preemption source {name!r} cannot be watched: {problem}")
            if name not in normalized:
                normalized.append(name)
        return normalized
    raise ConfigError(
        f"preemption={value!r} is not accepted; use 'auto', [] (none) or a list of {list(PREEMPTION_SOURCES)}"
    )


def _check_rate(value: Any) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(f"interruptions_per_hour={value!r} must be a number >= 0 (e.g. 0.05) or None")
    return float(value)
