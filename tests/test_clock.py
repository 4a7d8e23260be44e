"""One clock for many hosts (docs/clock.md): the estimate on a simulated 1,024-rank, 128-host job, the
readers that use it (summarize, findings, export, whatif, watch) and the single-host case."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from analysis_fixtures import Proc, write_run
from comm_sim import base, collective, declare, dp_steps, open_op
from test_watch_live import FakeHost
from typer.testing import CliRunner

from otel_train import schema
from otel_train.analysis.clock import Clock, HostClock, estimate
from otel_train.analysis.comm import CommGraph, CommOp, Group
from otel_train.analysis.export import export
from otel_train.analysis.live import UNNAMED_HOLD_S, LiveRun
from otel_train.analysis.spans import load_run
from otel_train.analysis.summary import summarize, summarize_run
from otel_train.analysis.clock import raw_clock
from otel_train.analysis.whatif import _clock as _whatif_clock
from otel_train.analysis.whatif import scenarios, sync_table, whatif
from otel_train.cli._app import app
from otel_train.phases import BACKWARD, DATA_FETCH, STEP

T0 = 1_700_000_000.0


# ---------------------------------------------------------------------------------------------
# The estimate on a simulated job


def simulated_graph(ranks: int = 1024, hosts: int = 128, collectives: int = 240, seed: int = 7,
                    span_s: float = 1200.0) -> tuple[CommGraph, np.ndarray, np.ndarray]:
    """A world all_reduce every ``span_s / collectives`` s: arrivals with scheduling noise (an
    exponential of 5 ms, a rank in 50 late by up to 200 ms), every member leaving within 20 us of
    the true end, one in 200 descheduled on its way out (up to 30 ms late); each host's clock
    ``offset + drift x elapsed`` (offsets up to +-2 s, drifts up to +-200 ppm; host 0 is the
    reference). Returns the graph and the true offsets (s) and drifts."""
    rng = np.random.default_rng(seed)
    per = ranks // hosts
    offsets = np.r_[0.0, rng.uniform(-2.0, 2.0, hosts - 1)]
    drifts = np.r_[0.0, rng.uniform(-200e-6, 200e-6, hosts - 1)]
    host_of = np.arange(ranks) // per
    graph = CommGraph(world=ranks)
    graph.hosts = {r: f"h{host_of[r]:03d}" for r in range(ranks)}
    graph.add_group(Group("0", "default_pg", tuple(range(ranks))))
    every = span_s / collectives
    for k in range(collectives):
        t = T0 + 1.0 + k * every  # true time the collective was due
        arrive = t + rng.exponential(0.005, ranks) + (rng.random(ranks) < 0.02) * rng.uniform(0, 0.2, ranks)
        end = arrive.max() + 0.002 + rng.uniform(0, 20e-6, ranks) + (rng.random(ranks) < 0.005) * rng.uniform(0, 0.03, ranks)

        def clock(ts: np.ndarray) -> np.ndarray:
            return ts + offsets[host_of] + drifts[host_of] * (ts - T0)

        starts, ends = clock(arrive), clock(end)
        for r in range(ranks):
            graph.add(CommOp(r, 0, "0", k, "all_reduce", float(starts[r]), float(ends[r]), step=k, nbytes=16,
                             dtype="float32"))
    return graph, offsets, drifts


@pytest.fixture(scope="module")
def simulated() -> tuple[CommGraph, np.ndarray, np.ndarray]:
    return simulated_graph()


def test_simulated_1024_ranks_on_128_hosts_offsets_within_a_tenth_of_a_ms(simulated) -> None:
    graph, offsets, drifts = simulated
    clock = estimate([graph], T0)
    assert clock.reference == "h000" and len(clock.hosts) == 128
    got = np.array([clock.hosts[f"h{i:03d}"].offset_s for i in range(128)])
    drift = np.array([clock.hosts[f"h{i:03d}"].drift for i in range(128)])
    assert np.abs(got - offsets).max() * 1e3 < 0.1
    assert np.abs(drift - drifts).max() * 1e6 < 1.0  # ppm
    rows = clock.rows()
    assert {k: v for k, v in rows[0].items() if k != "samples"} == {
        "host": "h000", "offset_ms": 0.0, "drift_ppm": 0.0, "residual_ms": 0.0}
    assert all(r["samples"] >= 200 and r["residual_ms"] < 0.1 for r in rows[1:])
    # Every host is off by more than 10 ms: one clock_skew each.
    assert len(clock.skewed()) == 127


def test_aligned_arrivals_name_the_true_last_rank(simulated) -> None:
    graph, offsets, drifts = simulated
    graph.clock = estimate([graph], T0)
    by_host_offsets = {f"h{i:03d}": (offsets[i], drifts[i]) for i in range(128)}
    checked = 0
    for a in list(graph.arrivals())[:20]:
        ops = graph.collectives[(a.group, a.seq)]
        # Undo each host's line exactly (the start is on its own clock): t = (s - off + drift t0) / (1 + drift)
        true = {r: (o.start - by_host_offsets[graph.hosts[r]][0] + by_host_offsets[graph.hosts[r]][1] * T0)
                / (1 + by_host_offsets[graph.hosts[r]][1]) for r, o in ops.items()}
        assert a.last == max(true, key=true.get) and len(a.members) == 1024
        checked += 1
    assert checked == 20


def test_ops_that_do_not_end_together_do_not_move_it() -> None:
    # Two hosts, 1 s apart. Add what is no sample: a broadcast whose root leaves 300 ms early, p2p
    # ops, failed and open ops, a dump's op without an end of its own; and 20 % of the collectives
    # where host b's ranks are all descheduled for 40 ms on the way out.
    rng = np.random.default_rng(3)
    graph = CommGraph(world=4)
    graph.hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    for k in range(200):
        t = T0 + k * 0.1
        late = 0.04 if rng.random() < 0.2 else 0.0
        for r in range(4):
            skew = 1.0 if r >= 2 else 0.0
            end = t + 0.001 + rng.uniform(0, 10e-6) + (late if r >= 2 else 0.0)
            graph.add(CommOp(r, 0, "0", 3 * k, "all_reduce", t + skew - 0.01 * rng.random(), end + skew))
            graph.add(CommOp(r, 0, "0", 3 * k + 1, "broadcast", t + skew, t + skew + (0.3 if r == 0 else 0.0) + 0.001))
            state = "error" if k % 50 == 0 else "ok"
            graph.add(CommOp(r, 0, "0", 3 * k + 2, "barrier", t + skew, t + skew + 5.0, state=state)
                      if state == "error" else CommOp(r, 0, "0", 3 * k + 2, "barrier", t + skew, None, state="open"))
        graph.add(CommOp(0, 0, "0", k + 1, "send", t, t + 0.2, peer=2))
        graph.add(CommOp(2, 0, "0", k + 1, "recv", t + 1.7, t + 1.9, peer=0))
        graph.add(CommOp(1, 0, "1", k, "all_reduce", t + 0.5, t + 0.5, source="flight_recorder", state="completed"))
        graph.add(CommOp(3, 0, "1", k, "all_reduce", t + 0.5, t + 0.5, source="flight_recorder", state="completed"))
    clock = estimate([graph], T0)
    b = clock.hosts["b"]
    assert abs(b.offset_s - 1.0) * 1e3 < 0.1 and b.drift == 0.0
    assert 150 <= b.samples <= 170  # the descheduled collectives (~20 %) are trimmed


def test_a_host_that_leaves_late_at_most_collectives_is_no_offset() -> None:
    # Two hosts, b's clock 1 s ahead. At 7 collectives in 10 host b's ranks are descheduled on their way
    # out and leave 2 ms after host a's; at the rest every member leaves within 20 us of the end, which
    # comes 50 us after the last arrival (a random member's). The ends alone read b as 1.002 s ahead (the
    # trimmed line keeps the late majority); causality cannot: where a rank of host a arrived last and b's
    # ranks left 50 us later, b's offset is at most 1.00005 s. The line is moved into that bound.
    rng = np.random.default_rng(11)
    graph = CommGraph(world=4)
    graph.hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    for k in range(200):
        t = T0 + k * 0.1
        arrive = t + rng.uniform(0.0, 0.005, 4)
        end = arrive.max() + 50e-6 + rng.uniform(0, 20e-6, 4)
        if k % 10 < 7:
            end[2:] += 0.002
        for r in range(4):
            skew = 1.0 if r >= 2 else 0.0
            graph.add(CommOp(r, 0, "0", k, "all_reduce", float(arrive[r] + skew), float(end[r] + skew)))
    b = estimate([graph], T0).hosts["b"]
    assert abs(b.offset_s - 1.0) * 1e3 < 0.1 and b.drift == 0.0, b


def test_one_host_or_no_collective_has_no_rows() -> None:
    one = CommGraph(world=2)
    one.hosts = {0: "a", 1: "a"}
    one.add(CommOp(0, 0, "0", 0, "all_reduce", T0, T0 + 1))
    one.add(CommOp(1, 0, "0", 0, "all_reduce", T0, T0 + 1))
    assert estimate([one]).rows() == [] and estimate([one]).skewed() == []
    two = CommGraph(world=2)
    two.hosts = {0: "a", 1: "b"}
    two.add(CommOp(0, 0, "0", 0, "send", T0, T0 + 1, peer=1))
    assert estimate([two]).rows() == []
    assert estimate([two]).domain("b") == "b"  # not estimated: compared with nobody
    assert estimate([]).rows() == []


def test_align_and_to_host_are_inverse() -> None:
    clock = Clock(t0=T0, reference="a", hosts={"a": HostClock("a", 0, 0, 0, 1),
                                               "b": HostClock("b", -2.5, 150e-6, 0, 1)})
    for t in (T0, T0 + 10.0, T0 + 3600.0):
        raw = t + (-2.5) + 150e-6 * (t - T0)  # b's clock at reference time t
        assert clock.align("b", raw) == pytest.approx(t, abs=1e-6)  # doubles of Unix time: ~0.2 us apart
        assert clock.to_host("b", t) == pytest.approx(raw, abs=1e-6)
    assert clock.align("a", T0 + 1) == T0 + 1 and clock.align("zzz", T0 + 1) == T0 + 1


# ---------------------------------------------------------------------------------------------
# Readers: summarize, findings, whatif, export


def _two_hosts(run_dir: Path, ahead_s: float = 3.0, steps: int = 40, slow: int | None = 3,
               hosts: dict[int, str] | None = None) -> list[Proc]:
    """Four ranks, two per host; host b's clock ``ahead_s`` ahead; rank ``slow`` 40 ms late to every
    all_reduce (its data_fetch)."""
    hosts = hosts or {0: "a", 1: "a", 2: "b", 3: "b"}
    procs = [Proc(rank=r, world_size=len(hosts), host=h, t0=T0 + (ahead_s if h == "b" else 0.0))
             for r, h in hosts.items()]
    declare(procs)

    def times(r: int, s: int) -> dict[str, float]:
        t = base(r, s)
        if r == slow:
            t[DATA_FETCH] += 40.0
        return t

    dp_steps(procs, range(steps), times)
    return procs


def test_summarize_two_hosts_reports_the_clock_and_a_skew(tmp_path: Path) -> None:
    procs = _two_hosts(tmp_path)
    for p in procs:
        p.shutdown()
    write_run(tmp_path, procs)
    s = summarize(tmp_path)
    assert [(r["host"], round(r["offset_ms"], 3), r["drift_ppm"], r["samples"]) for r in s["clock"]] == [
        ("a", 0.0, 0.0, 40), ("b", 3000.0, 0.0, 40)]
    assert all(r["residual_ms"] < 0.01 for r in s["clock"])
    kinds = [(f["kind"], f["rank"]) for f in s["findings"]]
    assert kinds == [("straggler", 3), ("clock_skew", 2)]
    skew = s["findings"][1]
    assert skew["host"] == "b" and round(skew["offset_ms"]) == 3000 and "aligned" in skew["message"]
    # The straggler is on host b, the waiters on both hosts: compared on one clock.
    assert "arrived last at 40/40" in s["findings"][0]["message"] and s["findings"][0]["comm"]["waiting"] == [0, 1, 2]
    raw = load_run(tmp_path)
    raw.align = False
    unaligned = summarize_run(raw)
    assert unaligned["clock"] == [] and "clock_skew" not in [f["kind"] for f in unaligned["findings"]]


def test_single_host_nothing_changes(tmp_path: Path) -> None:
    procs = _two_hosts(tmp_path, ahead_s=0.0, hosts={0: "a", 1: "a", 2: "a", 3: "a"})
    for p in procs:
        p.shutdown()
    write_run(tmp_path, procs)
    s = summarize(tmp_path)
    assert s["clock"] == [] and [f["kind"] for f in s["findings"]] == ["straggler"]
    graph = next(iter(load_run(tmp_path).comm.values()))
    assert graph.clock is not None and not graph.clock.applied and graph.clock.hosts == {}
    out = export(tmp_path, "chrome", tmp_path / "t.json")
    trace = json.loads(out.output.read_text())
    assert trace["otherData"]["clock"]["aligned"] is False
    assert not any("raw_ts" in (e.get("args") or {}) for e in trace["traceEvents"])
    text = CliRunner().invoke(app, ["summarize", str(tmp_path)])
    assert text.exit_code == 0 and "Clocks" not in text.output


def test_summarize_text_prints_the_clock_table_whenever_there_are_hosts(tmp_path: Path) -> None:
    procs = _two_hosts(tmp_path)
    for p in procs:
        p.shutdown()
    write_run(tmp_path, procs)
    runner = CliRunner()
    out = runner.invoke(app, ["summarize", str(tmp_path)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "Clocks: aligned to host a" in out.output and "+3000.000" in out.output
    raw = runner.invoke(app, ["summarize", str(tmp_path), "--no-align"], env={"COLUMNS": "200"})
    assert raw.exit_code == 0 and "not aligned (--no-align" in raw.output
    as_json = json.loads(runner.invoke(app, ["summarize", str(tmp_path), "--json", "--no-align"]).output)
    assert as_json["clock"] == []


def test_hang_waiting_since_is_on_the_reference_clock(tmp_path: Path) -> None:
    # Host b (ranks 2, 3) is 3 s ahead; ranks 0, 1, 3 wait in all_reduce #8 for rank 2. The first
    # waiter is rank 0 or 1 on the reference clock, never rank 3's raw time (3 s later).
    procs = _two_hosts(tmp_path, ahead_s=3.0, steps=8, slow=None)
    for p in procs:
        p.set_step(8)
        p.start(STEP)
        p.start(DATA_FETCH)
        if p.rank == 2:
            continue
        p.advance(5 if p.rank != 3 else 1)  # rank 3 arrives first in true time
        p.end()
        p.start(BACKWARD)
        open_op(p, "all_reduce", "0", 8)
    write_run(tmp_path, procs)
    found = summarize(tmp_path)["findings"]
    hang = next(f for f in found if f["kind"] == "hang")
    assert hang["rank"] == 2 and hang["comm"]["waiting"] == [0, 1, 3]
    first = procs[3].t0 - 3.0 + (procs[3].now_ms - 0) / 1000  # rank 3's arrival on the reference clock
    from datetime import datetime, timezone
    since = datetime.fromtimestamp(first, tz=timezone.utc).strftime("%H:%M:%S")
    assert f"since {since}" in hang["message"]


def test_whatif_uses_the_estimate(tmp_path: Path) -> None:
    # The slow rank (1) is on host a; host b's clock is 3 s ahead. Aligned, whatif answers as on honest
    # clocks; replayed on raw clocks, host b's ranks would look 3 s late to every collective and rank
    # 1's cost would vanish (so --no-align falls back to the per-host median shift).
    procs = _two_hosts(tmp_path, ahead_s=3.0, slow=1)
    honest = _two_hosts(tmp_path / "honest", ahead_s=0.0, slow=1)
    for p in procs + honest:
        p.shutdown()
    write_run(tmp_path, procs)
    write_run(tmp_path / "honest", honest)
    skewed, same = whatif(load_run(tmp_path)), whatif(load_run(tmp_path / "honest"))
    assert same["by_rank"][0]["rank"] == 1 and same["by_rank"][0]["cost_ms"] == pytest.approx(40.0, abs=0.5)
    assert [(r["rank"], round(r["cost_ms"], 2)) for r in skewed["by_rank"]] == [
        (r["rank"], round(r["cost_ms"], 2)) for r in same["by_rank"]]
    run = load_run(tmp_path)
    clock = next(iter(run.comm.values())).clock
    assert _whatif_clock(run) is clock and clock.applied
    group = run.groups()[0]
    on_raw = sync_table(group, clock=raw_clock())  # what replaying the raw clocks would give
    assert scenarios(on_raw).by_rank[1].mean() == pytest.approx(scenarios(on_raw).actual.mean())  # no cost
    raw = load_run(tmp_path)
    raw.align = False
    assert _whatif_clock(raw) is None
    assert [(r["rank"], round(r["cost_ms"], 2)) for r in whatif(raw)["by_rank"]][:1] == [(1, 40.0)]


def test_export_writes_aligned_times_and_keeps_raw_ts(tmp_path: Path) -> None:
    procs = _two_hosts(tmp_path, ahead_s=3.0, steps=10)
    for p in procs:
        p.shutdown()
    write_run(tmp_path, procs)
    for fmt in ("chrome", "perfetto"):
        export(tmp_path, fmt, tmp_path / f"t.{fmt}")
    trace = json.loads((tmp_path / "t.chrome").read_text())
    meta = trace["otherData"]["clock"]
    assert meta["aligned"] and meta["reference"] == "a"
    assert [(h["host"], round(h["offset_ms"])) for h in meta["hosts"]] == [("a", 0), ("b", 3000)]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    ends: dict[str, list[float]] = {}
    for e in trace["traceEvents"]:
        if e.get("name") == "comm.all_reduce" and e.get("ph") == "X":
            ends.setdefault(names[e["pid"]], []).append(e["ts"] + e["dur"])
            if names[e["pid"]] in ("rank 2", "rank 3"):
                raw = e["args"]["raw_ts"]
                assert raw == pytest.approx(trace["otherData"]["trace_start_unix_us"] / 1e6 + e["ts"] / 1e6 + 3.0,
                                            abs=2e-6)
            else:
                assert "raw_ts" not in e["args"]
    # Every member of a collective leaves at the same exported time (whole us).
    rows = np.array([ends[f"rank {r}"] for r in range(4)])
    assert np.abs(rows - rows[0]).max() <= 1
    labels = [e["args"]["labels"] for e in trace["traceEvents"] if e.get("name") == "process_labels"]
    assert sum("clock +3000.000 ms" in lab for lab in labels) == 2
    plain = export(tmp_path, "chrome", tmp_path / "raw.json", align=False)
    raw = json.loads(plain.output.read_text())
    assert raw["otherData"]["clock"]["aligned"] is False
    assert not any("raw_ts" in (e.get("args") or {}) for e in raw["traceEvents"])
    out = CliRunner().invoke(app, ["export", str(tmp_path), "-o", str(tmp_path / "c.json")])
    assert out.exit_code == 0 and "clocks aligned to host a: b +3000.000 ms" in out.output


# ---------------------------------------------------------------------------------------------
# Live: watch on hosts whose clocks are off by seconds


def _live_job(run_dir: Path, offsets: dict[str, float], seconds: float, stop: int | None = None,
              align: bool = True, until: str | None = None) -> list[dict]:
    """Four ranks on two hosts written as they run on the real clock (each host's ``ts`` its own
    clock: real time + offset), a step every 50 ms; rank ``stop`` stops inside data_fetch halfway.
    Returns the findings watch raised. ``until``: after ``seconds``, go on until watch raised a
    finding of that kind (at most 60 s more: a loaded machine polls late, it does not skip)."""
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    began = time.time()
    procs = [Proc(rank=r, world_size=4, host=h, t0=began + offsets[h]) for r, h in hosts.items()]
    for p in procs:
        p.lines.clear()
        p._seq = 0
        p.instant(schema.INSTANT_PROCESS_START, settings={"watchdog": False, "heartbeat_s": 0.0,
                                                          "stall_min_s": 1.0, "stall_factor": 5.0})
    declare(procs)
    for p in procs:
        p.start("train")  # the root span a training script keeps open, as the SDK's
    live = LiveRun(run_dir, probe=FakeHost("elsewhere"), background=False, align=align)
    logs = run_dir / schema.STRUCTURED_LOGS_DIR
    logs.mkdir(parents=True, exist_ok=True)
    written = {p.rank: 0 for p in procs}
    raised, step, seq = [], 0, 0

    def going() -> bool:
        elapsed = time.time() - began
        waiting = until is not None and until not in [f["kind"] for f in raised]
        return elapsed < seconds or (waiting and elapsed < seconds + 60)

    while going():
        now_ms = (time.time() - began) * 1000.0
        if stop is None or time.time() - began < seconds / 2:
            for p in procs:
                p.now_ms = now_ms
            seq = dp_steps(procs, range(step, step + 1), seq0=seq)
            step += 1
        elif step >= 0:
            for p in procs:
                p.now_ms = now_ms
                p.set_step(step)
                p.start(STEP)
                p.start(DATA_FETCH)
                if p.rank != stop:
                    p.advance(1)
                    p.end()
                    p.start(BACKWARD)
                    open_op(p, "all_reduce", "0", seq)
            step = -1
        for p in procs:
            with open(logs / p.file_name, "a") as f:
                f.write("".join(line + "\n" for line in p.lines[written[p.rank]:]))
            written[p.rank] = len(p.lines)
        raised += [e["finding"] for e in live.poll() if e["type"] == "finding"]
        time.sleep(0.05)
    live.close()
    return raised


def test_watch_makes_no_false_hang_from_clocks_seconds_behind(tmp_path: Path) -> None:
    offsets = {"a": -5.0, "b": -4.0}
    assert [f["kind"] for f in _live_job(tmp_path / "aligned", offsets, 3.0)] == ["clock_skew"]
    # The same job read on raw clocks: every span looks 4 s old, a stall that is none.
    # (It names no rank, so watch raises it once it has stood for UNNAMED_HOLD_S.)
    raw = _live_job(tmp_path / "raw", offsets, 4.0 + UNNAMED_HOLD_S, align=False, until="hang")
    assert "hang" in [f["kind"] for f in raw]


def test_watch_names_the_same_hang_culprit_with_clocks_off(tmp_path: Path) -> None:
    # Rank 1 (host a, 5 s behind) stops; its peers wait in the all_reduce. Host b (5 s ahead) must not
    # hide the hang (its progress in watch's future) nor shift the blame.
    found = _live_job(tmp_path / "aligned", {"a": -5.0, "b": 5.0}, 6.0, stop=1, until="hang")
    hangs = [f for f in found if f["kind"] == "hang"]
    assert [(f["rank"], f["comm"]["waiting"]) for f in hangs] == [(1, [0, 2, 3])]
    raw = _live_job(tmp_path / "raw", {"a": -5.0, "b": 5.0}, 6.0, stop=1, align=False)
    assert "hang" not in [f["kind"] for f in raw]  # raw clocks: host b's progress is 5 s ahead of watch


def test_host_setting_names_the_host_records_carry() -> None:
    import socket

    from otel_train.config import ConfigError, resolve_settings
    from otel_train.resource import detect_run_context

    settings = resolve_settings(save_path="/tmp/run", env={"OTEL_TRAIN_HOST": "host-b"})
    assert detect_run_context(settings, env={}).host == "host-b"
    assert detect_run_context(resolve_settings(save_path="/tmp/run", env={}), env={}).host == socket.gethostname()
    with pytest.raises(ConfigError, match="host"):
        resolve_settings(save_path="/tmp/run", overrides={"host": " "}, env={})


def test_fast_and_every_command_take_no_align(tmp_path: Path) -> None:
    from otel_train.analysis.fast import summarize_fast

    procs = _two_hosts(tmp_path, ahead_s=3.0, steps=12)
    for p in procs:
        p.shutdown()
    write_run(tmp_path, procs)
    fast = summarize_fast(tmp_path)
    assert [(r["host"], round(r["offset_ms"])) for r in fast["clock"]] == [("a", 0), ("b", 3000)]
    assert [f["kind"] for f in fast["findings"]] == ["clock_skew"]
    assert summarize_fast(tmp_path, align=False)["clock"] == []
    runner = CliRunner()
    text = runner.invoke(app, ["whatif", str(tmp_path)], env={"COLUMNS": "200"})
    assert text.exit_code == 0 and "clocks: hosts aligned to host a from the collectives (b +3000.000 ms" in text.output
    for args in (["whatif", str(tmp_path), "--no-align"], ["whatif", str(tmp_path), "--json"],
                 ["export", str(tmp_path), "--no-align", "-o", str(tmp_path / "raw.json")],
                 ["summarize", str(tmp_path), "--fast", "--no-align", "--json"]):
        out = runner.invoke(app, args)
        assert out.exit_code == 0, (args, out.output)
    assert "clocks aligned" not in runner.invoke(app, ["export", str(tmp_path), "--no-align", "-o",
                                                       str(tmp_path / "raw2.json")]).output
    watch = runner.invoke(app, ["watch", str(tmp_path), "--no-align", "--json", "--timeout", "1"])
    assert watch.exit_code == 0 and "clock_skew" not in watch.output
    aligned = runner.invoke(app, ["watch", str(tmp_path), "--json", "--timeout", "1"])
    assert aligned.exit_code == 0 and '"clock_skew"' in aligned.output


def test_watch_of_a_copied_dead_run_shifts_no_clock(tmp_path: Path) -> None:
    # Files copied (or left) long after their writers died: their modification times say nothing of
    # the writers' clocks (they never grow while watched), so the processes are dead, as before.
    procs = _two_hosts(tmp_path, ahead_s=3.0, steps=12, slow=None)
    for p in procs:
        p.stop_inside(12, [DATA_FETCH])  # died there: no process_end
    for p in procs:
        first = json.loads(p.lines[0])
        first["attrs"] = {"settings": {"watchdog": True, "heartbeat_s": 1.0, "stall_min_s": 1.0, "stall_factor": 5.0}}
        p.lines[0] = json.dumps(first)
    write_run(tmp_path, procs)
    live = LiveRun(tmp_path, probe=FakeHost("elsewhere"), background=False)
    found = [e["finding"]["kind"] for _ in range(2) for e in live.poll() if e["type"] == "finding"]
    live.close()
    assert all(lp.skew == 0.0 for lp in live.procs.values())
    assert {"crash", "hang"} & set(found), found


def test_device_clock_ops_are_samples_among_themselves() -> None:
    # NCCL with timing: the ops' times are the device's start and completion (comm.clock: device).
    graph = CommGraph(world=2)
    graph.hosts = {0: "a", 1: "b"}
    for k in range(30):
        t = T0 + k
        graph.add(CommOp(0, 0, "0", k, "all_reduce", t, t + 0.001, clock="device"))
        graph.add(CommOp(1, 0, "0", k, "all_reduce", t - 0.25, t + 0.001 - 0.25, clock="device"))
    b = estimate([graph], T0).hosts["b"]
    assert abs(b.offset_s + 0.25) < 1e-6 and b.samples == 30
