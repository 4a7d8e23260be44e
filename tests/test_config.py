"""Settings resolution: every key from env / config / kwargs, precedence, and every ConfigError."""

from __future__ import annotations

import json
import pathlib
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_train.config import ENV_VARS, Settings, resolve_settings, settings_summary
from otel_train.errors import ConfigError


def factory(**_: Any) -> None:
    """A handler factory stand-in: only its qualified name matters here."""


# key -> (env string, python value for config/kwargs, expected resolved value); none equals the default.
CASES: dict[str, tuple[str, Any, Any]] = {
    "enabled": ("on", True, True),
    "save_path": ("/tmp/run", "/tmp/run", "/tmp/run"),
    "trace_hooks": ("yes", True, True),
    "batch_stats_every": ("0", 0, 0),
    "max_file_size_mb": ("0.5", 0.5, 0.5),
    "backup_count": ("7", 7, 7),
    "source": ("eval-2.b_x", "eval-2.b_x", "eval-2.b_x"),
    "run_id": ("run-42", "run-42", "run-42"),
    "handlers": ("pkg.mod:make, pkg.other.make", ["pkg.mod:make", "pkg.other.make"], ("pkg.mod:make", "pkg.other.make")),
    "rank": ("3", 3, 3),
    "local_rank": ("1", 1, 1),
    "world_size": ("8", 8, 8),
    "attempt": ("2", 2, 2),
    "job_id": ("12345", "12345", "12345"),
    "fsync": ("TRUE", True, True),
    "trace_per_step": ("off", False, False),
    "trace_group_size": ("16", 16, 16),
    "digest_s": ("2.5", 30, 30.0),
    "log_bridge": ("1", True, True),
    "log_level": ("debug", "info", None),
    "telemetry_every": ("50", 50, 50),
    "telemetry_sources": ("process,cuda, nvml", ["process", "nvml"], None),
    "traces_exporter": ("jsonl,otlp", "console", None),
    "watchdog": ("off", False, False),
    "heartbeat_s": ("0", 2, 2.0),
    "stall_min_s": ("2.5", 3, 3.0),
    "stall_factor": ("3", 1, 1.0),
    "allow_shared_dir": ("yes", True, True),
    "redact": ("WANDB, re:hf_[A-Za-z0-9]{30,}", ["WANDB", "re:x(y|z)"], ("WANDB", "re:x(y|z)")),
    "collectives": ("OFF", "on", "on"),
    "fr_dir": ("/tmp/fr", "/tmp/fr", "/tmp/fr"),
    "host": ("node-7", "node-7", "node-7"),
    "profile_ranks": ("0, 5", [5, 0], (0, 5)),
    "profile_steps": ("every = 500:2", "10-12", "10-12"),
    "profile_on": ("straggler,SLOW_STEP", ["straggler"], ("straggler",)),
    "profile_window": ("5", 2, 2),
    "profile_max_windows": ("1", 0, 0),
    "profile_activities": ("cpu,shapes,stack", ["cuda", "memory"], ("cuda", "memory")),
    "memory_snapshot": ("on_oom", "ON_OOM", "on_oom"),
}
ENABLED_ENV = {"OTEL_TRAIN_SAVE_PATH": "/tmp/base"}
# Settings that need another to be set (docs/profiling.md: scheduled windows need ranks and steps).
PARTNERS: dict[str, dict[str, str]] = {"profile_ranks": {"profile_steps": "1-2"}, "profile_steps": {"profile_ranks": "0"}}


def test_every_field_has_a_case_and_an_env_var() -> None:
    names = {f.name for f in fields(Settings)}
    assert set(CASES) == names
    assert set(ENV_VARS) == names
    assert ENV_VARS["traces_exporter"] == "OTEL_TRACES_EXPORTER"
    assert all(var == "OTEL_TRAIN_" + key.upper() for key, var in ENV_VARS.items() if key != "traces_exporter")


