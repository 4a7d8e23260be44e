"""torchtitan's (and pimm's) structured-logger files, read as they are by every command (CONTRACT.md,
"Other structured loggers' files"; docs/integrations-frameworks.md).

The files are written by :class:`TitanWriter`, which lays each record out as torchtitan 0.3.0's
``TraceJsonlFormatter`` does (the same keys in the same order, ``seq_id`` counting from 0, the
``_error`` record before its ``_end``); when torchtitan is installed, its own logger writes one too.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_train.analysis.reading.discovery import find_process_files
from otel_train.analysis.reading.whole import Reader
from otel_train.analysis.spans import read_process
from otel_train.analysis.summary import summarize
from tests import titan_env

T0 = 1_767_268_800_000_000  # 2026-01-01T12:00:00Z in µs


class TitanWriter:
    """One rank's file, record for record as torchtitan's JSONL handler writes it."""

    def __init__(self, run: Path, rank: int, *, source: str = "training", rand: str = "ABC12",
                 logger: str = "torchtitan.structured_logger") -> None:
        (run / "structured_logs").mkdir(parents=True, exist_ok=True)
        self.path = run / "structured_logs" / f"{source}.global_rank_{rank}.20260101-120000-{rand}{rank}.jsonl"
        self.f = self.path.open("w")
        self.rank, self.source, self.logger = rank, source, logger
        self.seq = itertools.count()

    def rec(self, log_type: str, name: str, t_us: int, step: int | None = None, *, value: float | None = None,
            event_name: str | None = None, task: str | None = None, message: str = "", tags: list[str] | None = None,
            ) -> None:
        d: dict = {"delta_ms": 0.25, "tid": 4242, "rank": self.rank, "global_rank": self.rank,
                   "local_rank": self.rank, "source": self.source, "host_name": "node7", "pid": 9000 + self.rank}
        if step is not None:
            d["step"] = step
            d["relative_step"] = step
        if tags:
            d["step_tags"] = tags
        d.update({"time": t_us // 1_000_000, "time_ms": t_us // 1000, "time_us": t_us, "log_type": log_type,
                  "log_type_name": name, "event_name": event_name})
        if value is not None:
            d["value"] = float(value)
        if task is not None:
            d["task_name"] = task
        d.update({"caller": "torchtitan/trainer.py:612:train_step", "log_file": "trainer.py",
                  "log_function": "train_step", "log_level": "INFO", "logger_name": self.logger,
                  "seq_id": next(self.seq), "message": message})
        self.f.write(json.dumps(d) + "\n")
        self.f.flush()

    def span(self, name: str, t_us: int, dur_us: int, step: int | None, **kw: object) -> None:
        self.rec("event", f"{name}_start", t_us, step, **kw)  # type: ignore[arg-type]
        self.rec("event", f"{name}_end", t_us + dur_us, step, value=dur_us / 1000, **kw)  # type: ignore[arg-type]


def _titan_run(run: Path, *, world: int = 2, steps: int = 6, hang: tuple[int, str] | None = None,
               slow: tuple[int, int] | None = None) -> list[TitanWriter]:
    """A torchtitan trainer's phases: step > (fetching_batch, fwd_bwd, optim), a loss metric a step.
    ``hang``: (rank, phase) where that rank stops in the last step; ``slow``: (rank, step) whose
    fetching_batch takes 40 ms instead of 1."""
    writers = [TitanWriter(run, r) for r in range(world)]
    for w in writers:
        t = T0
        w.rec("instant", "structured_logger_started", t)
        for step in range(1, steps + 1):
            last = step == steps
            fetch = 40_000 if slow == (w.rank, step) else 1_000
            w.rec("event", "step_start", t, step)
            if last and hang is not None and hang[0] == w.rank and hang[1] == "fetching_batch":
                w.rec("event", "fetching_batch_start", t + 10, step)
                break
            w.span("fetching_batch", t + 10, fetch, step)
            c = t + 20 + fetch
            if last and hang is not None:
                w.rec("event", "fwd_bwd_start", c, step)  # the culprit stops inside; the others wait in it
                break
            w.span("fwd_bwd", c, 10_000, step)
            w.span("optim", c + 10_100, 2_000, step)
            w.rec("instant", "metric_value", c + 12_200, step, value=3.0 - step / 10, event_name="loss_metrics/global_avg_loss")
            w.rec("event", "step_end", c + 12_300, step, value=(c + 12_300 - t) / 1000)
            t += 100_000
    return writers


def _summary(run: Path) -> dict:
    return summarize(run, cache=False, warn=lambda _: None)


def _spans(path: Path) -> list:
    (pf,) = [p for p in find_process_files(path, warn=lambda _: None) if p.rank == 0]
    return read_process(pf, 0, Reader(warn=lambda _: None), keep=True).spans


def test_summarize_reads_their_phases_and_says_the_format(tmp_path: Path) -> None:
    _titan_run(tmp_path)
    s = _summary(tmp_path)
    assert s["malformed_lines"] == 0
    assert [(p["rank"], p["format"], p["host"], p["pid"], p["final_step"], p["ended_cleanly"]) for p in s["processes"]] \
        == [(0, "torchtitan", "node7", 9000, 6, True), (1, "torchtitan", "node7", 9001, 6, True)]
    phases = {p["name"]: p for p in s["phases"]}
    assert {n: phases[n]["count"] for n in ("step", "fetching_batch", "fwd_bwd", "optim")} == \
        {"step": 12, "fetching_batch": 12, "fwd_bwd": 12, "optim": 12}
    assert phases["fwd_bwd"]["p50_ms"] == pytest.approx(10.0)
    assert s["findings"] == []  # a finished run: no span open at the end is how their files end


def test_nesting_pairs_lifo_per_task_and_errors_carry_the_message(tmp_path: Path) -> None:
    w = TitanWriter(tmp_path, 0)
    w.rec("event", "step_start", T0, 1)
    # two asyncio tasks interleave spans of the same name: each pairs with its own task's start
    w.rec("event", "rollout_start", T0 + 10, 1, task="Task-1")
    w.rec("event", "rollout_start", T0 + 20, 1, task="Task-2")
    w.rec("event", "rollout_end", T0 + 5_020, 1, value=5.0, task="Task-2")
    w.rec("event", "rollout_end", T0 + 9_010, 1, value=9.0, task="Task-1")
    w.rec("event", "fwd_bwd_start", T0 + 10_000, 1)
    w.rec("event", "forward_start", T0 + 10_100, 1)
    w.rec("event", "forward_error", T0 + 12_000, 1, message="[step 1] forward_error: RuntimeError: CUDA error: boom")
    w.rec("event", "forward_end", T0 + 12_000, 1, value=1.9)
    w.rec("event", "fwd_bwd_error", T0 + 12_010, 1, message="[step 1] fwd_bwd_error: RuntimeError: CUDA error: boom")
    w.rec("event", "fwd_bwd_end", T0 + 12_010, 1, value=2.01)
    w.rec("event", "rollout_start", T0 + 12_100, 1, task="Task-1")
    w.rec("event", "generate_start", T0 + 12_200, 1, task="Task-1")
    w.rec("event", "generate_end", T0 + 12_300, 1, value=0.1, task="Task-1")
    every = _spans(tmp_path)
    spans = {(s.name, (s.attrs or {}).get("task_name")): s for s in every if s.status != "open" or s.name != "rollout"}
    by_id = {s.span_id: s for s in every}
    r1, r2 = spans[("rollout", "Task-1")], spans[("rollout", "Task-2")]
    assert (r1.dur_ms, r2.dur_ms) == (pytest.approx(9.0, abs=1e-3), pytest.approx(5.0, abs=1e-3))
    assert r1.parent_span_id is None and r2.parent_span_id is None  # their stacks are per task: no step there
    gen = spans[("generate", "Task-1")]
    assert by_id[gen.parent_span_id].name == "rollout" and by_id[gen.parent_span_id].status == "open"
    fwd = spans[("forward", None)]
    assert by_id[fwd.parent_span_id].name == "fwd_bwd"
    assert fwd.status == "error" and fwd.error == {"type": "RuntimeError", "message": "CUDA error: boom"}
    assert spans[("fwd_bwd", None)].status == "error"
    assert spans[("step", None)].status == "open"
    assert len(by_id) == len(every) == 7
    assert all(len(s.span_id) == 16 and len(s.trace_id) == 32 for s in every)  # as OTLP wants them
    assert fwd.attrs["code.caller"] == "torchtitan/trainer.py:612:train_step"


def test_a_rank_stopped_inside_forward_is_named_and_its_peers_are_not(tmp_path: Path) -> None:
    _titan_run(tmp_path, world=3, hang=(1, "fetching_batch"))
    s = _summary(tmp_path)
    assert [(f["kind"], f["rank"], f["phase"]) for f in s["findings"]][:1] == [("hang", 1, "fetching_batch")]
    assert [p["open_spans"] for p in s["processes"]] == [["step", "fwd_bwd"], ["step", "fetching_batch"],
                                                         ["step", "fwd_bwd"]]


def test_a_slow_data_load_is_a_straggler_of_that_rank(tmp_path: Path) -> None:
    _titan_run(tmp_path, world=4, steps=12, slow=(2, 8))
    s = _summary(tmp_path)
    fetch = next(p for p in s["phases"] if p["name"] == "fetching_batch")
    assert (fetch["slowest"]["rank"], fetch["slowest"]["step"], fetch["max_ms"]) == (2, 8, pytest.approx(40.0))


def test_metrics_are_scalars_tags_are_tags_and_a_bad_line_is_counted(tmp_path: Path) -> None:
    (w,) = _titan_run(tmp_path, world=1, steps=2)
    w.f.write('{"log_type": "event", "log_type_name": "step_start", "time_us": "soon"}\n')  # a wrong type
    w.rec("event", "step_start", T0 + 900_000, 3, tags=["gc"])
    w.rec("event", "step_end", T0 + 901_000, 3, value=1.0, tags=["gc"])
    (pf,) = find_process_files(tmp_path, warn=lambda _: None)
    warned: list[str] = []
    reader = Reader(warn=warned.append)
    state = read_process(pf, 0, reader, keep=True)
    assert reader.malformed_lines == 1 and ":" in warned[0] and "skipped malformed line" in warned[0]
    assert [(s.step, s.values) for s in state.scalars] == [(1, {"loss_metrics/global_avg_loss": 2.9}),
                                                           (2, {"loss_metrics/global_avg_loss": 2.8})]
    assert [i.name for i in state.instants] == ["structured_logger_started"]
    assert [s.context.tags for s in state.spans if s.step == 3] == [["gc"]]


def test_both_kinds_of_files_in_one_directory(tmp_path: Path) -> None:
    """Theirs carry no run id: they are the run named ``torchtitan`` beside ours (as two runs are)."""
    from analysis_fixtures import Proc, write_run

    from otel_train.analysis.spans import use_run

    ours = Proc(rank=0, world_size=1, t0=T0 / 1e6 + 3600)  # started later: the default run
    ours.steps(range(1, 4))
    write_run(tmp_path, [ours])
    TitanWriter(tmp_path, 0).span("step", T0, 5_000, 1)
    s = _summary(tmp_path)
    assert [(p["rank"], p["format"]) for p in s["processes"]] == [(0, "otel-train")]
    use_run("torchtitan")
    try:
        s = _summary(tmp_path)
    finally:
        use_run(None)
    assert [(p["rank"], p["format"]) for p in s["processes"]] == [(0, "torchtitan")]
    assert s["malformed_lines"] == 0


def test_a_metric_named_kind_does_not_make_their_file_ours(tmp_path: Path) -> None:
    w = TitanWriter(tmp_path, 0)
    w.rec("instant", "metric_value", T0, 1, value=1.0, event_name="kind")
    w.span("step", T0 + 10, 5_000, 1)
    s = _summary(tmp_path)
    assert (s["malformed_lines"], s["processes"][0]["format"]) == (0, "torchtitan")


def test_pimm_files_are_named_pimm(tmp_path: Path) -> None:
    TitanWriter(tmp_path, 0, source="trainer", logger="pimm.structured_logger").span("step", T0, 5_000, 1)
    assert _summary(tmp_path)["processes"][0]["format"] == "pimm"


def test_every_command_reads_them(tmp_path: Path) -> None:
    """One process per command would cost seconds; the CLI in one interpreter, each command once."""
    _titan_run(tmp_path, world=2, hang=(1, "fetching_batch"))
    script = f"""
