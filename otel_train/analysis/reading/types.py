"""The record types every reader decodes a line into: typed and range-checked (docs/schema.md)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec

from otel_train import schema

DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)

MAX_STEP = 2**53
"""Largest step, epoch or iteration a record may carry (the largest integer JSON keeps exact)."""
MAX_TS = 1e11
"""Largest ``ts`` accepted (the year 5138): anything later is a broken clock or a broken line."""
MAX_ID = 2**63 - 1
MAX_DUR_MS = 1e12
FORMAT_OURS = "otel-train"
"""The format of our own files (``Head.format``); :mod:`.titan` names the others."""

Ts = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TS)]
Step = Annotated[int, msgspec.Meta(ge=0, le=MAX_STEP)]
_Relative = Annotated[int, msgspec.Meta(ge=-MAX_STEP, le=MAX_STEP)]
Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]
_Dur = Annotated[float, msgspec.Meta(ge=-MAX_DUR_MS, le=MAX_DUR_MS)]


class Record(msgspec.Struct, tag_field=schema.KIND, gc=False):
    """The fields of a schema-v1 record that readers use, typed and range-checked (docs/schema.md).

    Concrete records are :class:`SpanStart`, :class:`SpanEnd`, :class:`Instant` and :class:`Scalar`,
    chosen by ``kind``; other fields are skipped by the decoder.
    """

    v: int
    ts: Ts
    name: str = ""
    span_id: str | None = None
    parent_span_id: str | None = None
    trace_id: str | None = None
    step: Step | None = None
    relative_step: _Relative | None = None
    epoch: Step | None = None
    iteration: Step | None = None
    tags: list[str] | None = None
    tid: Id | None = None
    attrs: dict[str, Any] | None = None

    kind: ClassVar[str] = ""

    @property
    def event(self) -> str:
        """The ``event`` field as the sink writes it (``<name>_start``, ``<name>_end``, the instant's name)."""
        return self.name or self.kind


_COMM_NUMBERS = (schema.ATTR_COMM_SEQ, schema.ATTR_COMM_BYTES, schema.ATTR_COMM_PEER)


_COMM, _SEQ, _BYTES, _PEER = schema.COMM_PREFIX, schema.ATTR_COMM_SEQ, schema.ATTR_COMM_BYTES, schema.ATTR_COMM_PEER
_N = len(_COMM)


def _comm_in_range(record: Record) -> None:
    """A span's ``__post_init__``: a ``comm.*`` span whose ``comm.seq``, ``comm.bytes`` or ``comm.peer``
    is an integer outside [0, 2**63) is a malformed line (msgspec reports the ValueError as a
    ValidationError): no column can hold it, and no recorder writes it. Measured cost: 0.04 µs a
    line without comm spans, about 0.25 µs a comm span (docs/reliability.md, round 4)."""
    attrs = record.attrs
    if not attrs or _SEQ not in attrs or record.name[:_N] != _COMM:
        return
    seq, size, peer = attrs[_SEQ], attrs.get(_BYTES, 0), attrs.get(_PEER, 0)
    if type(seq) is int and type(size) is int and type(peer) is int and not (seq | size | peer) >> 63:
        return  # all three in [0, 2**63): the common case, one test
    for key in _COMM_NUMBERS:
        value = attrs.get(key)
        if type(value) is int and not 0 <= value <= MAX_ID:
            raise ValueError(f"{key} out of range [0, 2**63)")


class SpanStart(Record, tag=schema.SPAN_START):
    """A span began."""

    kind: ClassVar[str] = schema.SPAN_START

    __post_init__ = _comm_in_range

    @property
    def event(self) -> str:
        return self.name + schema.START_SUFFIX


class SpanEnd(Record, tag=schema.SPAN_END):
    """A span ended: ``dur_ms``, ``status`` (ok, error, incomplete) and ``error`` when it raised."""

    dur_ms: _Dur | None = None
    status: str | None = None
    error: dict[str, Any] | None = None

    kind: ClassVar[str] = schema.SPAN_END

    __post_init__ = _comm_in_range

    @property
    def event(self) -> str:
        return self.name + schema.END_SUFFIX

    def began(self) -> float:
        """When the span began by this record alone: ``dur_ms`` before its end, never before 1970 (a
        hostile duration would give a time no OTLP or Perfetto field can hold)."""
        return max(0.0, self.ts - (self.dur_ms or 0.0) / 1000.0)


class Instant(Record, tag=schema.INSTANT):
    """A point event (the runtime's own: process_start/end, exception, heartbeat, stall, ...)."""

    kind: ClassVar[str] = schema.INSTANT


class Scalar(Record, tag=schema.SCALAR):
    """Numeric values at a point in time."""

    values: dict[str, Any] | None = None

    kind: ClassVar[str] = schema.SCALAR


AnyRecord = SpanStart | SpanEnd | Instant | Scalar
RECORD_TYPES = AnyRecord
"""What every reader decodes a line into."""


class Head(msgspec.Struct, gc=False):
    """Who wrote a file: the identity fields of its first records (see :func:`head`)."""

    ts: Ts
    attempt: Annotated[int, msgspec.Meta(ge=0, le=MAX_STEP)] | None = None
    host: str | None = None
    pid: Id | None = None
    local_rank: Step | None = None
    world_size: Step | None = None
    run_id: str | None = None
    job_id: str | None = None
    step: Step | None = None  # the first step the process recorded
    format: str = FORMAT_OURS  # whose files: ours, or torchtitan's or pimm's structured logger (.titan)


RECORD_DECODER = msgspec.json.Decoder(RECORD_TYPES)
"""The one decoder of a record line."""
