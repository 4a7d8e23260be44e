"""Start-up: each ``otel-train`` command imports only what it uses (issue 20, item 4).

A structural check, not a timing: a fresh interpreter runs the command and reports which modules it
imported. ``import otel_train.cli`` and ``--help`` load no analysis module, no numpy, no msgspec, no rich;
``summarize --json`` loads no rich and none of the other commands' analysis; each command's own
``--help`` loads no numpy. Import times are measured in benchmarks/analysis_throughput.py and written
in docs/benchmarks.md ("Start-up").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis_fixtures import Proc, write_run

PROBE = """
import json, sys
argv = sys.argv[1:]
code = 0
try:
    import otel_train.cli
    if argv:
        sys.argv = ["otel-train", *argv]
        otel_train.cli.main()
except SystemExit as exc:
    code = exc.code
import os
threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
print(json.dumps({"code": code, "modules": sorted(sys.modules), "threads": threads,
                  "blas": os.environ.get("OPENBLAS_NUM_THREADS")}), file=sys.stderr)
"""

HEAVY = ("numpy", "msgspec", "pydantic", "opentelemetry", "torch", "matplotlib", "duckdb", "google.protobuf")
"""Modules no command needs before it reads a run."""


def _report(*argv: str) -> dict:
    """What the probe says of ``otel-train *argv`` in a fresh interpreter (no BLAS thread count set)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120, env=env)
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    report["stdout"] = proc.stdout
    return report


def _imported(*argv: str) -> tuple[object, set[str], str]:
    """(exit code, every module imported, stdout) of ``otel-train *argv`` in a fresh interpreter."""
    report = _report(*argv)
    return report["code"], set(report["modules"]), report["stdout"]


def _loaded(modules: set[str], *roots: str) -> list[str]:
    """The modules among ``modules`` that are one of ``roots`` or inside one."""
    return sorted(m for m in modules if any(m == r or m.startswith(r + ".") for r in roots))


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("imports") / "run"
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    for p in procs:
        p.steps(range(5))
        p.shutdown()
    write_run(run, procs)
    return run


def test_importing_the_cli_loads_no_analysis_numpy_msgspec_or_rich() -> None:
    code, modules, _ = _imported()
    assert code == 0
    assert "otel_train.cli.summarize" in modules and "otel_train.cli.diff" in modules  # the commands registered
    assert _loaded(modules, "otel_train.analysis", "otel_train.runtime", "rich", *HEAVY) == []


def test_help_loads_no_analysis_numpy_msgspec_or_rich() -> None:
    code, modules, out = _imported("--help")
    assert code == 0
    for command in ("summarize", "stats", "export", "whatif", "diff", "watch", "push"):
        assert command in out
    # help is click's plain text: typer's rich help would import rich and markdown-it
    assert _loaded(modules, "otel_train.analysis", "otel_train.runtime", "rich", "markdown_it", *HEAVY) == []


@pytest.mark.parametrize("command", ["summarize", "stats", "export", "whatif", "diff", "watch", "push"])
def test_a_commands_help_loads_no_analysis(command: str) -> None:
    code, modules, out = _imported(command, "--help")
    assert code == 0 and "--" in out
    # pyproject keeps typer below 0.29, which coerces every parameter through pydantic (60 - 180 ms)
    assert _loaded(modules, "otel_train.analysis", *HEAVY) == []


def test_summarize_json_loads_only_what_it_uses(small_run: Path) -> None:
    code, modules, out = _imported("summarize", str(small_run), "--json")
    assert code == 0
    assert {p["rank"] for p in json.loads(out)["processes"]} == {0, 1}
    assert "otel_train.analysis.summary" in modules  # it did read the run
    unused = ("otel_train.analysis.export", "otel_train.analysis.diff", "otel_train.analysis.live",
              "otel_train.analysis.push", "otel_train.analysis.otlp", "otel_train.analysis.otlp_send",
              "otel_train.analysis.plot", "otel_train.analysis.fast", "otel_train.runtime")
    assert _loaded(modules, "rich", *unused, "opentelemetry", "torch", "matplotlib", "duckdb", "pydantic") == []


def test_reading_a_small_run_starts_no_pool_and_no_blas_threads(small_run: Path) -> None:
    """A small run is read in this process: no pool's modules; no dumps, so no Flight Recorder reader;
    and numpy's OpenBLAS starts no thread pool (it cost 40 ms of start-up beside a busy core)."""
    report = _report("summarize", str(small_run), "--json", "--no-cache")
    assert report["code"] == 0 and "otel_train.analysis.summary" in report["modules"]
    assert _loaded(set(report["modules"]), "multiprocessing", "concurrent.futures", "secrets",
                   "otel_train.analysis.flight_recorder") == []
    assert report["blas"] == "1"
    assert report["threads"] in (1, None)  # the main thread alone


def test_stats_json_loads_no_findings_or_export(small_run: Path) -> None:
    code, modules, out = _imported("stats", str(small_run), "--json")
    assert code == 0 and json.loads(out)["phases"]
    assert _loaded(modules, "rich", "otel_train.analysis.export", "otel_train.analysis.diff",
                   "otel_train.analysis.live", "otel_train.analysis.push", "opentelemetry") == []


def test_the_clis_copies_of_analysis_defaults_agree() -> None:
    """The CLI keeps a few option defaults as literals so that registering the commands imports no
    analysis; they must stay what the analysis uses."""
    from otel_train.analysis.diff import MIN_RUNS, Thresholds
    from otel_train.analysis.findings import FINDING_KINDS
    from otel_train.analysis.whatif import SYNC_PHASES
    from otel_train.cli import diff, watch, whatif

    assert whatif.SYNC_PHASES == SYNC_PHASES
    assert watch.FINDING_KINDS == FINDING_KINDS
    default = Thresholds()
    assert (diff.DEFAULT_MAX_P, diff.DEFAULT_MIN_PCT, diff.DEFAULT_MIN_MS) == (
        default.max_p, default.min_pct, default.min_ms)
    assert diff.MIN_BASELINES == MIN_RUNS - 1
