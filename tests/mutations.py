"""Deliberate breakages of the package's key rules, each of which some test must catch (``make mutations``).

Each :class:`Mutation` names one file, a piece of its text that must occur exactly once, what replaces it,
the tests that exist to catch it (files or node ids) and why the breakage matters. For each one this
script copies the repository to a temporary directory, applies the breakage to the copy, and runs those
tests there with pytest. A mutation the tests let pass is a *survivor*: a promise ``make test`` would not
keep. The script prints every survivor (and every entry whose text no longer matches the code: *stale*)
and exits 1 if there is any; 0 when every breakage was caught.

The copy imports its own code. The package is installed in editable mode, and setuptools' editable
finder (a ``sys.meta_path`` entry of the venv) maps ``otel_train`` and ``otel_train.exporters`` (the
repository's ``exporters/`` folder, by ``package-dir``) to this repository, whatever ``sys.path`` says about
the second. The copy gets a ``sitecustomize.py`` at its root that points that finder's map at the copy, and
every process of a run (pytest, torchrun ranks, CLI runs) finds it through ``PYTHONPATH`` set to the copy;
a test that sets ``PYTHONPATH`` to its own repository root (the copy) finds it too. Before the runs,
:func:`check_isolation` asks a fresh interpreter where ``otel_train`` and
``otel_train.exporters.jsonl.writer`` come from, and stops unless both are inside the copy.

First every chosen entry's tests run once on an unmutated copy (the baseline): if they fail there, nothing
is judged (exit 2). Usage: ``python tests/mutations.py [-k NAME] [--list] [--keep] [--source REV]``
(``--source HEAD``: copy the last commit, not the working tree with its edits in progress). Adding one: append a
:class:`Mutation` to :data:`MUTATIONS` (small text, exact, once in its file) and run it with ``-k``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = (".git", ".venv", ".venv-*", "runs", "demo_run", "*.egg-info", ".pytest_cache", ".hypothesis",
        ".benchmarks", "build", "dist", "__pycache__")
RUN_TIMEOUT_S = 900
"""One mutation's tests, at most (a mutation that makes a test hang is caught: it would hang ``make test``)."""

SITECUSTOMIZE = '''\
"""Written by tests/mutations.py into a temporary copy of the repository: this copy's code, not the
installed checkout's (setuptools' editable finder maps otel_train and otel_train.exporters by name)."""
import sys
from pathlib import Path

_here = Path(__file__).resolve().parent
for _name, _module in list(sys.modules.items()):
    if _name.startswith("__editable__") and isinstance(getattr(_module, "MAPPING", None), dict):
        _module.MAPPING.update({"otel_train": str(_here / "otel_train"),
                                "otel_train.exporters": str(_here / "exporters")})
'''


@dataclass(frozen=True)
class Mutation:
    """One deliberate breakage: in ``file`` (relative to the repository root), ``old`` (exactly once) becomes
    ``new``; ``tests`` (pytest arguments: files or node ids) must then fail."""

    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str


FINDINGS = "otel_train/analysis/findings.py"
COMM_FAULTS = "tests/test_comm_faults.py"

