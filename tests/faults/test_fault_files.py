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


def test_run_directory_recreated_just_before_shutdown(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    count = trials(3)
    holds = ("shutdown itself finds the deleted file: the deletion is reported on stderr, the new file holds "
             "an otel_train.write_errors notice counting the lost records, then process_end")
    # No periodic check fires during the test: only shutdown's own can find the deletion.
    monkeypatch.setattr(writer_module, "CHECK_INTERVAL_S", 3600.0)
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
