"""``otel-train push --follow``: spans shipped as they end while a writer appends, rotates, leaves lines
half-written and new processes start; open spans sent as incomplete at --idle-exit and on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from otel_train import schema
from otel_train.analysis.otlp_send import open_destination
from otel_train.analysis.push import follow
from otel_train.phases import BACKWARD, FORWARD, STEP
from tests.analysis_fixtures import Proc, write_run
from tests.otlp_receivers import GrpcOtlpReceiver, HttpOtlpReceiver
from tests.test_push import INCOMPLETE, OTEL_TRAIN, SECRET, _cli, _expected


_WRITER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    logs = Path(sys.argv[1]); lines = json.loads(Path(sys.argv[2]).read_text()); gate = Path(sys.argv[3])
    name = sys.argv[4]; per_segment = 9
    active = logs / name
    written = 0
    def rotate():
        for i in (2, 1):
            src = logs / (name + ("" if i == 1 else f".{i-1}"))
            if src.exists():
                os.replace(src, logs / f"{name}.{i}")
    fd = os.open(active, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for i, line in enumerate(lines):
        if i == len(lines) // 2:
            while not gate.exists():   # wait until the tailer has shipped the first half
                time.sleep(0.05)
        if written == per_segment:
            os.close(fd); rotate(); fd = os.open(active, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644); written = 0
        data = (line + "\\n").encode()
        os.write(fd, data[:10]); time.sleep(0.01); os.write(fd, data[10:])   # a line caught half-written
        written += 1
        time.sleep(0.01)
    os.close(fd)
    """
)


def test_follow_ships_spans_while_a_writer_appends_and_rotates(tmp_path: Path) -> None:
    proc = Proc(rank=0)
    proc.steps(range(1, 7))
    proc.shutdown()
    logs = tmp_path / "structured_logs"
    logs.mkdir()
    lines_file = tmp_path / "lines.json"
    lines_file.write_text(json.dumps(proc.lines))
    gate = tmp_path / "gate"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(logs), str(lines_file), str(gate), proc.file_name])
    expected = _expected([proc])
    first_half = {json.loads(l)[schema.SPAN_ID] for l in proc.lines[: len(proc.lines) // 2]
                  if json.loads(l)[schema.KIND] == schema.SPAN_END}
    with GrpcOtlpReceiver() as rx:
        result = {}
        # Stopped once everything arrived, never by idle_exit_s: on a loaded machine the writer can sit
        # idle for seconds, and an idle exit ships the spans still open as incomplete (a test of its own).
        stop = threading.Event()
        tail = threading.Thread(target=lambda: result.update(stats=follow(
            tmp_path, open_destination(rx.endpoint, "grpc"), poll_s=0.05, stop=stop)))
        tail.start()
        # spans of the first half arrive while the writer still waits on the gate: shipped as they end
        rx.wait_for(len(first_half), timeout=20)
        assert writer.poll() is None
        gate.touch()
        assert writer.wait(timeout=30) == 0
        rx.wait_for(len(expected), timeout=30)
        stop.set()
        tail.join(timeout=30)
        assert not tail.is_alive()
        spans = rx.spans()
    assert (logs / (proc.file_name + ".1")).exists(), "the writer rotated"
    ids = [s["span_id"] for s in spans]
    twice = sorted({(expected.get(i, {}).get("name"), i) for i in ids if ids.count(i) > 1})
    assert sorted(ids) == sorted(expected), (twice, sorted(set(expected) - set(ids)), result.get("stats"))  # each exactly once, none lost
    for s in spans:
        exp = expected[s["span_id"]]
        assert s["parent_span_id"] == exp["parent"] and s["name"] == exp["name"]
        assert s["end_time_unix_nano"] == round(exp["end"] * 1e9)
        assert s["resource"][schema.RES_RANK] == 0
    stats = result["stats"]
    assert stats.malformed_lines == 0 and stats.incomplete_spans == 0 and stats.processes == 1


def test_push_cli_follow_idle_exit_and_open_spans(tmp_path: Path) -> None:
    proc = Proc(rank=3)
    proc.steps([1])
    proc.stop_inside(2, [BACKWARD])
    write_run(tmp_path, [proc])
    with HttpOtlpReceiver() as rx:
        env = {"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer {SECRET}"}
        result = _cli("push", str(tmp_path), "--endpoint", rx.endpoint, "--protocol", "http/protobuf",
                      "--follow", "--idle-exit", "0.5", "--poll", "0.1", env=env)
        spans = rx.spans()
        headers = rx.headers()
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert all(h.get("authorization") == f"Bearer {SECRET}" for h in headers)
    assert "pushed 7 spans (2 incomplete)" in result.stdout
    open_ones = [s for s in spans if s["attributes"].get(INCOMPLETE)]
    assert {s["name"] for s in open_ones} == {STEP, BACKWARD}


def test_push_cli_follow_sends_open_spans_on_sigterm_and_new_processes(tmp_path: Path) -> None:
    first = Proc(rank=0)
    first.steps([1])
    first.stop_inside(2, [FORWARD])
    write_run(tmp_path, [first])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    with GrpcOtlpReceiver() as rx:
        follower = subprocess.Popen([OTEL_TRAIN, "push", str(tmp_path), "--endpoint", rx.endpoint, "--follow",
                                     "--poll", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=clean)
        rx.wait_for(5, timeout=20)  # step 1 and its phases, sent as they ended
        late = Proc(rank=1)  # a process that starts after push --follow did
        late.steps([1])
        write_run(tmp_path, [late])
        rx.wait_for(10, timeout=20)
        follower.send_signal(signal.SIGTERM)
        out, err = follower.communicate(timeout=30)
        spans = rx.spans()
    assert follower.returncode == 0, err
    assert "pushed 12 spans (2 incomplete) from 2 processes" in out
    assert {(s["resource"][schema.RES_RANK], s["name"]) for s in spans if s["attributes"].get(INCOMPLETE)} == {
        (0, STEP), (0, FORWARD)}
    assert sorted(s["span_id"] for s in spans) == sorted(_expected([first, late]))
