"""An Arize Phoenix server (a real OTLP trace backend) for integration tests, alone in a network namespace.

Phoenix's gRPC receiver binds every interface, so the server runs in a fresh network namespace
(``unshare -n``, loopback only) and never shows a port to the machine. Clients reach it by entering
that namespace: ``server.run([...])`` runs a command there (``nsenter --net=/proc/<pid>/ns/net``).
OTLP/HTTP protobuf is at ``http://127.0.0.1:6006/v1/traces``, gRPC at ``127.0.0.1:4317``; spans are
read back through the REST API (``GET /v1/projects/{project}/spans``).

Phoenix lives in its own venv, ``.venv-phoenix`` (``bash .ci/phoenix-venv.sh``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PHOENIX = ROOT / ".venv-phoenix" / "bin" / "phoenix"
HTTP_ENDPOINT = "http://127.0.0.1:6006"
GRPC_ENDPOINT = "http://127.0.0.1:4317"
READY_TIMEOUT_S = 240.0  # cold start imports a lot and migrates sqlite; slow on a busy 2-core machine

_WAIT_READY = textwrap.dedent(
    """
    import sys, time, urllib.request
    deadline = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen("http://127.0.0.1:6006/healthz", timeout=2).read()
            sys.exit(0)
        except OSError:
            time.sleep(0.5)
    sys.exit(1)
    """
)

_FETCH_SPANS = textwrap.dedent(
    """
    import json, sys, urllib.parse, urllib.request
    project, spans, cursor = sys.argv[1], [], None
    while True:
        query = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
        url = f"http://127.0.0.1:6006/v1/projects/{urllib.parse.quote(project)}/spans?" + urllib.parse.urlencode(query)
        try:
            page = json.load(urllib.request.urlopen(url, timeout=30))
        except urllib.error.HTTPError as exc:
            if exc.code == 404:   # the project does not exist (yet): no spans
                break
            raise
        spans.extend(page["data"])
        cursor = page.get("next_cursor")
        if not cursor:
            break
    json.dump(spans, sys.stdout)
    """
)


def netns_unavailable() -> str | None:
    """Why a network namespace cannot be made here, or None."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None or shutil.which("ip") is None:
        return "unshare/nsenter/ip (util-linux, iproute2) not installed"
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace ({probe.stderr.strip() or 'unshare -n failed'}); needs root"
    return None


class PhoenixServer:
    """``phoenix serve`` in its own network namespace with a temporary working dir (sqlite)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log_path = workdir / "phoenix.log"
        self._proc: subprocess.Popen | None = None

    def start(self) -> PhoenixServer:
        """Start and wait until ``/healthz`` answers; raises RuntimeError with the log tail if it never does."""
        env = {
            # Not the test session's HF_*/OTEL_* settings: Phoenix never becomes ready with HF_HUB_OFFLINE=1.
            **{k: v for k, v in os.environ.items() if not k.startswith(("HF_", "OTEL_", "PHOENIX_"))},
            "PHOENIX_WORKING_DIR": str(self.workdir / "phoenix"),
            "PHOENIX_HOST": "127.0.0.1",
            "PHOENIX_PORT": "6006",
            "PHOENIX_GRPC_PORT": "4317",
            "PHOENIX_TELEMETRY_ENABLED": "false",
            # At startup its agent assistant dials remote MCP servers and it fetches a WASM sandbox binary;
            # in a namespace without DNS either can hold /healthz back past any sane timeout (seen in
            # full-suite runs). Nothing here needs them.
            "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
            "PHOENIX_ALLOWED_SANDBOX_PROVIDERS": "NONE",
            "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",
            "PHOENIX_AGENTS_DISABLE_WEB_ACCESS": "true",
            "PHOENIX_AGENTS_DISABLE_GITHUB": "true",
        }
        log = self.log_path.open("wb")
        # exec keeps the pid: /proc/<pid>/ns/net is then Phoenix's namespace.
        self._proc = subprocess.Popen(
            ["unshare", "-n", "sh", "-c", f'ip link set lo up && exec "{PHOENIX}" serve'],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        log.close()
        self._await_own_namespace()
        ready = self.run([sys.executable, "-c", _WAIT_READY, str(READY_TIMEOUT_S)], timeout=READY_TIMEOUT_S + 30)
        if ready.returncode != 0 or self._proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            self.stop()
            raise RuntimeError(f"Phoenix did not become ready within {READY_TIMEOUT_S}s; log tail:\n{tail}")
        return self

    def _await_own_namespace(self, timeout_s: float = 30.0) -> None:
        # Right after Popen, `unshare` may not have made its namespace yet: entering /proc/<pid>/ns/net
        # then would enter *ours*, and every later call would talk to the wrong loopback.
        assert self._proc is not None
        ours = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._proc.poll() is None:
            try:
                if os.readlink(f"/proc/{self._proc.pid}/ns/net") != ours:
                    return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"phoenix's network namespace did not appear within {timeout_s}s "
                           f"(exit status {self._proc.poll()}); log: {self.log_path}")

    def run(self, cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 120.0,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside Phoenix's network namespace (so 127.0.0.1 is Phoenix's loopback)."""
        assert self._proc is not None
        return subprocess.run(
            ["nsenter", f"--net=/proc/{self._proc.pid}/ns/net", *cmd],
            env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd,
        )

    def popen(self, cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen:
        """Start ``cmd`` inside Phoenix's network namespace without waiting."""
        assert self._proc is not None
        return subprocess.Popen(
            ["nsenter", f"--net=/proc/{self._proc.pid}/ns/net", *cmd],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
        )

    def spans(self, project: str) -> list[dict]:
        """Every span Phoenix stored for ``project`` (REST API, all pages)."""
        result = self.run([sys.executable, "-c", _FETCH_SPANS, project], timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"reading spans of {project!r} failed: {result.stderr.strip()[-500:]}")
        return json.loads(result.stdout)

    def stop(self) -> None:
        """Terminate the server (and with it the namespace)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


@pytest.fixture(scope="session")
def phoenix(tmp_path_factory: pytest.TempPathFactory):
    """A running PhoenixServer; skips (with the reason) without .venv-phoenix or network namespaces."""
    if not PHOENIX.exists():
        pytest.skip(f"{PHOENIX.parent.parent.name} missing: create it with `bash .ci/phoenix-venv.sh`")
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    server = PhoenixServer(tmp_path_factory.mktemp("phoenix")).start()
    try:
        yield server
    finally:
        server.stop()