def test_defaults() -> None:
    assert resolve_settings(env={}) == Settings()
    assert Settings().traces_exporter == ("jsonl",)
    assert Settings().telemetry_sources == ("process",)


@pytest.mark.parametrize("key", sorted(CASES))
def test_each_setting_from_env(key: str) -> None:
    raw, _, expected = CASES[key]
    expected_env = {
        "heartbeat_s": 0.0,
        "stall_min_s": 2.5,
        "digest_s": 2.5,
        "stall_factor": 3.0,
        "log_level": "DEBUG",
        "telemetry_sources": ("process", "cuda", "nvml"),
        "traces_exporter": ("jsonl", "otlp"),
        "redact": ("WANDB", "re:hf_[A-Za-z0-9]{30,}"),  # the comma inside {30,} belongs to the pattern
        "collectives": "off",
        "profile_steps": "every=500:2",
        "profile_on": ("straggler", "slow_step"),
        "profile_window": 5,
        "profile_max_windows": 1,
        "profile_activities": ("cpu", "shapes", "stack"),
    }.get(key, expected)
    partner = {ENV_VARS[k]: v for k, v in PARTNERS.get(key, {}).items()}
    settings = resolve_settings(env={**ENABLED_ENV, **partner, ENV_VARS[key]: raw})
    assert getattr(settings, key) == expected_env


@pytest.mark.parametrize("key", sorted(CASES))
def test_each_setting_from_config_and_from_kwargs(key: str) -> None:
    _, value, expected = CASES[key]
    expected = {
        "log_level": "INFO",
        "telemetry_sources": ("process", "nvml"),
        "traces_exporter": ("console",),
    }.get(key, expected)
    partner = PARTNERS.get(key, {})
    from_config = resolve_settings(env=ENABLED_ENV, config={**partner, key: value})
    from_kwargs = resolve_settings(env=ENABLED_ENV, overrides={**partner, key: value})
    assert getattr(from_config, key) == expected
    assert getattr(from_kwargs, key) == expected


def test_precedence_each_level_beats_the_one_below() -> None:
    env = {"OTEL_TRAIN_SOURCE": "env", "OTEL_TRAIN_SAVE_PATH": "/env"}
    assert resolve_settings(env=env).source == "env"
    assert resolve_settings(env=env, config={"source": "cfg"}).source == "cfg"
    assert resolve_settings(env=env, config={"source": "cfg"}, overrides={"source": "kw"}).source == "kw"
    chain = resolve_settings(
        save_path="/arg", env=env, config={"save_path": "/cfg"}, overrides={"save_path": "/kw"}
    )
    assert chain.save_path == "/arg"
    assert resolve_settings(env=env, config={"save_path": "/cfg"}, overrides={"save_path": "/kw"}).save_path == "/kw"
    assert resolve_settings(env=env, config={"save_path": "/cfg"}).save_path == "/cfg"
    # A lower level's value survives where a higher level does not set the key.
    mixed = resolve_settings(env={**env, "OTEL_TRAIN_BACKUP_COUNT": "9"}, config={"source": "cfg"})
    assert (mixed.backup_count, mixed.source) == (9, "cfg")


def test_save_path_argument_accepts_pathlike() -> None:
    settings = resolve_settings(save_path=pathlib.Path("/tmp/p"), env={}, overrides={"enabled": True})
    assert settings.save_path == "/tmp/p" and settings.enabled


@pytest.mark.parametrize("raw", ["1", "true", "True", "YES", "on", " On "])
def test_env_bool_true_spellings(raw: str) -> None:
    assert resolve_settings(env={"OTEL_TRAIN_FSYNC": raw}).fsync is True


@pytest.mark.parametrize("raw", ["0", "false", "FALSE", "no", "off"])
def test_env_bool_false_spellings(raw: str) -> None:
    assert resolve_settings(env={"OTEL_TRAIN_TRACE_PER_STEP": raw}).trace_per_step is False