MUTATIONS: list[Mutation] = [
    Mutation(
        "straggler-size-floor", FINDINGS,
        "        if p >= STRAGGLER_MAX_P or extra < floor:\n",
        "        if p >= STRAGGLER_MAX_P:\n",
        ("tests/test_summary.py",),
        "the culprit choice: a rank slower in most steps by a hair (under the floor) is no straggler"),
    Mutation(
        "straggler-significance", FINDINGS,
        "        if p >= STRAGGLER_MAX_P or extra < floor:\n",
        "        if extra < floor:\n",
        ("tests/test_summary.py",),
        "the culprit choice: a rank slow in a few steps only (no significant majority) is no straggler"),
    Mutation(
        "straggler-peer-lateness", FINDINGS,
        "        found = _stragglers_in(group, table, excess - behind)\n",
        "        found = _stragglers_in(group, table, excess)\n",
        ("tests/test_summary.py", "tests/test_comm_findings.py"),
        "the culprit choice: a rank whose phase waited for a later peer (e.g. backward's all-reduce) is a victim"),
    Mutation(
        "straggler-victim-filter", FINDINGS,
        '            found = [f for f in found if f["rank"] in kept]\n',
        "            found = list(found)\n",
        ("tests/test_comm_findings.py", f"{COMM_FAULTS}::test_waiting_pipeline_stage_is_no_straggler"),
        "the victim filter: a rank named in a phase only for the time its comm ops waited for a later peer"),
    Mutation(
        "straggler-cost-judge", FINDINGS,
        "        if judge and _absorbed(f, cost):\n",
        "        if False:\n",
        ("tests/test_summary.py", "tests/test_comm_findings.py"),
        "_absorbed: a straggler whose what-if cost is ~0 is a victim, not a finding"),
    Mutation(
        "arrival-victim", FINDINGS,
        "                f = None  # a victim: its lateness is waiting for someone else (issue 17, item 6)\n",
        "                pass\n",
        ("tests/test_comm_findings.py", f"{COMM_FAULTS}::test_slow_pipeline_stage_is_the_straggler"),
        "the arrival rule's victim filter: a rank late because it waited in an earlier op is not the culprit"),
    Mutation(
        "desync-minority", "otel_train/analysis/comm.py",
        "        return seq, sides[culprit], sides\n",
        "        return seq, sides[max(sides, key=lambda s: len(sides[s]))], sides\n",
        ("tests/test_comm_findings.py",),
        "the desync culprit: the minority side, not the ranks that did what most did"),
    Mutation(
        "clock-clamp", "otel_train/analysis/clock.py",
        "        offset = min(max(offset, lo), hi)\n",
        "        pass\n",
        ("tests/test_clock.py",),
        "the clock fit's causal bounds: a host whose ranks always leave a little later is no clock offset"),
    Mutation(
        "clock-skew-finding", "otel_train/analysis/clock.py",
        "SKEW_MS = 10.0\n",
        "SKEW_MS = 10.0e3\n",
        ("tests/test_clock.py",),
        "a host's clock off the reference by more than 10 ms is a clock_skew finding"),
    Mutation(
        "graph-join-waits", "otel_train/analysis/graph_joins.py",
        "    waits = (of >= 0) & ~flat.o_send\n",
        "    waits = np.zeros(of.size, bool)\n",
        ("tests/test_whatif_graph.py", "tests/test_whatif_pipeline.py", "tests/test_whatif_sim.py", "tests/test_whatif.py"),
        "the what-if graph's join: a collective's members and a recv wait for the join (the last arrival)"),
    Mutation(
        "graph-join-send-ready", "otel_train/analysis/graph_joins.py",
        "    np.maximum.at(last, inv, np.where(flat.o_send & ~flat.o_detached.astype(bool), flat.o_end, flat.o_start))\n",
        "    np.maximum.at(last, inv, flat.o_start)\n",
        ("tests/test_whatif_graph.py", "tests/test_whatif_pipeline.py", "tests/test_whatif_sim.py", "tests/test_whatif.py"),
        "the what-if graph's join: a p2p pair is ready when the send is done, not when it began"),
    Mutation(
        "diff-gate-p", "otel_train/analysis/diff.py",
        "    found = p < th.max_p and matters\n",
        "    found = matters\n",
        ("tests/test_diff.py",),
        "diff's significance gate: a change no larger than the run's own noise is no regression"),
    Mutation(
        "diff-gate-size", "otel_train/analysis/diff.py",
        "    found = p < th.max_p and matters\n",
        "    found = p < th.max_p\n",
        ("tests/test_diff.py",),
        "diff's size floor: a significant change too small to matter is no finding"),
    Mutation(
        "redact-userinfo", "otel_train/redact.py",
        "        value = strip_userinfo(value)\n",
        "        pass\n",
        ("tests/test_config.py", "tests/test_lifecycle.py"),
        "the redaction: a URL's user:password never reaches a trace file"),
    Mutation(
        "unpickler-globals", "otel_train/analysis/flight_recorder.py",
        '        raise RefusedPickle(f"global {module}.{name}")\n',
        "        return super().find_class(module, name)\n",
        ("tests/test_flight_recorder.py",),
        "the restricted unpickler: a dump naming os.system never runs it"),
    Mutation(
        "terminal-control", "otel_train/cli/_text.py",
        "    return _UNSAFE.sub(_escape, text) if _UNSAFE.search(text) else text\n",
        "    return text\n",
        ("tests/faults/test_fault_text.py", "tests/test_cli.py"),
        "text from trace files is data: an escape sequence in a span name never reaches the terminal raw"),
    Mutation(
        "exporters-import", "exporters/jsonl/writer.py",
        "from __future__ import annotations\n",
        "from __future__ import annotations\nraise ImportError('mutant: the copy imports its own exporters')\n",
        ("tests/test_writer.py",),
        "the copy's own exporters/ is the one imported (the editable install would hide this mutation)"),
    Mutation(
        "write-path-buffered", "exporters/jsonl/processor.py",
        "        if self._writer is not None:\n            self._writer.write(line)\n",
        "        if self._writer is not None:\n            held = self.__dict__.setdefault('_held', [])\n"
        "            held.append(line)\n            if len(held) >= 64:\n"
        "                for one in held:\n                    self._writer.write(one)\n                held.clear()\n",
        ("tests/faults/test_fault_self_kill.py", "tests/test_process_lifecycle.py::test_sigkill_mid_stream_tears_at_most_the_last_line"),
        "the write path: a record held in Python after its call returned (a buffer, a queue) is lost on SIGKILL"),
    Mutation(
        "write-path-lagging-thread", "exporters/jsonl/processor.py",
        "        if self._writer is not None:\n            self._writer.write(line)\n",
        "        if self._writer is not None:\n            import threading as _t\n"
        "            _t.Timer(0.02, self._writer.write, (line,)).start()\n",
        ("tests/faults/test_fault_self_kill.py::test_sigkill_inside_a_span_at_once_leaves_every_earlier_record_and_the_span_start",),
        "the write path: a writer thread that lags 20 ms behind the call (the regression of ca73bd0)"),
    Mutation(
        "stall-never-detected", "exporters/jsonl/writer.py",
        "        if self.stalled_since or now - self._seen_at < STALL_S:\n",
        "        if True:\n",
        ("tests/test_writer.py::test_a_write_that_does_not_return_is_a_stall_reported_once_and_announced_when_it_returns",
         "tests/faults/test_fault_stall_write.py"),
        "a stalled storage: a write that does not return is found and reported by another thread"),
    Mutation(
        "stall-others-wait", "exporters/jsonl/processor.py",
        "        while not self._writer_stalled():\n",
        "        while True:\n",
        ("tests/faults/test_fault_stall_write.py::test_a_write_that_never_returns_is_reported_other_threads_drop_and_sigterm_ends_it",),
        "a stalled storage: other threads drop and count their records instead of waiting for the stuck write"),
    Mutation(
        "comm-arrival-late", "otel_train/comm/herald.py",
        "    if arrival is None or not hasattr(ids, \"request_span_id\"):\n",
        "    if True:\n",
        ("tests/faults/test_fault_comm_arrival.py",),
        "an op's arrival on disk before the backend has it (the recorder alone writes it up to 0.2 s later)"),
]


