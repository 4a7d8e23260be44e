"""Logging bridge: records at the level and above become `log` instants; no recursion; stderr kept."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from typing import Any, Iterator

import pytest

from otel_train import logbridge
from otel_train.errors import ConfigError


@pytest.fixture
def instants(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def record(name: str, /, **attrs: Any) -> None:
        seen.append({"name": name, **attrs})
        logging.getLogger("user.inside").error("logged while recording")  # must not recurse

    monkeypatch.setattr(logbridge.api, "log_trace_instant", record)
    uninstall = logbridge.install("WARNING")
    yield seen
    uninstall()


def test_warning_and_above_become_instants(instants: list[dict[str, Any]]) -> None:
    log = logging.getLogger("user.train")
    log.info("too low")
    log.warning("loss spiked to %.1f", 9.5)
    try:
        raise ValueError("bad batch")
    except ValueError:
        log.exception("skipping")
    assert [(i["level"], i["message"]) for i in instants] == [
        ("WARNING", "loss spiked to 9.5"),
        ("ERROR", "skipping [ValueError: bad batch]"),
    ]
    assert instants[0]["name"] == "log" and instants[0]["logger"] == "user.train"
    path, line = instants[0]["location"].rsplit(":", 1)
    assert path == __file__ and line.isdigit()


def test_own_and_sdk_loggers_are_ignored(instants: list[dict[str, Any]]) -> None:
    logging.getLogger("otel_train.exporters.jsonl").error("write failed")
    logging.getLogger("opentelemetry.sdk.trace").error("exporter down")
    assert instants == []


def test_bad_format_args_never_raise(instants: list[dict[str, Any]]) -> None:
    # Called directly: pytest's own capture handler would raise on this record first.
    handler = logbridge.TraceLogHandler(logging.WARNING)
    handler.emit(logging.LogRecord("user", logging.WARNING, "f.py", 3, "%d items", ("not-a-number",), None))
    assert instants[0]["message"] == "%d items" and instants[0]["location"] == "f.py:3"


def test_uninstall_removes_the_handler() -> None:
    before = list(logging.getLogger().handlers)
    uninstall = logbridge.install("info")
    assert len(logging.getLogger().handlers) == len(before) + 1
    uninstall()
    assert logging.getLogger().handlers == before


def test_bad_level_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="LOUD"):
        logbridge.install("LOUD")


def test_python_still_prints_warnings_without_other_handlers() -> None:
    # With no handler configured Python prints WARNING+ to stderr (logging.lastResort); installing the
    # bridge must not silence that, even for records below the bridge's own level.
    code = textwrap.dedent(
        """
        import logging
        from otel_train import logbridge
        logbridge.install("ERROR")
        logging.getLogger("x").warning("still visible")
        logging.getLogger("x").info("never visible")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stderr.strip() == "still visible"