def test_empty_env_var_counts_as_unset() -> None:
    assert resolve_settings(env={"OTEL_TRAIN_BACKUP_COUNT": "", "OTEL_TRACES_EXPORTER": " "}) == Settings()


def test_max_file_size_accepts_int_and_float() -> None:
    assert resolve_settings(env={}, config={"max_file_size_mb": 2}).max_file_size_mb == 2.0
    assert resolve_settings(env={"OTEL_TRAIN_MAX_FILE_SIZE_MB": "64"}).max_file_size_mb == 64.0


def test_exporter_none_alone_means_no_exporter_and_duplicates_collapse() -> None:
    assert resolve_settings(env={"OTEL_TRACES_EXPORTER": "none"}).traces_exporter == ()
    assert resolve_settings(env={}, config={"traces_exporter": ["otlp", "OTLP", "jsonl"]}).traces_exporter == (
        "otlp",
        "jsonl",
    )


def test_handlers_accept_callables_and_a_comma_string_in_config() -> None:
    settings = resolve_settings(env={}, config={"handlers": [factory, "a.b:c"]})
    assert settings.handlers == (factory, "a.b:c")
    assert resolve_settings(env={}, overrides={"handlers": "x.y, z:w"}).handlers == ("x.y", "z:w")


def test_optional_keys_accept_none_in_config() -> None:
    assert resolve_settings(env={"OTEL_TRAIN_RANK": "2"}, config={"rank": None}).rank is None


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"env": {"OTEL_TRAIN_ENABLD": "1"}}, ["OTEL_TRAIN_ENABLD", "OTEL_TRAIN_ENABLED"]),
        ({"env": {"OTEL_TRAIN_TRACES_EXPORTER": "otlp"}}, ["OTEL_TRAIN_TRACES_EXPORTER", "OTEL_TRACES_EXPORTER"]),
        ({"env": {}, "config": {"batch_stats_evry": 2}}, ["config key 'batch_stats_evry'", "'batch_stats_every'"]),
        ({"env": {}, "overrides": {"fsynk": True}}, ["keyword argument 'fsynk'", "'fsync'"]),
        ({"env": {}, "overrides": {"zzz": 1}}, ["keyword argument 'zzz'", "docs/settings.md"]),
        ({"env": {"OTEL_TRAIN_ENABLED": "maybe"}}, ["OTEL_TRAIN_ENABLED", "'maybe'", "true or false"]),
        ({"env": {"OTEL_TRAIN_BACKUP_COUNT": "three"}}, ["OTEL_TRAIN_BACKUP_COUNT", "from 0 to 10000"]),
        ({"env": {"OTEL_TRAIN_BACKUP_COUNT": "-1"}}, ["OTEL_TRAIN_BACKUP_COUNT", "from 0 to 10000"]),
        ({"env": {}, "overrides": {"backup_count": 10**9}}, ["keyword argument 'backup_count'", "10000"]),
        # Red-team finds (issue 11): each used to escape as a raw OverflowError / ValueError / UnicodeError.
        ({"env": {}, "overrides": {"max_file_size_mb": 1e308}}, ["keyword argument 'max_file_size_mb'", "at most"]),
        ({"env": {}, "overrides": {"max_file_size_mb": 10**400}}, ["keyword argument 'max_file_size_mb'", "..."]),
        ({"env": {"OTEL_TRAIN_MAX_FILE_SIZE_MB": "1e308"}}, ["OTEL_TRAIN_MAX_FILE_SIZE_MB", "1e308"]),
        ({"env": {}, "save_path": "/tmp/a\0b"}, ["save_path argument", "'/tmp/a\\x00b'", "NUL"]),
        ({"env": {}, "overrides": {"run_id": "run-\udcff"}}, ["keyword argument 'run_id'", "'run-\\udcff'", "UTF-8"]),
        ({"env": {"OTEL_TRAIN_RUN_ID": "run-\udcff"}}, ["OTEL_TRAIN_RUN_ID", "UTF-8"]),
        ({"env": {}, "overrides": {"rank": 2**60}}, ["keyword argument 'rank'", "2**53"]),
        ({"env": {}, "config": ["enabled", True]}, ["invalid config keys", "a mapping"]),
        ({"env": {}, "config": {3: True}}, ["unknown config key 3", "strings"]),
        ({"env": {"OTEL_TRAIN_REDACT": "re:(unclosed"}}, ["OTEL_TRAIN_REDACT", "re:<regex>"]),
        ({"env": {}, "overrides": {"redact": ["WANDB", ""]}}, ["keyword argument 'redact'"]),
        ({"env": {"OTEL_TRAIN_BATCH_STATS_EVERY": "1.5"}}, ["OTEL_TRAIN_BATCH_STATS_EVERY"]),
        ({"env": {"OTEL_TRAIN_MAX_FILE_SIZE_MB": "0"}}, ["OTEL_TRAIN_MAX_FILE_SIZE_MB", "> 0"]),
        ({"env": {"OTEL_TRAIN_MAX_FILE_SIZE_MB": "nan"}}, ["OTEL_TRAIN_MAX_FILE_SIZE_MB"]),
        ({"env": {"OTEL_TRAIN_WORLD_SIZE": "0"}}, ["OTEL_TRAIN_WORLD_SIZE", "from 1 to"]),
        ({"env": {"OTEL_TRAIN_SOURCE": "my/run"}}, ["OTEL_TRAIN_SOURCE", "file name"]),
        ({"env": {}, "config": {"source": ""}}, ["config key 'source'"]),
        ({"env": {}, "config": {"backup_count": True}}, ["config key 'backup_count'", "True"]),
        ({"env": {}, "config": {"backup_count": "3"}}, ["config key 'backup_count'", "'3'"]),
        ({"env": {}, "config": {"enabled": "true"}}, ["config key 'enabled'"]),
        ({"env": {}, "overrides": {"max_file_size_mb": False}}, ["keyword argument 'max_file_size_mb'"]),
        ({"env": {}, "overrides": {"rank": -1}}, ["keyword argument 'rank'"]),
        ({"env": {}, "overrides": {"run_id": 5}}, ["keyword argument 'run_id'"]),
        ({"env": {"OTEL_TRACES_EXPORTER": "zipkin"}}, ["OTEL_TRACES_EXPORTER", "jsonl, otlp, console"]),
        ({"env": {"OTEL_TRACES_EXPORTER": "none,otlp"}}, ["OTEL_TRACES_EXPORTER", "'none' alone"]),
        ({"env": {"OTEL_TRAIN_TELEMETRY_SOURCES": "gpu"}}, ["OTEL_TRAIN_TELEMETRY_SOURCES", "nvml"]),
        ({"env": {"OTEL_TRAIN_LOG_LEVEL": "LOUD"}}, ["OTEL_TRAIN_LOG_LEVEL", "WARNING"]),
        ({"env": {"OTEL_TRAIN_HEARTBEAT_S": "-1"}}, ["OTEL_TRAIN_HEARTBEAT_S", ">= 0"]),
        ({"env": {"OTEL_TRAIN_STALL_MIN_S": "0"}}, ["OTEL_TRAIN_STALL_MIN_S", "> 0"]),
        ({"env": {"OTEL_TRAIN_STALL_FACTOR": "0.5"}}, ["OTEL_TRAIN_STALL_FACTOR", ">= 1"]),
        ({"env": {}, "config": {"stall_min_s": True}}, ["config key 'stall_min_s'"]),
        ({"env": {"OTEL_TRAIN_HANDLERS": "not a path"}}, ["OTEL_TRAIN_HANDLERS", "module:function"]),
        ({"env": {"OTEL_TRAIN_HANDLERS": "nodot"}}, ["OTEL_TRAIN_HANDLERS"]),
        ({"env": {}, "config": {"handlers": [42]}}, ["config key 'handlers'", "42"]),
        ({"env": {}, "save_path": ""}, ["save_path argument"]),
        ({"env": {"OTEL_TRAIN_ENABLED": "1"}}, ["save_path", "OTEL_TRAIN_SAVE_PATH", "OTEL_TRAIN_ENABLED=0"]),
        ({"env": {}, "overrides": {"enabled": True}}, ["save_path", "OTEL_TRAIN_SAVE_PATH"]),
    ],
)
def test_config_errors_are_one_line_and_name_the_culprit(kwargs: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_settings(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message
    assert isinstance(info.value, ValueError)
    # No chained traceback: the message alone explains the problem.
    assert info.value.__cause__ is None
    assert info.value.__context__ is None or info.value.__suppress_context__


def test_long_bad_values_are_shortened_in_the_message() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_settings(env={"OTEL_TRAIN_SOURCE": "x/" * 500})
    assert len(str(info.value)) < 300


@pytest.mark.parametrize("flag", ["true", "TRUE", " True "])
def test_sdk_disabled_forces_off_and_never_raises(flag: str) -> None:
    env = {"OTEL_SDK_DISABLED": flag, "OTEL_TRAIN_ENABLED": "1", "OTEL_TRAIN_BACKUP_COUNT": "bad", "OTEL_TRAIN_TYPO": "1"}
    settings = resolve_settings(env=env, config={"nonsense": 1}, overrides={"enabled": True})
    assert settings.enabled is False


def test_sdk_disabled_other_values_do_not_disable() -> None:
    settings = resolve_settings(env={"OTEL_SDK_DISABLED": "false", "OTEL_TRAIN_ENABLED": "1", **ENABLED_ENV})
    assert settings.enabled is True


def test_env_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRAIN_BACKUP_COUNT", "5")
    assert resolve_settings().backup_count == 5


def test_settings_summary_is_json_safe_and_names_callables() -> None:
    settings = resolve_settings(
        env={"OTEL_TRACES_EXPORTER": "jsonl,otlp"}, config={"handlers": [factory, "a.b:c"], "run_id": "r"}
    )
    summary = settings_summary(settings)
    assert json.loads(json.dumps(summary)) == summary
    assert set(summary) == {f.name for f in fields(Settings)}
    assert summary["handlers"] == [f"{__name__}.factory", "a.b:c"]
    assert summary["traces_exporter"] == ["jsonl", "otlp"]
    assert summary["run_id"] == "r"


class _Hostile:
    """A value that breaks every protocol it is asked for."""

    def __repr__(self) -> str:
        raise RuntimeError("repr")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("eq")

    __hash__ = object.__hash__

    def __index__(self) -> int:
        raise RuntimeError("index")

    def __float__(self) -> float:
        raise RuntimeError("float")


_NASTY = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.just(10**400),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["\0", "/tmp/x\0", "\udcff", "run-\ud800", " ", "re:(", "1e308", "inf", "-0", "0x10"]),
    st.lists(st.text(max_size=5), max_size=3), st.binary(max_size=5), st.builds(_Hostile),
)


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(sorted(CASES)), value=_NASTY, as_env=st.booleans())
def test_any_value_resolves_or_is_a_one_line_config_error(key: str, value: Any, as_env: bool) -> None:
    """Strict init never lets a raw exception through (issue 11: OverflowError, embedded NUL, surrogates)."""
    try:
        if as_env:
            if not isinstance(value, str) or "\0" in value:
                return  # environment values are NUL-free strings
            resolve_settings(env={**ENABLED_ENV, ENV_VARS[key]: value})
        else:
            resolve_settings(env=ENABLED_ENV, overrides={key: value})
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message and message.encode()  # one printable line