import sys
from typer.testing import CliRunner
from otel_train.cli import app
run = {str(tmp_path)!r}
out = {str(tmp_path / 'out')!r}
r = CliRunner()
for args in (["summarize", run], ["summarize", "--fast", run], ["stats", run], ["diff", run, run],
             ["whatif", run], ["export", run, "--format", "otlp-json", "-o", out + ".json"],
             ["export", run, "--format", "chrome", "-o", out + ".chrome.json"],
             ["query", run, "select count(*) from spans where name = 'fwd_bwd'"],
             ["watch", run, "--timeout", "1", "--json"]):
    res = r.invoke(app, args)
    print("##", args[0], res.exit_code)
    print(res.output)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}).stdout
    parts = [p.split("\n", 1) for p in out.split("## ")[1:]]
    assert [name for name, _ in parts] == ["summarize 0", "summarize 0", "stats 0", "diff 0", "whatif 0",
                                           "export 0", "export 0", "query 0", "watch 0"], out
    text = dict(parts)
    assert "Files: torchtitan structured logger (ranks 0, 1)" in text["summarize 0"]
    assert '"kind":"hang","rank":1' in text["watch 0"]
    assert json.loads((tmp_path / "out.json").read_text())["resourceSpans"]


_THEIR_LOGGER = """
import logging, os, sys
import torchtitan.observability.structured_logger as sl
sl.init_structured_logger(source="training", output_dir=os.environ["DUMP"], rank=0)
sl.set_step(1)
with sl.log_trace_span("step"):
    with sl.log_trace_span("fwd_bwd"):
        pass
    sl.log_trace_scalar({"loss": 1.5})
    try:
        with sl.log_trace_span("optim"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    else:
        sys.exit("log_trace_span swallowed the error")
logging.shutdown()
"""


