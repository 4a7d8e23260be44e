"""The read cache (otel_train/analysis/reading/cache.py) is never served stale, and never fails a read.

Each test reads a run (filling the cache), changes its files the way the case says, and checks that
the next read equals a read without the cache, and whether the entry was served, extended or missed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analysis_fixtures import Proc, write_run
from otel_train import schema
from otel_train.analysis.reading import cache as C
from otel_train.analysis.reading.cache_files import bound
from otel_train.analysis.records import find_process_files
from otel_train.analysis.spans import Run, load_run
from otel_train.cli import app


def _run(tmp_path: Path, n: int = 30, *, segment: int | None = None) -> list[Proc]:
    procs = [Proc(rank=r, world_size=2) for r in range(2)]
    for p in procs:
        p.steps(range(n))
        p.shutdown()
    write_run(tmp_path, procs, lines_per_segment=segment)
    return procs


def _view(run: Run) -> list[tuple]:
    return [(d.rank, d.records, d.final_step, d.ended_cleanly, d.malformed,
             {k: (list(v.steps), list(v.durs)) for k, v in d.phases.items()}) for d in run.processes]


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count lookups by outcome across every Cache made."""
    counts = {"hits": 0, "extended": 0, "misses": 0, "corrupt": 0}
    real = C.Cache.lookup

    def lookup(self: C.Cache, pf):  # type: ignore[no-untyped-def]
        before = {k: getattr(self, k) for k in counts}
        out = real(self, pf)
        for k in counts:
            counts[k] += getattr(self, k) - before[k]
        return out

    monkeypatch.setattr(C.Cache, "lookup", lookup)
    return counts


def _cdir(run: Path) -> Path:
    """The run's read cache directory: in this user's cache (the session's XDG_CACHE_HOME), never in the run."""
    d = C.cache_dir_of(run / schema.STRUCTURED_LOGS_DIR)
    assert d is not None
    return d


def _active(tmp_path: Path, rank: int = 0) -> Path:
    return find_process_files(tmp_path)[rank].paths[-1]


def test_second_read_is_served_and_equal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path)
    counts = _counting(monkeypatch)
    first = load_run(tmp_path)
    assert _cdir(tmp_path).is_dir() and counts["misses"] == 2
    second = load_run(tmp_path)
    assert counts["hits"] == 2 and _view(second) == _view(first) == _view(load_run(tmp_path, cache=False))


def test_a_state_pickled_by_other_code_is_never_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cached state is a pickled ProcessState: code that changed its fields (a new attribute) must
    # not be handed an old layout (seen: AttributeError 'clock_anchor' after an upgrade).
    _run(tmp_path)
    counts = _counting(monkeypatch)
    load_run(tmp_path)
    assert counts["misses"] == 2
    monkeypatch.setattr(C, "code_identity", lambda: "other code")
    again = load_run(tmp_path)
    assert counts["hits"] == 0 and counts["misses"] == 4
    assert _view(again) == _view(load_run(tmp_path, cache=False))


def test_an_appended_active_file_is_extended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    procs = _run(tmp_path)
    load_run(tmp_path)
    p = procs[0]
    before = len(p.lines)
    p.steps(range(30, 40))
    with _active(tmp_path).open("a") as f:
        f.write("".join(line + "\n" for line in p.lines[before:]))
    counts = _counting(monkeypatch)
    got = load_run(tmp_path)
    assert counts["extended"] == 1 and counts["hits"] == 1
    assert _view(got) == _view(load_run(tmp_path, cache=False))
    assert got.processes[0].final_step == 39


