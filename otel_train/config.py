"""Settings: defaults < ``OTEL_TRAIN_*`` env < ``config`` mapping < keyword overrides < ``save_path``.

Pure: knows nothing of OTel or files. Every problem becomes a one-line :class:`ConfigError` that says
what is wrong, where the value came from (env var, config key or keyword) and how to fix it.
Checks that need the file system (writable directory) or imports (handler factories) belong to the
runtime.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from otel_train.errors import ConfigError
import otel_train.profiling.schedule as _profile
from otel_train.redact import check_entry, strip_userinfo

ENV_PREFIX = "OTEL_TRAIN_"
ENV_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
ENV_SDK_DISABLED = "OTEL_SDK_DISABLED"

EXPORTERS = ("jsonl", "otlp", "console", "none")
TELEMETRY_SOURCES = ("process", "cuda", "nvml")
COLLECTIVES = ("auto", "on", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_SOURCE_RE = re.compile(r"[A-Za-z0-9_.-]+")
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
# "module:function" (function may be dotted) or "module.function" (at least one dot).
_HANDLER_RE = re.compile(rf"{_DOTTED}:{_DOTTED}|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_MAX_SHOWN = 80
MAX_FILE_SIZE_MB = 1024 * 1024  # 1 TiB: rotation beyond that is no rotation
MAX_BACKUP_COUNT = 10_000  # each rotation renames every segment
MAX_INT = 2**53  # every JSON reader (doubles) holds it exactly; readers reject larger counters

Handler = str | Callable[..., Any]


@dataclass(frozen=True, slots=True)
class Settings:
    """Resolved, validated settings; see docs/settings.md for the meaning of each field."""

    enabled: bool = False
    save_path: str | None = None
    trace_hooks: bool = False
    batch_stats_every: int = 1
    max_file_size_mb: float = 128.0
    backup_count: int = 3
    source: str = "training"
    run_id: str | None = None
    handlers: tuple[Handler, ...] = ()
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    attempt: int | None = None
    job_id: str | None = None
    fsync: bool = False
    trace_per_step: bool = True
    trace_group_size: int = 64
    digest_s: float = 10.0
    log_bridge: bool = False
    log_level: str = "WARNING"
    telemetry_every: int = 0
    telemetry_sources: tuple[str, ...] = ("process",)
    traces_exporter: tuple[str, ...] = ("jsonl",)
    watchdog: bool = True
    heartbeat_s: float = 10.0
    stall_min_s: float = 10.0
    stall_factor: float = 5.0
    redact: tuple[str, ...] = ()
    allow_shared_dir: bool = False
    collectives: str = "auto"
    fr_dir: str | None = None  # None: <save_path>/flight_recorder (see fr_path)
    host: str | None = None  # None: socket.gethostname() (the host records carry; docs/clock.md)
    profile_ranks: tuple[int, ...] | str | None = None  # "all" or ranks (docs/profiling.md)
    profile_steps: str | None = None  # normalised "A-B" or "every=N:K"
    profile_on: tuple[str, ...] = ()
    profile_window: int = 3
    profile_max_windows: int = 3
    profile_activities: tuple[str, ...] = ("cpu", "cuda")
    memory_snapshot: str = "off"

    @property
    def fr_path(self) -> str:
        """Where Flight Recorder dumps go: ``fr_dir``, else ``<save_path>/flight_recorder``."""
        if self.fr_dir is not None:
            return self.fr_dir
        return os.path.join(self.save_path or ".", "flight_recorder")


# Converters take (value, from_env) and return the typed value; they raise ValueError or TypeError,
# which the resolver turns into a ConfigError using the field's ``expect`` text.
Converter = Callable[[Any, bool], Any]


def _bool(value: Any, from_env: bool) -> bool:
    if from_env:
        text = value.strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ValueError(value)
    if isinstance(value, bool):
        return value
    raise TypeError(value)


def _int_at_least(minimum: int, maximum: int = MAX_INT) -> Converter:
    def convert(value: Any, from_env: bool) -> int:
        if from_env:
            value = int(value.strip())
        elif isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(value)
        if not minimum <= value <= maximum:
            raise ValueError(value)
        return int(value)

    return convert


def _float_range(minimum: float, maximum: float = math.inf, *, above: bool = False) -> Converter:
    """Finite floats from ``minimum`` (excluded when ``above``) to ``maximum``."""

    def convert(value: Any, from_env: bool) -> float:
        if from_env:
            value = value.strip()
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(value)
        number = float(value)  # a huge int raises OverflowError: a bad value like any other
        if not math.isfinite(number) or number < minimum or number > maximum or (above and number == minimum):
            raise ValueError(value)
        return number

    return convert


_positive_float = _float_range(0.0, above=True)


def _float_at_least(minimum: float) -> Converter:
    return _float_range(minimum)


def _line(value: Any) -> str:
    """A non-empty str without NUL: what every text setting must be."""
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise ValueError(value)
    return value.strip()


def _text(value: Any, from_env: bool) -> str:
    text = _line(value)
    text.encode()  # a lone surrogate (an undecodable env byte) cannot be written to any record
    return text


def _path(value: Any, from_env: bool) -> str:
    # Paths may hold undecodable bytes (surrogate-escaped): the OS takes them; NUL it does not.
    return _line(os.fspath(value) if isinstance(value, os.PathLike) else value)


def _source(value: Any, from_env: bool) -> str:
    if not isinstance(value, str) or not _SOURCE_RE.fullmatch(value):
        raise ValueError(value)
    return value


def _log_level(value: Any, from_env: bool) -> str:
    if not isinstance(value, str) or value.strip().upper() not in LOG_LEVELS:
        raise ValueError(value)
    return value.strip().upper()


def _choice(choices: tuple[str, ...]) -> Converter:
    def convert(value: Any, from_env: bool) -> str:
        if not isinstance(value, str) or value.strip().lower() not in choices:
            raise ValueError(value)
        return value.strip().lower()

    return convert


def _items(value: Any) -> list[Any]:
    """A comma-separated string or a list/tuple, as a list of stripped, non-empty items."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    if isinstance(value, (list, tuple)):
        return [item.strip() if isinstance(item, str) else item for item in value]
    raise TypeError(value)


