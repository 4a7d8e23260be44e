"""The run directory under a hostile or careless neighbour: deleted just before shutdown, links planted
where the runtime writes, a directory owned by someone else (issue 19, items 6 and 8)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from faultlib import assert_gapless, reported, traces, trials

import otel_train as ot
from otel_train import runtime
from otel_train import schema as S
from otel_train.exporters.jsonl import writer as writer_module


def train(steps: range) -> None:
    for i in steps:
        with ot.training_step(i):
            with ot.log_trace_span("forward"):
                pass


class _NoTicks:
    """A file-check ticker that never ticks."""

    def add(self, writer: object) -> None:
        pass

    def remove(self, writer: object) -> None:
        pass


def test_run_directory_recreated_just_before_shutdown(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    count = trials(3)
    holds = ("shutdown itself finds the deleted file: the deletion is reported on stderr, the new file holds "
             "an otel_train.write_errors notice counting the lost records, then process_end")
    # No periodic check fires during the test: only shutdown's own can find the deletion. The writers
    # made here join a ticker that never ticks (patching the interval would leave the process's one
    # ticker thread asleep for an hour: every later test's periodic check with it).
    monkeypatch.setattr(writer_module, "_ticker", _NoTicks())
    with reported("run directory deleted and re-created < 1 s before shutdown", holds, count):
        for trial in range(count):
            run = tmp_path / f"run{trial}"
            ot.init(save_path=run, enabled=True, watchdog=False)
            train(range(3000))
            shutil.rmtree(run / S.STRUCTURED_LOGS_DIR)
            (run / S.STRUCTURED_LOGS_DIR).mkdir()
            ot.shutdown()
            err = capsys.readouterr().err
            assert "was deleted" in err, err
            (trace,) = traces(run)
            assert not trace.torn
            assert_gapless(trace, start=None)
            notice, end = trace.records[0], trace.records[-1]
            assert notice[S.NAME] == S.INSTANT_WRITE_ERRORS, [r[S.NAME] for r in trace.records]
            lost = trace.seqs[0] - 1
            assert lost >= 6000 and notice[S.ATTRS]["lost_records"] == lost
            assert end[S.NAME] == S.INSTANT_PROCESS_END
            assert end[S.ATTRS]["dropped_records"] == lost


def _planted(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return victim


def test_planted_links_are_never_followed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    holds = ("a link planted at the digest's old temporary name, at a trace file re-made after deletion, or at "
             "the digest itself leaves its target untouched; the runtime reports the refused file and goes on")
    with reported("symlinks planted in the run directory (digest temp, re-made trace file, digest)", holds, 3):
        victim = _planted(tmp_path)
        run = tmp_path / "run"
        ot.init(save_path=run, enabled=True, digest_s=0.05)
        rt = runtime._active
        train(range(20))
        digest = rt.watchdog.digest
        # 1. the digest's temporary: the name it had before (pid-based) and any name an attacker guesses
        os.makedirs(os.path.dirname(digest.path), exist_ok=True)
        old_tmp = os.path.join(os.path.dirname(digest.path), f".{os.path.basename(digest.path)}.{os.getpid()}.tmp")
        os.symlink(victim, old_tmp)
        rt.watchdog.final_digest()
        assert victim.read_text() == "precious\n"
        assert not os.path.islink(digest.path) and os.path.isfile(digest.path)
        # 2. the digest's own name: replaced by the rename, the link's target untouched
        os.unlink(digest.path)
        os.symlink(victim, digest.path)
        rt.watchdog.final_digest()
        assert victim.read_text() == "precious\n" and not os.path.islink(digest.path)
        # 3. the trace file deleted, a link planted at its path before the writer re-makes it
        trace_path = rt.writer.path
        os.unlink(trace_path)
        os.symlink(victim, trace_path)
        rt.writer._limit = -1  # the periodic check is due now
        train(range(20, 40))
        ot.shutdown()
        assert victim.read_text() == "precious\n"
        err = capsys.readouterr().err
        assert "was deleted" in err and "symbolic links" in err, err


def test_run_directory_writable_by_others_is_refused(tmp_path: Path) -> None:
    holds = ("init refuses (one-line ConfigError naming the directory and allow_shared_dir) a run directory or "
             "structured_logs/ writable by others or owned by another user; allow_shared_dir=true accepts it")
    cases = ["run world-writable", "structured_logs world-writable"]
    if os.geteuid() == 0:
        cases += ["run owned by nobody", "structured_logs owned by nobody"]
    with reported("run directory owned by someone else or writable by others", holds, len(cases)):
        for i, case in enumerate(cases):
            run = tmp_path / f"run{i}"
            target = run / S.STRUCTURED_LOGS_DIR if case.startswith("structured_logs") else run
            target.mkdir(parents=True)
            if "world-writable" in case:
                target.chmod(0o777)
            else:
                os.chown(target, 65534, 65534)
            with pytest.raises(ot.ConfigError) as info:
                ot.init(save_path=run, enabled=True)
            message = str(info.value)
            assert "\n" not in message and str(target) in message and "allow_shared_dir" in message, message
            assert runtime._active is None
            ot.init(save_path=run, enabled=True, allow_shared_dir=True)
            train(range(3))
            ot.shutdown()
            (trace,) = traces(run)
            assert trace.records[-1][S.NAME] == S.INSTANT_PROCESS_END


def test_a_link_at_the_export_temporary_is_not_written_through(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from otel_train.cli import app

    holds = "a link planted at export's temporary name leaves its target untouched (export fails with one line)"
    with reported("symlink planted at the export's temporary", holds, 1):
        victim = _planted(tmp_path)
        run = tmp_path / "run"
        ot.init(save_path=run, enabled=True)
        train(range(5))
        ot.shutdown()
        out = tmp_path / "out" / "trace.json"
        out.parent.mkdir()
        os.symlink(victim, out.parent / f".{out.name}.{os.getpid()}.tmp")  # CliRunner: this process's pid
        result = CliRunner().invoke(app, ["export", str(run), "--output", str(out)])
        assert victim.read_text() == "precious\n"
        assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
