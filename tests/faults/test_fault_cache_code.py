"""A copied run directory carries a planted read-cache entry: a pickle whose ``__reduce__`` runs code.

The read cache and the remembered results used to live in ``<run>/.otel-train-cache/`` and were
unpickled from there: a run that arrives as a tarball, a clone or an ``scp -r`` could name any
callable. What must hold: nothing read from a run directory is ever unpickled or executed (the cache
lives under this user's own cache directory, keyed by the logs directory's path and identity;
otel_train/analysis/reading/cache.py); ``summarize`` and ``stats`` answer as without a cache; an entry
in the user's cache that is corrupt is a miss, never an error.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from analysis_fixtures import Proc, write_run
from faultlib import reported, trials
from typer.testing import CliRunner

from otel_train.analysis.reading import cache as C
from otel_train.analysis.records import find_process_files
from otel_train.cli import app
from otel_train import schema

COMMANDS = (["summarize", "--json"], ["stats", "--json"], ["summarize"], ["whatif", "--json"])


class _Planted:
    """Unpickled, it writes the marker file (what a hostile entry would do instead)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.write_text, (self.marker, "code ran"))


def _run(path: Path) -> None:
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    for p in procs:
        p.steps(range(12))
        p.shutdown()
    write_run(path, procs)


def _plant(run: Path, marker: Path) -> int:
    """A planted entry for every name the old layout read: each process's state, and result names."""
    folder = run / C.CACHE_DIR
    folder.mkdir(mode=0o700)
    evil = pickle.dumps(_Planted(marker))
    names = [f"{pf.instance}.{pf.source}.{pf.rank}.state" for pf in find_process_files(run)]
    names += [f"{i:032x}.result" for i in range(4)]
    for name in names:
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, evil)
        os.close(fd)
    return len(names)


def _invoke(*args: str) -> str:
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def test_a_planted_cache_entry_in_a_copied_run_never_runs(tmp_path: Path) -> None:
    holds = ("summarize, stats and whatif over a run whose .otel-train-cache/ holds a pickle that writes a file "
             "when unpickled: the file is never written, each answer equals --no-cache's, run twice (cold, served)")
    n = trials(2)
    with reported("planted pickle in a copied run's cache", holds, n):
        for trial in range(n):
            run, marker = tmp_path / f"run{trial}", tmp_path / f"marker{trial}"
            _run(run)
            assert _plant(run, marker) >= 3
            for args in COMMANDS:
                want = _invoke(args[0], str(run), *args[1:], "--no-cache")
                for _ in range(2):  # cold (filled), then served from the user's cache
                    assert _invoke(args[0], str(run), *args[1:]) == want, args
                    assert not marker.exists(), f"{args}: a pickle from the run directory was executed"


def test_a_corrupt_entry_in_the_user_cache_is_a_miss(tmp_path: Path) -> None:
    holds = ("every entry of the user's cache for a run truncated, emptied or replaced by garbage: summarize and "
             "stats exit 0 with --no-cache's answer, and the entries are rebuilt")
    with reported("corrupt entries in the user's read cache", holds, 3):
        _run(tmp_path)
        want = {a[0]: _invoke(a[0], str(tmp_path), *a[1:], "--no-cache") for a in COMMANDS[:2]}
        for a in COMMANDS[:2]:
            _invoke(a[0], str(tmp_path), *a[1:])
        folder = C.cache_dir_of(tmp_path / schema.STRUCTURED_LOGS_DIR)
        assert folder is not None
        for damage in (lambda b: b[: len(b) // 2], lambda b: b"", lambda b: b"\x80\x05garbage" * 10):
            entries = [p for p in folder.iterdir() if p.suffix in C.ENTRY_SUFFIXES]
            assert entries
            for entry in entries:
                entry.write_bytes(damage(entry.read_bytes()))
            for a in COMMANDS[:2]:
                assert _invoke(a[0], str(tmp_path), *a[1:]) == want[a[0]]
