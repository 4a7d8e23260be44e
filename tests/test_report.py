"""otel_train._report: the one place internal faults go: one stderr line per key, every occurrence counted."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from otel_train import _report


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


def test_first_occurrence_prints_one_line_and_every_one_counts(capsys: pytest.CaptureFixture[str]) -> None:
    _report.reset()
    for _ in range(5):
        _report.report_exception("writing a span start record", UnicodeEncodeError("utf-8", "x", 0, 1, "bad"))
    _report.report_exception("writing a span start record", KeyError("k"))  # another type: another key
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith("otel-train: writing a span start record failed: ") for line in lines)
    assert _report.counts() == {"writing a span start record:UnicodeEncodeError": 5,
                                "writing a span start record:KeyError": 1}
    assert _report.total("writing a span") == 6 and _report.total("nothing") == 0


def test_never_raises_on_broken_exceptions_or_logging(capsys: pytest.CaptureFixture[str]) -> None:
    _report.reset()
    assert _report.safe_str(Unprintable()) == "<unprintable Unprintable>"
    assert _report.report_exception("hook", Unprintable())
    assert "hook failed: Unprintable: <unprintable Unprintable>" in capsys.readouterr().err
    assert len(_report.safe_str("x" * 10_000)) == 300


def test_visible_on_stderr_even_when_the_root_logger_is_silenced() -> None:
    # A training script that silences logging (root at ERROR, its own handler) still sees our one line.
    code = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.ERROR, stream=sys.stdout)
        from otel_train import _report
        _report.report("k", "disk full")
        _report.report("k", "disk full")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stderr.splitlines() == ["otel-train: disk full (reported once; later occurrences are counted)"]
    assert done.stdout == ""


def test_routable_through_the_otel_train_logger(capsys: pytest.CaptureFixture[str]) -> None:
    _report.reset()
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Collect()
    _report.logger.addHandler(handler)
    try:
        _report.report("exporter", "collector refused")
    finally:
        _report.logger.removeHandler(handler)
    assert seen == ["otel-train: collector refused (reported once; later occurrences are counted)"]
