"""Trace files to validated records: discovery, safe opening, one decoder, one bad-line rule.

The code lives in :mod:`otel_train.analysis.reading`, one module per job; this module re-exports
its public names so that every reader imports them from one place.

Every reader (whole files for summarize, stats, export and push; growing files for ``watch`` and
``push --follow``) decodes lines with the same typed decoder (:data:`RECORD_TYPES`) and the same
rule (:class:`BadLines`): a line that is not a schema-v1 record (torn, garbage, binary, too deeply
nested, or a field of the wrong type or out of range: docs/schema.md) is skipped, counted, and
reported once per file as ``file:line``.
"""

from __future__ import annotations

from otel_train.analysis.reading.digests import (
    Digest,
    DigestFile,
    DigestPhase,
    DigestSpan,
    ended_since,
    read_digest,
)
from otel_train.analysis.reading.discovery import (
    ProcessFiles,
    TraceReadError,
    Warn,
    find_process_files,
    logs_dir,
    open_regular,
    scan_process_files,
    warn_to_stderr,
)
from otel_train.analysis.reading.lines import MAX_LINE_BYTES, BadLines, decode_chunk
from otel_train.analysis.reading.tails import Tail
from otel_train.analysis.reading.types import (
    FORMAT_OURS,
    MAX_STEP,
    MAX_TS,
    RECORD_TYPES,
    AnyRecord,
    Head,
    Instant,
    Record,
    Scalar,
    SpanEnd,
    SpanStart,
)
from otel_train.analysis.reading.whole import Reader, head, line_number, peek, read_tail

__all__ = [
    "FORMAT_OURS", "MAX_LINE_BYTES", "MAX_STEP", "MAX_TS", "RECORD_TYPES", "AnyRecord", "BadLines", "Digest", "DigestFile",
    "DigestPhase", "DigestSpan", "Head", "Instant", "ProcessFiles", "Reader", "Record", "Scalar", "SpanEnd",
    "SpanStart", "Tail", "TraceReadError", "Warn", "decode_chunk", "ended_since", "find_process_files", "head",
    "line_number", "logs_dir", "open_regular", "peek", "read_digest", "read_tail", "scan_process_files",
    "warn_to_stderr",
]
