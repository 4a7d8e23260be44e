"""``push --timeout`` against an endpoint that answers ``200 OK`` with a 100 MB ``Content-Length`` and then
one byte every 0.5 s (issue 19, item 7): the bound holds for the whole request, retries included, and
``push --follow`` reports it instead of stalling."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultlib import reported

import otel_train as ot


class TricklingEndpoint:
    """Accepts every connection, reads the request, answers 200 with a huge length, then trickles."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                self.requests += 1
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n"
                             b"Content-Length: 100000000\r\n\r\n")
                while not self._stop.wait(0.5):
                    conn.sendall(b"\0")
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


@pytest.fixture
def trickling() -> Iterator[TricklingEndpoint]:
    endpoint = TricklingEndpoint()
    try:
        yield endpoint
    finally:
        endpoint.close()


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    ot.init(save_path=run, enabled=True, watchdog=False)
    for step in range(5):
        with ot.training_step(step), ot.log_trace_span("forward"):
            pass
    ot.shutdown()
    return run


@pytest.mark.parametrize("follow", [False, True], ids=["push", "push --follow"])
def test_push_timeout_bounds_the_whole_request(tmp_path: Path, trickling: TricklingEndpoint, follow: bool) -> None:
    run = _run(tmp_path)
    holds = ("exit 1 in under 7 s (--timeout 2, 0.5 s grace, interpreter start and close) with one line "
             "naming the endpoint and the timeout, never 'pushed'; --follow reports it the same way")
    with reported(f"{'push --follow' if follow else 'push'} --timeout 2 against a trickling 200 OK", holds, 1):
        cmd = [sys.executable, "-m", "otel_train.cli", "push", str(run), "--endpoint",
               f"http://127.0.0.1:{trickling.port}", "--protocol", "http/protobuf", "--timeout", "2"]
        if follow:
            cmd += ["--follow", "--idle-exit", "0.5", "--poll", "0.1"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        assert trickling.requests >= 1
        assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
        assert len(lines) == 1 and "127.0.0.1" in lines[0] and "2 s" in lines[0], proc.stderr
        assert "pushed" not in proc.stdout
        assert took < 2 + 2 + 3, took  # the timeout, interpreter start and imports, closing
        print(f"took {took:.1f} s")
