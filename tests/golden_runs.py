"""The fixed runs and the expected CLI answers of tests/test_behaviour_unchanged.py.

    .venv/bin/python tests/golden_runs.py record [RUN ...]  # once: the runs -> tests/data/golden/runs.tar.xz
    .venv/bin/python tests/golden_runs.py expect   # the CLI's answers -> tests/data/golden/expected/

``record`` runs small real jobs (gloo on CPU, torchrun, examples/train_ddp.py) and writes two
synthetic runs, then packs their trace files (``structured_logs/``, ``flight_recorder/``):

- ``clean``: 4 ranks, 12 steps, no fault;
- ``straggler``: the same with rank 2 40 ms slower in data_fetch, ranks 0-1 on ``host-a`` and 2-3 on
  ``host-b`` whose clock is 2 s behind (tests/faketime_launch.py, libfaketime): a clock estimate and
  a ``clock_skew`` finding;
- ``hang``: 3 ranks, rank 1 sleeps in forward at step 5; every rank dumps its Flight Recorder buffer
  3 s later, the stall records come, then every rank is killed (SIGSTOP, then SIGKILL);
- ``hang-fr``: 3 ranks with collectives off (no ``comm.*`` span): rank 1 skips the metric all-reduce of
  step 5, and the hang is known from the Flight Recorder dumps alone;
- ``desync``: 3 ranks, rank 2 calls broadcast where the others call all_reduce at step 4; the
  collective timeout ends the job;
- ``titan``: torchtitan's file format, 3 ranks, rank 1 stops in fetching_batch (tests/test_titan_files.py);
- ``restart``: synthetic (tests/analysis_fixtures.py): attempt 0 fails in forward on rank 1, attempt 1
  gets further; rotated segments, a garbage line and a torn last line.

``expect`` runs every command of :data:`COMMANDS` through the CLI (Typer's CliRunner, as the suite
does) on the runs unpacked into a temporary directory and writes each answer (exit code, stdout,
stderr, and the file a command wrote) after :func:`normalise` to ``expected/<name>.txt``. Run it only
to record the behaviour of a reviewed change; the test compares the CLI against these files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GOLDEN = HERE / "data" / "golden"
ARCHIVE = GOLDEN / "runs.tar.xz"
EXPECTED = GOLDEN / "expected"
RUNS = ("clean", "straggler", "hang", "hang-fr", "desync", "titan", "restart")
KEEP = ("structured_logs", "flight_recorder")
"""What the archive keeps of each run directory (no checkpoints, no launcher log)."""

ENV = {"COLUMNS": "120", "NO_COLOR": "1", "TERM": "dumb"}
"""The environment of every command: a fixed terminal width, no colours."""

# name -> arguments; {run} is the unpacked run directory of that name, {out} a fresh output directory.
COMMANDS: dict[str, list[str]] = {}
for _r in RUNS:
    COMMANDS |= {
        f"summarize-{_r}": ["summarize", "{%s}" % _r, "--no-cache"],
        f"summarize-json-{_r}": ["summarize", "{%s}" % _r, "--json", "--no-cache"],
        f"summarize-fast-{_r}": ["summarize", "{%s}" % _r, "--fast", "--no-cache"],
        f"summarize-fast-json-{_r}": ["summarize", "{%s}" % _r, "--fast", "--json", "--no-cache"],
        f"stats-{_r}": ["stats", "{%s}" % _r, "--no-cache"],
        f"stats-json-{_r}": ["stats", "{%s}" % _r, "--json", "--no-cache"],
        f"whatif-{_r}": ["whatif", "{%s}" % _r, "--no-cache"],
        f"whatif-json-{_r}": ["whatif", "{%s}" % _r, "--json", "--no-cache"],
        f"export-chrome-{_r}": ["export", "{%s}" % _r, "--output", "{out}/trace.json", "--no-cache"],
    }
COMMANDS |= {
    "summarize-json-straggler-no-align": ["summarize", "{straggler}", "--json", "--no-align", "--no-cache"],
    "summarize-json-straggler-steps": ["summarize", "{straggler}", "--json", "--steps", "3-7", "--no-cache"],
    "summarize-json-hang-no-fr": ["summarize", "{hang}", "--json", "--fr", "{out}", "--no-cache"],
    "summarize-hang-fr-no-fr": ["summarize", "{hang-fr}", "--fr", "{out}/none", "--no-cache"],
    "stats-json-straggler-steps": ["stats", "{straggler}", "--json", "--steps", "3-7", "--no-cache"],
    "whatif-json-straggler-typical": ["whatif", "{straggler}", "--json", "--method", "typical", "--no-cache"],
    "whatif-json-straggler-no-align": ["whatif", "{straggler}", "--json", "--no-align", "--no-cache"],
    "whatif-json-straggler-steps": ["whatif", "{straggler}", "--json", "--steps", "3-7", "--no-cache"],
    "export-chrome-straggler-no-align": ["export", "{straggler}", "--output", "{out}/trace.json", "--no-align",
                                         "--no-cache"],
    "export-chrome-straggler-steps-ranks": ["export", "{straggler}", "--output", "{out}/trace.json", "--steps",
                                            "3-7", "--ranks", "1-2", "--no-cache"],
    "export-otlp-json-hang": ["export", "{hang}", "--output", "{out}/trace.otlp.json", "--format", "otlp-json",
                              "--no-cache"],
    "export-perfetto-straggler": ["export", "{straggler}", "--output", "{out}/trace.pftrace", "--format", "perfetto",
                                  "--no-cache"],
    "diff-clean-straggler": ["diff", "{clean}", "{straggler}", "--no-cache"],
    "diff-json-clean-straggler": ["diff", "{clean}", "{straggler}", "--json", "--no-cache"],
    "query-views-clean": ["query", "{clean}", "--no-cache"],
    "query-phases-straggler": ["query", "{straggler}", "SELECT rank, name, count(*) AS n, round(sum(dur_ms), 3) AS ms "
                               "FROM spans GROUP BY ALL ORDER BY rank, name", "--format", "csv", "--no-cache"],
    "query-findings-hang": ["query", "{hang}", "SELECT kind, rank, step, phase, message, comm FROM findings "
                            "ORDER BY kind, rank", "--format", "json", "--no-cache"],
    "query-comm-desync": ["query", "{desync}", 'SELECT rank, step, "group", seq, op, bytes, dtype, status, phase, '
                          "round(wait_ms, 3) AS wait_ms, last_arrival FROM comm ORDER BY rank, \"group\", seq",
                          "--format", "csv", "--no-cache"],
    "query-clock-straggler": ["query", "{straggler}", "SELECT * FROM clock ORDER BY host", "--no-cache"],
    "summarize-missing": ["summarize", "{out}/nothing-here"],
}


# --- the answers -------------------------------------------------------------------------------------

def unpack(dest: Path) -> dict[str, Path]:
    """The runs of the archive under ``dest``: name -> run directory."""
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(dest, filter="data")
    return {name: dest / name for name in RUNS}


def normalise(text: str, paths: dict[str, Path]) -> str:
    """The answer with its volatile parts replaced, and nothing else:

    - each unpacked run directory's absolute path -> ``<run:NAME>`` and the output directory -> ``<out>``
      (they live under pytest's tmp_path); longest first, so a path inside another is replaced whole;
    - the reading package's version where an export states it, exactly in these two forms: the chrome
      trace's ``"generator": "otel-train <version>"`` and the OTLP JSON's instrumentation scope
      ``"name": "otel_train", "version": "<version>"``. (The versions the traced processes recorded in
      their ``process_start`` records are data and stay as they are.)
    """
    from otel_train import __version__

    for name, path in sorted(paths.items(), key=lambda kv: -len(str(kv[1]))):
        text = text.replace(str(path), f"<{name}>")
    text = text.replace(f'"generator": "otel-train {__version__}"', '"generator": "otel-train <version>"')
    return re.sub(r'("name": "otel_train",\n\s*"version": )"%s"' % re.escape(__version__), r'\1"<version>"', text)


def answer(name: str, runs: dict[str, Path], scratch: Path) -> str:
    """One command's answer, normalised: exit code, stdout, stderr and the file it wrote, if any."""
    from typer.testing import CliRunner

    from otel_train.cli import app

    out = scratch / name
    out.mkdir(parents=True)
    paths = {**{f"run:{k}": v for k, v in runs.items()}, "out": out}
    fields = {k: str(v) for k, v in runs.items()} | {"out": str(out)}
    args = [a.format(**fields) for a in COMMANDS[name]]
    result = CliRunner().invoke(app, args, env=ENV | {"XDG_CACHE_HOME": str(scratch / "cache")})
    parts = [f"$ otel-train {' '.join(COMMANDS[name])}", f"exit {result.exit_code}",
             "--- stdout", result.stdout, "--- stderr", result.stderr]
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        parts.append(f"--- exception {type(result.exception).__name__}: {result.exception}")
    for f in sorted(p for p in out.rglob("*") if p.is_file()):
        data = f.read_bytes()
        parts.append(f"--- file {f.relative_to(out)} ({len(data)} bytes)")
        parts.append(_file_text(f, data))
    return normalise("\n".join(parts), paths) + "\n"


def _file_text(path: Path, data: bytes) -> str:
    """A written file as text: JSON pretty-printed with sorted keys (a diff then points at the field),
    a binary file as its SHA-256."""
    if path.suffix == ".json":
        return json.dumps(json.loads(data), indent=1, sort_keys=True)
    try:
        return data.decode()
    except UnicodeDecodeError:
        import hashlib

        return f"sha256 {hashlib.sha256(data).hexdigest()}"


def expect() -> None:
    """Write every command's answer of today's code to ``expected/``."""
    shutil.rmtree(EXPECTED, ignore_errors=True)
    EXPECTED.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = unpack(Path(tmp) / "runs")
        for name in COMMANDS:
            (EXPECTED / f"{name}.txt").write_text(answer(name, runs, Path(tmp) / "out"))
            print(name, flush=True)


# --- the runs ----------------------------------------------------------------------------------------

TRAIN = ROOT / "examples" / "train_ddp.py"
FAKETIME = HERE / "faketime_launch.py"
SMALL = ("--steps", "12", "--batch-size", "8", "--hidden", "16", "--eval-every", "0", "--checkpoint-every", "0")


def _env(**extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCH_FR", "FAKETIME", "CLOCK_"))}
    return keep | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)} | extra


