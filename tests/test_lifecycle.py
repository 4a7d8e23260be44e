"""Lifecycle records: process_start attributes (redacted env, versions, git) and exception hooks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from otel_train import lifecycle
from otel_train.config import Settings
from otel_train.redact import REDACTED, Redactor
from otel_train.resource import detect_run_context


def test_secret_names_and_url_credentials_are_redacted() -> None:
    env = {
        "MY_API_TOKEN": "tok-123",
        "aws_secret_access_key": "s3cr3t",
        "DB_PASSWORD": "pw",
        "GOOGLE_APPLICATION_CREDENTIALS": "/x.json",
        "HTTP_AUTHORIZATION": "Bearer x",
        "OTEL_EXPORTER_OTLP_HEADERS": "api-key=abc",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x=y",
        "PROXY_URL": "http://user:hunter2@proxy:3128/path",
        "PATH": "/usr/bin",
        "LONG": "x" * 5000,
    }
    snap = lifecycle.redacted_env(env)
    for name in ("MY_API_TOKEN", "aws_secret_access_key", "DB_PASSWORD", "GOOGLE_APPLICATION_CREDENTIALS",
                 "HTTP_AUTHORIZATION", "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"):
        assert snap[name] == lifecycle.REDACTED, name
    assert snap["PROXY_URL"] == "http://<redacted>@proxy:3128/path"
    assert snap["PATH"] == "/usr/bin"
    assert len(snap["LONG"]) < 1100
    assert "hunter2" not in json.dumps(snap) and "tok-123" not in json.dumps(snap)


def test_issue_11_secret_names_argv_flags_and_userinfo_anywhere() -> None:
    """Issue 11: DB_PASS slipped through; argv went verbatim into process_start (and the export)."""
    env = {"DB_PASS": "pw1", "MYSQL_PWD": "pw2", "SESSION_ID": "s3", "BROWSER_COOKIE": "c4", "GH_AUTH": "a5",
           "NOTE": "see https://bob:pw6@git.example/x and http://amy:pw7@h", "HOME": "/root"}
    snap = lifecycle.redacted_env(env)
    text = json.dumps(snap)
    assert not any(f"pw{i}" in text for i in (1, 2, 6, 7)) and "s3" not in text and "c4" not in text
    assert snap["NOTE"] == "see https://<redacted>@git.example/x and http://<redacted>@h" and snap["HOME"] == "/root"
    argv = ["train.py", "--api-key", "k1", "--password=k2", "--token", "k3", "--lr", "0.1",
            "db.password=k4", "--data", "s3://user:k5@bucket/x", "--secret-file", "--epochs", "3"]
    assert Redactor().argv(argv) == [
        "train.py", "--api-key", REDACTED, f"--password={REDACTED}", "--token", REDACTED, "--lr", "0.1",
        f"db.password={REDACTED}", "--data", f"s3://{REDACTED}@bucket/x", "--secret-file", "--epochs", "3"]


def test_redact_setting_adds_names_and_value_patterns(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WANDB_API", "w1")
    monkeypatch.setenv("COMET_X", "hf_0123456789abcdef0123")
    monkeypatch.setattr(sys, "argv", ["train.py", "--wandb-run", "w2", "--note", "tok hf_0123456789abcdef0123"])
    settings = Settings(enabled=True, save_path=str(tmp_path), redact=("wandb", "re:hf_[0-9a-f]{20,}"))
    attrs = lifecycle.process_start_attrs(settings, detect_run_context(settings, env={}))
    assert attrs["env"]["WANDB_API"] == REDACTED and attrs["env"]["COMET_X"] == REDACTED
    assert attrs["argv"] == ["train.py", "--wandb-run", REDACTED, "--note", f"tok {REDACTED}"]
    assert "hf_0123456789abcdef0123" not in json.dumps(attrs)


def test_git_state_of_a_repo_and_of_no_repo(tmp_path: Path) -> None:
    assert lifecycle.git_state(str(tmp_path)) is None
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f.txt").write_text("a")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    state = lifecycle.git_state(str(repo))
    assert state is not None and len(state["commit"]) == 40 and state["dirty"] is False
    (repo / "f.txt").write_text("b")
    assert lifecycle.git_state(str(repo))["dirty"] is True


def test_git_state_never_raises_without_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable at all
    assert lifecycle.git_state(str(tmp_path)) is None


def test_process_start_attrs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MY_API_TOKEN", "do-not-write-me")
    monkeypatch.chdir(tmp_path)
    settings = Settings(enabled=True, save_path=str(tmp_path), telemetry_sources=("process",))
    attrs = lifecycle.process_start_attrs(settings, detect_run_context(settings, env={}))
    assert attrs["settings"]["save_path"] == str(tmp_path)
    assert attrs["settings"]["telemetry_sources"] == ["process"]
    assert attrs["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert attrs["versions"]["torch"].startswith("2.") and attrs["versions"]["opentelemetry_sdk"]
    assert attrs["env"]["MY_API_TOKEN"] == lifecycle.REDACTED
    assert attrs["cwd"] == str(tmp_path) and attrs["git"] is None
    assert attrs["argv"] == Redactor().argv(sys.argv) and attrs["hostname"] and attrs["launcher"] == "default"
    assert "do-not-write-me" not in json.dumps(attrs)


def test_process_start_attrs_does_not_import_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        from otel_train import lifecycle
        from otel_train.config import Settings
        from otel_train.resource import detect_run_context
        s = Settings()
        lifecycle.process_start_attrs(s, detect_run_context(s, env={}))
        assert "torch" not in sys.modules, "torch was imported"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _raise(exc: BaseException) -> None:
    raise exc


def test_traceback_summary_is_innermost_frames() -> None:
    try:
        _raise(ValueError("x"))
    except ValueError as exc:
        frames = lifecycle.traceback_summary(exc.__traceback__, limit=1)
    assert len(frames) == 1 and frames[0].endswith(":_raise") and "test_lifecycle.py:" in frames[0]


def test_exception_hooks_chain_and_uninstall(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []
    recorded: list[tuple[object, str]] = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(("sys", a[0])))
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(("thread", args.exc_type)))
    monkeypatch.setattr(lifecycle, "record_exception",
                        lambda exc_type, exc, tb, thread: recorded.append((exc_type, thread)))
    uninstall = lifecycle.install_exception_hooks()
    sys.excepthook(KeyError, KeyError("k"), None)
    worker = threading.Thread(target=_raise, args=(OSError("disk"),), name="loader-thread")
    worker.start()
    worker.join()
    assert recorded == [(KeyError, "MainThread"), (OSError, "loader-thread")]
    assert seen == [("sys", KeyError), ("thread", OSError)]
    uninstall()
    sys.excepthook(KeyError, KeyError("k"), None)
    assert len(recorded) == 2 and len(seen) == 3