def copy_repository(dst: Path, source: str | None) -> Path:
    """The working tree (``source`` None: tracked and untracked files, no venvs, caches or runs) or the
    commit ``source`` (``git archive``) under ``dst``, with the ``sitecustomize.py`` that makes its processes
    import its own code."""
    if source is None:
        shutil.copytree(ROOT, dst, symlinks=True, ignore=shutil.ignore_patterns(*SKIP))
    else:
        dst.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", source], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)
    (dst / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return dst


def env_for(copy: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | {"PYTHONPATH": str(copy)}


def check_isolation(copy: Path) -> None:
    """Stop unless a fresh interpreter in the copy (from another directory, and with only ``PYTHONPATH``
    naming the copy, as a test's child gets) imports the copy's ``otel_train`` and its ``exporters``."""
    probe = ("import otel_train, otel_train.exporters.jsonl.writer as w, otel_train.analysis.findings as f;"
             "print(otel_train.__file__); print(w.__file__); print(f.__file__)")
    for cwd in (copy, copy / "tests", Path(tempfile.gettempdir())):
        out = subprocess.run([sys.executable, "-c", probe], cwd=cwd, env=env_for(copy), capture_output=True,
                             text=True, timeout=120)
        files = out.stdout.split()
        if out.returncode != 0 or len(files) != 3 or not all(Path(f).resolve().is_relative_to(copy) for f in files):
            sys.exit(f"mutations: the copy at {copy} does not import its own code (from {cwd}): "
                     f"{out.stdout.strip()} {out.stderr.strip()[-500:]}")


def apply(copy: Path, m: Mutation) -> bool:
    """Apply ``m`` to the copy; False when its ``old`` text is not in the file exactly once (stale)."""
    path = copy / m.file
    if not path.is_file():
        return False
    text = path.read_text()
    if text.count(m.old) != 1:
        return False
    path.write_text(text.replace(m.old, m.new))
    return True


def run_one(m: Mutation | None, tests: tuple[str, ...], source: str | None, keep: bool) -> tuple[str, float, str]:
    """(outcome, seconds, tail of pytest's output) of ``tests`` on a copy with ``m`` applied (None: the
    baseline, unmutated): outcome is killed, SURVIVED, STALE or killed (timeout)."""
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f"mutant-{m.name if m else 'baseline'}-"))
    try:
        copy = copy_repository(tmp / "repo", source)
        check_isolation(copy)
        if m is not None and not apply(copy, m):
            return "STALE", time.monotonic() - started, f"{m.file}: the old text is not there exactly once"
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", "otel_train", "exporters", "examples",
                        "tests"], cwd=copy, env=env_for(copy), capture_output=True, timeout=300)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
        try:
            out = subprocess.run(cmd, cwd=copy, env=env_for(copy), capture_output=True, text=True,
                                 timeout=RUN_TIMEOUT_S, start_new_session=True)
        except subprocess.TimeoutExpired:
            return "killed (timeout)", time.monotonic() - started, ""
        tail = (out.stdout + out.stderr)[-1500:]
        if out.returncode == 0:
            return "SURVIVED", time.monotonic() - started, tail
        if out.returncode in (4, 5):  # usage error / nothing collected: the entry's tests are wrong
            return "STALE", time.monotonic() - started, tail
        return "killed", time.monotonic() - started, tail
    finally:
        if keep:
            print(f"  kept: {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-k", dest="only", action="append", default=[], help="run the mutations whose name has this")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--keep", action="store_true", help="keep each mutated copy (its path is printed)")
    p.add_argument("-v", "--verbose", action="store_true", help="print pytest's output for every mutation")
    p.add_argument("--source", metavar="REV", help="copy this commit (git archive) instead of the working tree")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the first run of every chosen mutation's tests on an unmutated copy")
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or any(k in m.name for k in args.only)]
    if args.list:
        for m in chosen:
            print(f"{m.name:28} {m.file}  <- {' '.join(m.tests)}\n{'':28} {m.why}")
        return 0
    started = time.monotonic()
    if not args.no_baseline:  # a test that fails on the code as it is would "catch" every mutation
        union = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        outcome, seconds, tail = run_one(None, union, args.source, args.keep)
        print(f"{'baseline':18} {'(no mutation)':28} {seconds:6.1f} s", flush=True)
        if outcome != "SURVIVED":
            print(f"\nthe tests fail on the unmutated copy ({outcome}): fix that first\n{tail}")
            return 2
    bad: list[tuple[Mutation, str, str]] = []
    for m in chosen:
        outcome, seconds, tail = run_one(m, m.tests, args.source, args.keep)
        print(f"{outcome:18} {m.name:28} {seconds:6.1f} s  {m.file}", flush=True)
        if args.verbose:
            print(tail)
        if outcome in ("SURVIVED", "STALE"):
            bad.append((m, outcome, tail))
    print(f"\n{len(chosen) - len(bad)} of {len(chosen)} mutations caught in {time.monotonic() - started:.0f} s")
    for m, outcome, tail in bad:
        print(f"\n{outcome}: {m.name} ({m.file}): {m.why}\n  tests: {' '.join(m.tests)}\n{tail}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