@contextmanager
def _job(save: Path, ranks: int, *args: str, script: Path = TRAIN, **extra: str) -> Iterator[subprocess.Popen]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(script),
           "--save-path", str(save), *args]
    log = open(save.parent / f"{save.name}.log", "wb")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(**extra), start_new_session=True)
    try:
        yield proc
    finally:
        ranks_left = _ranks(save)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in ranks_left:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def _ranks(save: Path) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and str(save).encode() in (p / "cmdline").read_bytes().split(b"\0"):
                pids.append(int(p.name))
        except OSError:
            pass
    return [p for p in pids if p != os.getpid()]


def _synthetic(tmp: Path) -> None:
    sys.path.insert(0, str(HERE))
    from analysis_fixtures import Proc, write_run
    from test_titan_files import _titan_run

    for w in _titan_run(tmp / "titan", world=3, steps=8, hang=(1, "fetching_batch")):
        w.f.close()
    procs = []
    for rank in range(2):
        first = Proc(rank=rank, world_size=2, rand=f"a0000{rank}", stamp="20240101-000000")
        first.steps(range(4))
        if rank == 1:
            first.fail(4, "forward", message="CUDA error: an illegal memory access")
        else:
            first.stop_inside(4, ["backward"])
        second = Proc(rank=rank, world_size=2, attempt=1, rand=f"b0000{rank}", stamp="20240101-000100",
                      t0=1_700_000_060.0)
        second.steps(range(3, 12))
        second.stop_inside(12, ["data_fetch"])
        procs += [first, second]
    write_run(tmp / "restart", procs, lines_per_segment=40, torn_tail=True, garbage={7: b"\x00 not json"})