def test_their_own_logger_writes_files_we_read(tmp_path: Path) -> None:
    titan = titan_env.python()
    if titan is None:
        pytest.skip(titan_env.MISSING)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_TRAIN_", "TITAN_"))}
    subprocess.run([str(titan), "-c", _THEIR_LOGGER], env=env | {"DUMP": str(tmp_path)}, check=True, timeout=120)
    s = _summary(tmp_path)
    assert s["processes"][0]["format"] == "torchtitan"
    assert {p["name"]: p["count"] for p in s["phases"]} == {"step": 1, "fwd_bwd": 1, "optim": 1}
    optim = next(x for x in _spans(tmp_path) if x.name == "optim")
    assert (optim.status, optim.error) == ("error", {"type": "RuntimeError", "message": "boom"})


def test_push_sends_their_spans_with_their_errors(tmp_path: Path) -> None:
    from otel_train.analysis.otlp_send import open_destination
    from otel_train.analysis.push import replay
    from tests.otlp_receivers import GrpcOtlpReceiver

    w = TitanWriter(tmp_path, 0)
    w.span("fetching_batch", T0, 1_000, 1)
    w.rec("event", "fwd_bwd_start", T0 + 2_000, 1)
    w.rec("event", "fwd_bwd_error", T0 + 5_000, 1, message="[step 1] fwd_bwd_error: ValueError: bad batch")
    w.rec("event", "fwd_bwd_end", T0 + 5_000, 1, value=3.0)
    w.rec("event", "step_start", T0 + 6_000, 2)  # open: sent as incomplete
    with GrpcOtlpReceiver() as rx:
        stats = replay(tmp_path, open_destination(rx.endpoint, "grpc"))
        received = rx.wait_for(stats.spans)
    assert sorted(s["name"] for s in received) == ["fetching_batch", "fwd_bwd", "step"]
    failed = next(s for s in received if s["name"] == "fwd_bwd")
    assert (failed["status_code"], failed["status_message"]) == (2, "ValueError: bad batch")
    assert stats.incomplete_spans == 1