def _names(choices: tuple[str, ...]) -> Converter:
    def convert(value: Any, from_env: bool) -> tuple[str, ...]:
        names = _items(value)
        if not all(isinstance(name, str) and name.lower() in choices for name in names):
            raise ValueError(value)
        unique = tuple(dict.fromkeys(name.lower() for name in names))
        if "none" in unique:
            if len(unique) > 1:  # "none" means no exporter at all; mixing it in is a mistake
                raise ValueError(value)
            return ()
        return unique

    return convert


def _handlers(value: Any, from_env: bool) -> tuple[Handler, ...]:
    handlers = _items(value)
    for handler in handlers:
        if isinstance(handler, str):
            if not _HANDLER_RE.fullmatch(handler):
                raise ValueError(handler)
        elif not callable(handler):
            raise TypeError(handler)
    return tuple(handlers)


def _redact(value: Any, from_env: bool) -> tuple[str, ...]:
    entries = _split_patterns(value) if from_env else _items(value)
    for entry in entries:
        check_entry(entry)
    return tuple(entries)


def _split_patterns(text: str) -> list[str]:
    """Comma-separated entries; a comma inside ``{...}`` or ``[...]`` belongs to a pattern (``{3,}``)."""
    entries, current, depth = [], [], 0
    for char in text:
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth = max(0, depth - 1)
        if char == "," and depth == 0:
            entries.append("".join(current))
            current = []
        else:
            current.append(char)
    entries.append("".join(current))
    return [entry.strip() for entry in entries if entry.strip()]


def _optional(convert: Converter) -> Converter:
    def optional(value: Any, from_env: bool) -> Any:
        return None if value is None else convert(value, from_env)

    return optional


@dataclass(frozen=True, slots=True)
class _Field:
    convert: Converter
    expect: str  # what a valid value looks like, for the error message