def _hang(tmp: Path, name: str, ranks: int, *args: str, **extra: str) -> None:
    """A job that hangs at step 5: wait for every rank's Flight Recorder dump, then 4 s more (the last
    dump whole; stall records and a heartbeat); leaving the job kills every rank."""
    with _job(tmp / name, ranks, *SMALL, "--timeout-s", "60", "--fault-step", "5", "--fr-dump-after", "3", *args,
              OTEL_TRAIN_STALL_MIN_S="2", OTEL_TRAIN_HEARTBEAT_S="3", **extra):
        dumps = tmp / name / "flight_recorder"
        deadline = time.monotonic() + 120
        while len(list(dumps.glob("dump.rank_*.pkl"))) < ranks and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(4.0)


def _record_one(tmp: Path, name: str) -> None:
    if name == "clean":
        with _job(tmp / "clean", 4, *SMALL) as proc:
            proc.wait(180)
    elif name == "straggler":
        with _job(tmp / "straggler", 4, *SMALL, "--slow-rank", "2", "--slow-phase", "data_fetch", "--slow-ms", "40",
                  script=FAKETIME, CLOCK_FAKE_B="-2s") as proc:
            proc.wait(180)
    elif name == "hang":
        _hang(tmp, "hang", 3, "--hang-rank", "1", "--hang-step", "5", "--hang-phase", "forward")
    elif name == "hang-fr":
        _hang(tmp, "hang-fr", 3, "--fault", "skip-collective", "--fault-rank", "1", OTEL_TRAIN_COLLECTIVES="off")
    elif name == "desync":
        with _job(tmp / "desync", 3, *SMALL, "--fault", "desync-op", "--fault-rank", "2", "--fault-step", "4",
                  "--timeout-s", "5") as proc:
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                pass
    elif name in ("titan", "restart") and not (tmp / name).exists():
        _synthetic(tmp)


def record(names: list[str]) -> None:
    """Run the jobs (those named; none: all) and pack their trace files into the archive, with the
    archive's other runs as they were."""
    tmp = Path(tempfile.mkdtemp(prefix="golden-"))
    if names and ARCHIVE.exists():
        unpack(tmp)
        for name in names:
            shutil.rmtree(tmp / name, ignore_errors=True)
    for name in names or RUNS:
        _record_one(tmp, name)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    with tarfile.open(ARCHIVE, "w:xz", preset=9) as tar:
        for name in RUNS:
            for part in KEEP:
                if (tmp / name / part).exists():
                    tar.add(tmp / name / part, f"{name}/{part}", filter=_plain_member)
    print(f"{ARCHIVE}: {ARCHIVE.stat().st_size} bytes (runs and launcher logs in {tmp})")


def _plain_member(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"]:
        record(sys.argv[2:])
    elif sys.argv[1:] == ["expect"]:
        expect()
    else:
        raise SystemExit(__doc__)
