"""Per-process digests: what ``summarize --fast`` needs that a file's tail cannot give, in a small file.

Each process keeps ``<run>/digests/<its active trace file's name>.digest.json`` (docs/schema.md,
"Digests"), written by the watchdog's thread every ``digest_s`` seconds while the file grows and once at
shutdown: the per-name duration sketch (``otel_train.sketch``: counts, ±1 % quantiles, mergeable
across ranks), and, taken at one instant under the write lock, the record count, the file's inode and
size, and every open span. With the records after that size a reader knows every span open at the
end, however long ago it began (docs/analysis.md, "Fast summarize and digests"). Written to a temporary file and renamed
into place, so a kill mid-write leaves the previous digest whole; the temporary's name is random and it is
made ``O_EXCL | O_NOFOLLOW``, so a link planted in the directory is never written through.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Any

import msgspec

from otel_train import _modes, _report
from otel_train.record_clock import now_ns
from otel_train import schema as S
from otel_train.exporters.jsonl.processor import JsonlSpanProcessor
from otel_train.sketch import GAMMA

DIGEST_VERSION = 1

_encode = msgspec.json.Encoder().encode


class DigestWriter:
    """Writes one process's digest: :meth:`maybe` on the watchdog's looks, :meth:`write` at shutdown."""

    def __init__(self, trace_file: str, every_s: float) -> None:
        self.path = S.digest_file_name(trace_file)
        self._every_s = every_s
        self._last = time.monotonic()
        self._last_seq = -1

    def maybe(self, sink: JsonlSpanProcessor, sketch: Any) -> None:
        """Write when ``every_s`` passed since the last digest and records were written since."""
        now = time.monotonic()
        if now - self._last >= self._every_s and sink.records_written != self._last_seq:
            self.write(sink, sketch)

    def write(self, sink: JsonlSpanProcessor, sketch: Any) -> None:
        """Write the digest now, with ``sketch.snapshot()`` as its phases (never raises: a failure is
        reported once and counted)."""
        self._last = time.monotonic()
        try:
            point = sink.digest_point()
            if point is None:
                return
            seq, (ino, size), entries = point
            body = {
                "v": DIGEST_VERSION, "ts": now_ns() / 1e9, "seq": seq, "file": {"ino": ino, "size": size},
                "open": [_open_span(*entry) for entry in entries],
                "gamma": GAMMA, "phases": sketch.snapshot(),
            }
            _modes.make_dirs(os.path.dirname(self.path))  # made here: the run dir may be re-created
            self._replace(_encode(body))
            self._last_seq = seq
        except Exception as exc:  # a digest is an aid to readers: never a reason to stop training
            _report.report_exception("writing the digest", exc)


    def _replace(self, data: bytes) -> None:
        # A new temporary each time, with a name nobody can guess, made O_EXCL | O_NOFOLLOW: a link
        # planted in the directory is never opened, and the rename replaces a link at the digest's own
        # name instead of writing through it.
        tmp = os.path.join(os.path.dirname(self.path), f".{os.path.basename(self.path)}.{secrets.token_hex(8)}.tmp")
        fd = _modes.create(tmp, os.O_WRONLY | os.O_EXCL | os.O_NOFOLLOW)  # 0644 at most, whatever the umask
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


def _us(ns: int) -> float:
    # The same float the span's start record holds: its ts is written as whole microseconds.
    return float(f"{ns // 1_000_000_000}.{ns // 1000 % 1_000_000:06d}")


def _open_span(span: Any, body: str, state: Any, tid: int) -> dict[str, Any]:
    ctx, parent = span._context, span._parent
    return {
        S.SPAN_ID: f"{ctx.span_id:016x}",
        S.NAME: span._name,
        S.PARENT_SPAN_ID: f"{parent.span_id:016x}" if parent is not None else None,
        S.TRACE_ID: f"{ctx.trace_id:032x}",
        S.STEP: state.step,
        "start_ts": _us(span._start_time),
        S.TID: tid,
    }