_FIELDS: dict[str, _Field] = {
    "enabled": _Field(_bool, "true or false (env: 1/0/true/false/yes/no/on/off)"),
    "save_path": _Field(_optional(_path), "a non-empty directory path without NUL bytes"),
    "trace_hooks": _Field(_bool, "true or false (env: 1/0/true/false/yes/no/on/off)"),
    "batch_stats_every": _Field(_int_at_least(0), "a whole number from 0 to 2**53 (0 disables)"),
    "max_file_size_mb": _Field(_float_range(0.0, MAX_FILE_SIZE_MB, above=True),
                               f"a number of megabytes > 0 and at most {MAX_FILE_SIZE_MB}, e.g. 128 or 0.5"),
    "backup_count": _Field(_int_at_least(0, MAX_BACKUP_COUNT), f"a whole number from 0 to {MAX_BACKUP_COUNT}"),
    "source": _Field(_source, "a non-empty name of letters, digits, '_', '.' or '-' (it is part of a file name)"),
    "run_id": _Field(_optional(_text), "a non-empty string shared by all ranks of the run (no NUL, valid UTF-8)"),
    "handlers": _Field(
        _handlers,
        "comma-separated 'module:function' or 'module.function' paths (in config/kwargs also a list of those or callables)",
    ),
    "rank": _Field(_optional(_int_at_least(0)), "a whole number from 0 to 2**53"),
    "local_rank": _Field(_optional(_int_at_least(0)), "a whole number from 0 to 2**53"),
    "world_size": _Field(_optional(_int_at_least(1)), "a whole number from 1 to 2**53"),
    "attempt": _Field(_optional(_int_at_least(0)), "a whole number from 0 to 2**53"),
    "job_id": _Field(_optional(_text), "a non-empty string (no NUL, valid UTF-8)"),
    "fsync": _Field(_bool, "true or false (env: 1/0/true/false/yes/no/on/off)"),
    "trace_per_step": _Field(_bool, "true or false (env: 1/0/true/false/yes/no/on/off)"),
    "trace_group_size": _Field(_int_at_least(1), "a whole number of ranks from 1 to 2**53 per step trace"),
    "digest_s": _Field(_float_at_least(0.0), "a number of seconds >= 0 between digests (0: none)"),
    "log_bridge": _Field(_bool, "true or false (env: 1/0/true/false/yes/no/on/off)"),
    "log_level": _Field(_log_level, f"a logging level name, one of {', '.join(LOG_LEVELS)}"),
    "telemetry_every": _Field(_int_at_least(0), "a whole number of steps from 0 to 2**53 (0 disables)"),
    "telemetry_sources": _Field(_names(TELEMETRY_SOURCES), f"a comma list of {', '.join(TELEMETRY_SOURCES)}"),
    "traces_exporter": _Field(
        _names(EXPORTERS), "a comma list of jsonl, otlp, console, or 'none' alone (e.g. 'jsonl,otlp')"
    ),
    "watchdog": _Field(_bool, "true or false (env: 1/0/true/false/yes/no/on/off)"),
    "heartbeat_s": _Field(_float_at_least(0.0), "a number of seconds >= 0 (0 disables heartbeats)"),
    "stall_min_s": _Field(_positive_float, "a number of seconds > 0"),
    "stall_factor": _Field(_float_at_least(1.0), "a number >= 1 (a multiple of the name's p99 duration)"),
    "collectives": _Field(_choice(COLLECTIVES), "one of auto, on, off (docs/comm.md)"),
    "fr_dir": _Field(_optional(_path), "a non-empty directory path without NUL bytes"),
    "host": _Field(_optional(_text), "a non-empty host name on one line"),
    "allow_shared_dir": _Field(_bool, "true or false (env: 1/0/true/false/yes/no/on/off)"),
    "profile_ranks": _Field(_optional(_profile.profile_ranks), "'all' or comma-separated ranks, e.g. '0,5'"),
    "profile_steps": _Field(_optional(_profile.profile_steps),
                            "'A-B' (inclusive, A <= B, at most 10000 steps) or 'every=N:K' (K steps every N, 1 <= K <= N)"),
    "profile_on": _Field(_profile.profile_on, "a comma list of straggler, slow_step (or empty: none)"),
    "profile_window": _Field(_int_at_least(1, _profile.MAX_WINDOW), "a whole number of steps from 1 to 10000"),
    "profile_max_windows": _Field(_int_at_least(0, MAX_INT), "a whole number of windows from 0 to 2**53 (0: none)"),
    "profile_activities": _Field(_profile.profile_activities,
                                 "a comma list of cpu, cuda, shapes, stack, memory with cpu or cuda in it"),
    "memory_snapshot": _Field(_choice(_profile.MEMORY_SNAPSHOT), "one of off, on_oom (docs/profiling.md)"),
    "redact": _Field(_redact, "a comma list of more secret name parts (e.g. WANDB) and 're:<regex>' value patterns"),
}

ENV_VARS: dict[str, str] = {
    key: ENV_TRACES_EXPORTER if key == "traces_exporter" else ENV_PREFIX + key.upper() for key in _FIELDS
}
"""Setting key -> the environment variable that sets it."""
_KEY_BY_ENV = {var: key for key, var in ENV_VARS.items()}