@pytest.mark.parametrize("change", ["rewritten", "truncated", "same_size_same_mtime", "replaced", "rotated"])
def test_a_changed_file_is_never_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    _run(tmp_path)
    load_run(tmp_path)
    path = _active(tmp_path)
    data = path.read_bytes()
    st = path.stat()
    if change == "rewritten":  # a different run written over it (longer)
        path.write_bytes(data.replace(b'"dur_ms":20.0', b'"dur_ms":99.0') + data[-400:].split(b"\n", 1)[1])
    elif change == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif change == "same_size_same_mtime":  # rewritten in place, size kept and mtime set back
        path.write_bytes(data.replace(b'"dur_ms":20.0', b'"dur_ms":21.0'))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    elif change == "replaced":  # another file renamed over it, same size and mtime
        other = path.with_name("tmp-other")
        other.write_bytes(data.replace(b'"dur_ms":20.0', b'"dur_ms":22.0'))
        os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(other, path)
    else:  # rotated by the sink: the active file becomes .1, a new one starts
        os.rename(path, Path(f"{path}.1"))
        path.write_bytes(data[-300:].split(b"\n", 1)[1])
    counts = _counting(monkeypatch)
    got = load_run(tmp_path)
    assert _view(got) == _view(load_run(tmp_path, cache=False))
    if change == "rotated":
        assert counts["misses"] + counts["extended"] >= 1 and counts["hits"] == 1
    else:
        assert counts["misses"] == 1 and counts["hits"] == 1


def test_a_corrupt_entry_is_ignored_counted_and_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path)
    want = _view(load_run(tmp_path))
    entries = sorted(_cdir(tmp_path).glob("*.state"))
    assert len(entries) == 2
    entries[0].write_bytes(b"\x80\x05not a pickle at all")
    counts = _counting(monkeypatch)
    assert _view(load_run(tmp_path)) == want
    assert counts["corrupt"] == 1 and counts["hits"] == 1
    assert _view(load_run(tmp_path)) == want and counts["hits"] == 3  # rebuilt


def test_a_symlinked_entry_is_not_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path)
    load_run(tmp_path)
    entry = sorted(_cdir(tmp_path).glob("*.state"))[0]
    target = tmp_path / "elsewhere"
    entry.rename(target)
    entry.symlink_to(target)
    counts = _counting(monkeypatch)
    load_run(tmp_path)
    assert counts["corrupt"] == 1


def test_the_cache_is_never_in_the_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    _run(run)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    load_run(run)
    assert not (run / C.CACHE_DIR).exists()
    assert len(list((tmp_path / "xdg" / "otel-train").glob("*/*.state"))) == 2
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "xdg" / "otel-train").rglob("*")}
    assert modes and all(m & 0o077 == 0 for m in modes.values()), modes


def test_a_cache_directory_others_can_write_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path)
    _cdir(tmp_path).mkdir(parents=True, mode=0o777)
    os.chmod(_cdir(tmp_path), 0o777)
    counts = _counting(monkeypatch)
    want = _view(load_run(tmp_path))
    assert not list(_cdir(tmp_path).iterdir()) and counts["misses"] == 2
    assert _view(load_run(tmp_path)) == want and counts["misses"] == 4


def test_no_cache_neither_reads_nor_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path)
    load_run(tmp_path, cache=False)
    assert not _cdir(tmp_path).exists()
    res = CliRunner().invoke(app, ["summarize", str(tmp_path), "--json", "--no-cache"])
    assert res.exit_code == 0, res.output
    assert not _cdir(tmp_path).exists()
    res = CliRunner().invoke(app, ["stats", str(tmp_path), "--json"])
    assert res.exit_code == 0 and _cdir(tmp_path).is_dir()


def test_a_torn_last_line_is_not_cached_and_warnings_come_back(tmp_path: Path) -> None:
    procs = [Proc(rank=0, world_size=1)]
    procs[0].steps(range(10))
    write_run(tmp_path, procs, torn_tail=True, garbage={5: b"garbage"})
    warnings: list[str] = []
    first = load_run(tmp_path, warn=warnings.append)
    assert first.malformed_lines == 2 and not list(_cdir(tmp_path).glob("*.state"))
    logs = tmp_path / schema.STRUCTURED_LOGS_DIR
    path = next(logs.iterdir())
    path.write_bytes(path.read_bytes().rsplit(b"\n", 1)[0] + b"\n")  # the torn line dropped: whole lines
    load_run(tmp_path)
    warnings.clear()
    again = load_run(tmp_path, warn=warnings.append)
    assert again.malformed_lines == 1 and len(warnings) == 1 and "garbage" not in warnings[0]


