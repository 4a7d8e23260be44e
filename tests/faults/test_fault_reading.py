"""Hostile inputs to the reading side: a digest that is not ours, lines of hundreds of MiB, files on
which ``summarize --fast`` has no tail to stand on (no step ever set, millions of malformed lines).

What must hold: ``--fast`` exits 0 whatever a digest holds (a bad one is skipped with a warning and the
tail answers); reading is linear in bytes with memory bounded by a constant whatever a line's length
(a line past the size limit is skipped, counted and warned about, never held); ``--fast`` never reads
more than a full summarize does. Time and memory are measured in ``benchmarks/long_lines.py``; here
the structure is asserted (what was counted, what was held), never speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from faultlib import reported

from otel_train import schema as S
from otel_train.analysis import records as R
from otel_train.analysis.fast import summarize_fast

TRAIN = textwrap.dedent(
    """
    import sys
    import otel_train as ot
    ot.init(save_path=sys.argv[1], enabled=True, digest_s=0.05)
    for step in range(int(sys.argv[2])):
        with ot.training_step(step), ot.log_trace_span("forward"):
            pass
    ot.shutdown(timeout_s=2.0)
    """
)


def _train(run: Path, steps: int = 5) -> None:
    done = subprocess.run([sys.executable, "-c", TRAIN, str(run), str(steps)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def _digest(run: Path) -> Path:
    (path,) = (run / S.DIGESTS_DIR).glob("*" + S.DIGEST_SUFFIX)
    return path


HOSTILE = {
    "bucket index 100000": lambda d: d["phases"]["forward"]["buckets"].update({"100000": 1}),
    "bucket index -1": lambda d: d["phases"]["forward"]["buckets"].update({"-1": 1}),
    "max_ms 1e308": lambda d: d["phases"]["forward"].update(max_ms=1e308),
    "sum_ms negative": lambda d: d["phases"]["forward"].update(sum_ms=-5.0),
    "count 2**70": lambda d: d["phases"]["forward"].update(count=2**70),
}


def test_a_hostile_digest_is_skipped_and_the_tail_answers(tmp_path: Path) -> None:
    holds = ("summarize --fast exits 0 with one warning naming the digest; the process is read from its "
             "file's tail (phases null, the same processes and findings as without a digest)")
    with reported("hostile digest (bucket index 100000 and 4 more out-of-range fields), summarize --fast",
                  holds, len(HOSTILE)):
        run = tmp_path / "run"
        _train(run)
        digest = _digest(run)
        good = json.loads(digest.read_text())
        assert good["phases"]["forward"]["buckets"], good
        digest.unlink()
        plain = summarize_fast(run, warn=pytest.fail)
        for label, spoil in HOSTILE.items():
            bad = json.loads(json.dumps(good))
            spoil(bad)
            digest.write_text(json.dumps(bad))
            result = subprocess.run([sys.executable, "-m", "otel_train.cli", "summarize", str(run), "--fast", "--json"],
                                    capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, (label, result.stderr[-2000:])
            out = json.loads(result.stdout)
            lines = result.stderr.strip().splitlines()
            warnings = [line for line in lines if "not a digest" in line and digest.name in line]
            assert len(warnings) == 1 and len(lines) == 1, (label, lines)
            assert out["digests"] == 0 and out["phases"] is None, label
            assert out["processes"] == plain["processes"] and out["findings"] == plain["findings"], label


def _rss_mb_of(code: str, *args: str) -> tuple[dict, float]:
    """Run ``code`` in a fresh interpreter; (its JSON answer on stdout, its peak RSS in MB)."""
    wrapper = code + "\nimport resource, json\nprint(json.dumps({'rss_kb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))\n"
    done = subprocess.run([sys.executable, "-c", wrapper, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-2]), json.loads(lines[-1])["rss_kb"] / 1024


READ = textwrap.dedent(
    """
    import json, sys
    from otel_train.analysis.records import Reader, find_process_files
    warnings = []
    reader = Reader(warn=warnings.append)
    n = 0
    for pf in find_process_files(sys.argv[1]):
        for batch in reader.batches(pf):
            n += len(batch)
    print(json.dumps({"records": n, "malformed": reader.malformed_lines, "warnings": warnings}))
    """
)


def _valid(seq: int, pad: int = 0) -> bytes:
    rec = {"v": 1, "ts": 1_790_000_000.0 + seq, "kind": "instant", "event": "note", "name": "note", "seq": seq,
           "rank": 0, "world_size": 1, "pid": 1, "tid": 1, "host": "h", "attempt": 0, "run_id": "r",
           "source": "training"}
    if pad:
        rec["attrs"] = {"pad": "x" * pad}
    return json.dumps(rec).encode() + b"\n"


def _logs(run: Path) -> Path:
    logs = run / S.STRUCTURED_LOGS_DIR
    logs.mkdir(parents=True)
    return logs / S.trace_file_name("training", 0, "20260101-000000", "abcdef")


def _write_long(path: Path, huge: int) -> None:
    with open(path, "wb") as f:
        f.write(_valid(1))
        f.write(_valid(2, pad=R.MAX_LINE_BYTES - 1024))  # just under the limit: decoded
        if huge:
            f.write(b'{"v":1,"attrs":"')
            block = b"y" * (1 << 20)
            for _ in range(huge >> 20):
                f.write(block)
            f.write(b'"}\n')
        f.write(_valid(3))


def test_lines_past_the_limit_are_skipped_without_being_held(tmp_path: Path) -> None:
    huge = 4 * R.MAX_LINE_BYTES
    holds = (f"a {huge >> 20} MiB line (4x the {R.MAX_LINE_BYTES >> 20} MiB limit) after one just under it: "
             "skipped, counted and warned about once; every other record read; the reader's peak RSS "
             f"grows < {R.MAX_LINE_BYTES >> 21} MiB over the same file without it (the line is never held)")
    with reported("one line 4x the line-size limit, and one just under it", holds, 2):
        without, with_ = tmp_path / "without", tmp_path / "with"
        _write_long(_logs(without), 0)
        _write_long(_logs(with_), huge)
        base, base_rss = _rss_mb_of(READ, str(without))
        assert base["records"] == 3 and base["malformed"] == 0, base
        out, rss = _rss_mb_of(READ, str(with_))
        assert out["records"] == 3 and out["malformed"] == 1, out
        assert len(out["warnings"]) == 1 and "longer than" in out["warnings"][0], out["warnings"]
        assert rss - base_rss < R.MAX_LINE_BYTES / 2**21, (rss, base_rss)


def test_tail_follows_a_line_past_the_limit_without_holding_it(tmp_path: Path) -> None:
    holds = "watch/push --follow's tail skips a line past the limit (counted once), reads the next records"
    with reported("a line past the limit arriving in pieces to a followed file", holds, 1):
        run = tmp_path / "run"
        path = _logs(run)
        tail = R.Tail(run, bad=R.BadLines(collect=True), max_bytes_per_poll=1 << 20)
        path.write_bytes(_valid(1))
        assert sum(len(recs) for _, recs in tail.poll()) == 1
        with open(path, "ab") as f:
            f.write(b'{"v":1,"attrs":"')
            for _ in range(2 * (R.MAX_LINE_BYTES >> 20) + 2):
                f.write(b"z" * (1 << 20))
                f.flush()
                tail.poll()
                part = sum(len(s.partial) for s in tail._segments.values())
                assert part <= R.MAX_LINE_BYTES + (1 << 20), part
            f.write(b'"}\n' + _valid(2))
        got = [r for _, recs in tail.poll() for r in recs]
        assert [r.ts for r in got] == [1_790_000_002.0] and tail.bad.count == 1, (got, tail.bad.warnings)


FAST = textwrap.dedent(
    """
    import json, sys
    from otel_train.analysis.fast import summarize_fast
    from otel_train.analysis.summary import summarize_run
    from otel_train.analysis.spans import load_run
    warnings = []
    if sys.argv[2] == "fast":
        out = summarize_fast(sys.argv[1], warn=warnings.append)
    else:
        out = summarize_run(load_run(sys.argv[1], warn=warnings.append))
    print(json.dumps({"malformed": out["malformed_lines"], "processes": len(out["processes"]),
                      "warnings": len(warnings)}))
    """
)


@pytest.mark.parametrize("shape", ["step-less", "malformed lines", "one huge line"])
def test_fast_never_holds_more_than_a_full_read(tmp_path: Path, shape: str) -> None:
    holds = ("summarize --fast answers (the same malformed count as a full summarize) and its peak RSS stays "
             "within a full summarize's + 25 MB (it used to hold the whole file: 679 MB / 4 GB)")
    with reported(f"summarize --fast on a file with no tail to stand on ({shape})", holds, 1):
        run = tmp_path / "run"
        path = _logs(run)
        with open(path, "wb") as f:
            if shape == "step-less":
                for seq in range(1, 150_001):
                    f.write(_valid(seq, pad=200))
            elif shape == "malformed lines":
                f.write(_valid(1))
                f.write(b"not json at all\n" * 2_000_000)
            else:
                f.write(_valid(1))
                for _ in range(8 * R.MAX_LINE_BYTES >> 20):
                    f.write(b"q" * (1 << 20))
                f.write(b"\n" + _valid(2))
        full, full_rss = _rss_mb_of(FAST, str(run), "full")
        fast, fast_rss = _rss_mb_of(FAST, str(run), "fast")
        assert fast["malformed"] == full["malformed"] and fast["processes"] == full["processes"] == 1, (fast, full)
        assert fast_rss <= full_rss + 25, (fast_rss, full_rss)
        if shape == "one huge line":  # neither read holds it: both as small as a tiny file's
            tiny = tmp_path / "tiny"
            _logs(tiny).write_bytes(_valid(1) + _valid(2))
            _, tiny_rss = _rss_mb_of(FAST, str(tiny), "full")
            assert max(full_rss, fast_rss) <= tiny_rss + 25, (full_rss, fast_rss, tiny_rss)