def _shown(value: Any) -> str:
    try:
        text = strip_userinfo(repr(value))  # repr: one line, NUL and surrogates escaped
    except Exception:  # noqa: BLE001 - a value whose repr raises is still a bad value
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else "see docs/settings.md for the valid names"


def _convert(key: str, value: Any, where: str, from_env: bool) -> Any:
    field = _FIELDS[key]
    try:
        return field.convert(value, from_env)
    except Exception:  # noqa: BLE001 - whatever a bad value raises (OverflowError, a broken __eq__ ...)
        raise ConfigError(f"invalid {where}: got {_shown(value)}, expected {field.expect}") from None


def _env_layer(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for var, raw in env.items():
        if var.startswith(ENV_PREFIX) and var not in _KEY_BY_ENV:
            # A typo in an env var would otherwise silently fall back to the default.
            hint = _suggest(var, list(ENV_VARS.values()))
            raise ConfigError(f"unknown environment variable {var}: {hint} (unset it or fix the name)")
        key = _KEY_BY_ENV.get(var)
        if key is None or not raw.strip():  # OTel convention: an empty variable counts as unset
            continue
        values[key] = _convert(key, raw, f"environment variable {var}", from_env=True)
    return values


def _mapping_layer(mapping: Mapping[str, Any], what: str) -> dict[str, Any]:
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"invalid {what}s: got {_shown(mapping)}, expected a mapping of setting names to values")
    values: dict[str, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str) or key not in _FIELDS:
            hint = _suggest(key, list(_FIELDS)) if isinstance(key, str) else "setting names are strings"
            raise ConfigError(f"unknown {what} {_shown(key)}: {hint}")
        values[key] = _convert(key, value, f"{what} {key!r}", from_env=False)
    return values


def _sdk_disabled(env: Mapping[str, str]) -> bool:
    return env.get(ENV_SDK_DISABLED, "").strip().lower() == "true"


def resolve_settings(
    *,
    save_path: str | os.PathLike[str] | None = None,
    config: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Resolve and validate settings; raises :class:`ConfigError` (one line) on any problem.

    Precedence: defaults < ``OTEL_TRAIN_*`` env (and ``OTEL_TRACES_EXPORTER``) < ``config`` <
    ``overrides`` < ``save_path``. ``env=None`` reads ``os.environ``. ``OTEL_SDK_DISABLED=true`` is a
    kill switch: it returns disabled default settings without validating anything.
    """
    env = os.environ if env is None else env
    if _sdk_disabled(env):
        return Settings()
    values = _env_layer(env)
    if config is not None:
        values.update(_mapping_layer(config, "config key"))
    if overrides is not None:
        values.update(_mapping_layer(overrides, "keyword argument"))
    if save_path is not None:
        values["save_path"] = _convert("save_path", save_path, "the save_path argument", from_env=False)
    settings = Settings(**values)
    if settings.enabled and settings.save_path is None:
        raise ConfigError(
            f"tracing is enabled but no save_path is set: pass save_path=..., set config key 'save_path' "
            f"or {ENV_VARS['save_path']}, or disable with {ENV_VARS['enabled']}=0"
        )
    if (settings.profile_ranks is None) != (settings.profile_steps is None):
        given, missing = ("profile_ranks", "profile_steps") if settings.profile_steps is None else (
            "profile_steps", "profile_ranks")
        raise ConfigError(f"{given} is set but {missing} is not: scheduled profiler windows need both "
                          f"(set {ENV_VARS[missing]}, e.g. profile_ranks=0 profile_steps=10-12; docs/profiling.md)")
    return settings


def _handler_name(handler: Handler) -> str:
    if isinstance(handler, str):
        return handler
    qualname = getattr(handler, "__qualname__", type(handler).__qualname__)
    return f"{getattr(handler, '__module__', type(handler).__module__)}.{qualname}"


def settings_summary(settings: Settings) -> dict[str, Any]:
    """JSON-safe dict of the resolved settings (for the ``process_start`` record)."""
    summary: dict[str, Any] = {}
    for field in fields(settings):
        value = getattr(settings, field.name)
        if field.name == "handlers":
            value = [_handler_name(handler) for handler in value]
        elif isinstance(value, tuple):
            value = list(value)
        summary[field.name] = value
    return summary