def test_the_size_bound_drops_the_least_recently_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _run(tmp_path)
    load_run(tmp_path)
    entries = sorted(_cdir(tmp_path).glob("*.state"), key=lambda p: p.stat().st_mtime_ns)
    os.utime(entries[0], ns=(1, 1))
    assert {p.parent for p in C.user_root().glob("*/*.*")} == {_cdir(tmp_path)}  # the whole cache: this run's
    bound(entries[1].stat().st_size)
    assert not entries[0].exists() and entries[1].exists()


# ---------------------------------------------------------------------------------------------
# Remembered results (reading/cache.py Recall, cli/_remember.py): served only for unchanged inputs


def _invoke(*args: str) -> str:
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def _computed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the summaries computed (not served) by ``summarize``."""
    import otel_train.analysis.summary as summary

    calls: list[int] = []
    real = summary.summarize_run

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(summary, "summarize_run", counted)
    return calls


def _rank_file(run: Path, proc: Proc) -> Path:
    return run / schema.STRUCTURED_LOGS_DIR / proc.file_name


@pytest.mark.parametrize("change", ["appended", "same_size_same_mtime", "truncated", "replaced", "rotated",
                                    "new_process", "removed_process", "fr_dump", "code"])
def test_a_remembered_result_is_never_served_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    change: str) -> None:
    procs = _run(tmp_path)
    calls = _computed(monkeypatch)
    first = _invoke("summarize", str(tmp_path), "--json")
    assert _invoke("summarize", str(tmp_path), "--json") == first and len(calls) == 1  # served
    assert list(_cdir(tmp_path).glob("*.result"))
    path = _rank_file(tmp_path, procs[0])
    data, st = path.read_bytes(), path.stat()
    if change == "appended":
        p = procs[0]
        before = len(p.lines)
        p.steps(range(30, 35))
        with path.open("a") as f:
            f.write("".join(line + "\n" for line in p.lines[before:]))
    elif change == "same_size_same_mtime":
        path.write_bytes(data.replace(b'"dur_ms":20.0', b'"dur_ms":29.0'))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif change == "truncated":
        path.write_bytes(data[: data.rfind(b"\n", 0, len(data) // 2) + 1])
    elif change == "replaced":
        other = path.with_name("tmp-other")
        other.write_bytes(data.replace(b'"dur_ms":20.0', b'"dur_ms":23.0'))
        os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(other, path)
    elif change == "rotated":
        os.rename(path, Path(f"{path}.1"))
        path.write_bytes(data[-300:].split(b"\n", 1)[1])
    elif change == "new_process":
        extra = Proc(rank=2, world_size=3)
        extra.steps(range(5))
        extra.shutdown()
        write_run(tmp_path, [extra])
    elif change == "removed_process":
        path.unlink()
    elif change == "fr_dump":  # a dump in the run's flight_recorder/ (unreadable: a warning in the summary)
        (tmp_path / "flight_recorder").mkdir()
        (tmp_path / "flight_recorder" / "rank_0.json").write_text("{not a dump")
    else:  # the code changed (another version of otel-train, an edited source)
        monkeypatch.setattr(C, "code_identity", lambda: "another version")
    again = _invoke("summarize", str(tmp_path), "--json")
    assert len(calls) == 2, "computed again"
    assert again == _invoke("summarize", str(tmp_path), "--json", "--no-cache")
    if change not in ("code", "rotated"):  # (a rotation keeps the same records)
        assert again != first


def test_a_result_is_kept_per_arguments_and_with_its_warnings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    procs = [Proc(rank=0, world_size=1)]
    procs[0].steps(range(20))
    procs[0].shutdown()
    write_run(tmp_path, procs, garbage={7: b"not json"})
    calls = _computed(monkeypatch)
    whole = _invoke("summarize", str(tmp_path), "--json")
    window = _invoke("summarize", str(tmp_path), "--json", "--steps", "0-4")
    assert whole != window and len(calls) == 2
    assert _invoke("summarize", str(tmp_path), "--json") == whole
    assert _invoke("summarize", str(tmp_path), "--json", "--steps", "0-4") == window
    assert len(calls) == 2 and "malformed" in whole and "not json" not in whole
    stats = _invoke("stats", str(tmp_path), "--json")
    assert _invoke("stats", str(tmp_path), "--json") == stats == _invoke("stats", str(tmp_path), "--json", "--no-cache")


def test_no_cache_keeps_no_result(tmp_path: Path) -> None:
    _run(tmp_path)
    for args in (["summarize", "--json"], ["stats", "--json"], ["whatif", "--json"]):
        _invoke(args[0], str(tmp_path), *args[1:], "--no-cache")
    _invoke("export", str(tmp_path), "-o", str(tmp_path / "t.json"), "--no-cache")
    assert not _cdir(tmp_path).exists()


def test_a_diff_is_remembered_for_both_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a)
    procs = _run(b)
    first = _invoke("diff", str(a), str(b), "--json")
    assert _invoke("diff", str(a), str(b), "--json") == first
    path = _rank_file(b, procs[1])
    path.write_bytes(path.read_bytes().replace(b'"dur_ms":40.0', b'"dur_ms":80.0'))
    assert _invoke("diff", str(a), str(b), "--json") == _invoke("diff", str(a), str(b), "--json", "--no-cache") != first


def test_the_cli_copy_of_the_export_formats_agrees() -> None:
    from otel_train.analysis.export import FORMATS
    from otel_train.cli.export import FORMATS as CLI_FORMATS

    assert CLI_FORMATS == FORMATS


def _exports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    import otel_train.analysis.export as exp

    calls: list[int] = []
    real = exp.export

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(exp, "export", counted)
    return calls


@pytest.mark.parametrize("change", ["none", "output_removed", "output_edited", "trace_changed"])
def test_an_export_is_remembered_while_its_file_and_inputs_are_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    run, out, ref = tmp_path / "run", tmp_path / "t.pftrace", tmp_path / "ref.pftrace"
    procs = _run(run)
    calls = _exports(monkeypatch)
    said = _invoke("export", str(run), "-f", "perfetto", "-o", str(out))
    written = out.read_bytes()
    if change == "output_removed":
        out.unlink()
    elif change == "output_edited":
        out.write_bytes(written[:100])
    elif change == "trace_changed":
        path = _rank_file(run, procs[0])
        path.write_bytes(path.read_bytes().replace(b'"pid":1000', b'"pid":1009'))  # its process label
    again = _invoke("export", str(run), "-f", "perfetto", "-o", str(out))
    assert len(calls) == (1 if change == "none" else 2)
    _invoke("export", str(run), "-f", "perfetto", "-o", str(ref), "--no-cache")
    assert out.read_bytes() == ref.read_bytes()
    assert again == said
    if change == "trace_changed":
        assert out.read_bytes() != written


def test_export_fills_the_read_cache_and_plans_from_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_train.analysis.export import export

    _run(tmp_path, segment=40)
    first = export(tmp_path, "chrome", tmp_path / "a.json")
    assert len(list(_cdir(tmp_path).glob("*.state"))) == 2  # each process read whole, kept
    counts = _counting(monkeypatch)
    assert _view(load_run(tmp_path)) == _view(load_run(tmp_path, cache=False))
    assert counts["hits"] == 2
    second = export(tmp_path, "chrome", tmp_path / "b.json")  # its comm plan from the cached states
    assert counts["hits"] == 4
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    third = export(tmp_path, "chrome", tmp_path / "c.json", cache=False)
    assert counts["hits"] == 4 and (tmp_path / "c.json").read_bytes() == (tmp_path / "a.json").read_bytes()
    assert first.slices == second.slices == third.slices
