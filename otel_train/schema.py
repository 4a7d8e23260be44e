"""Record schema v1 and trace-file naming: the one thing the tracing side and the analysis side share.

Both ``otel_train.exporters`` (writing) and ``otel_train.analysis`` (reading) import their field
names, kinds and file-name rules from here, so neither needs to know the other's internals.
"""

from __future__ import annotations

import hashlib
import os
import re

SCHEMA_VERSION = 1

# Record kinds (the ``kind`` field).
SPAN_START = "span_start"
SPAN_END = "span_end"
INSTANT = "instant"
SCALAR = "scalar"
KINDS = (SPAN_START, SPAN_END, INSTANT, SCALAR)

# Span end statuses (the ``status`` field of span_end records).
STATUS_OK = "ok"
STATUS_ERROR = "error"
STATUS_INCOMPLETE = "incomplete"

# Field names. Values: see the table in docs/schema.md.
V = "v"
TS = "ts"
KIND = "kind"
EVENT = "event"
NAME = "name"
TRACE_ID = "trace_id"
SPAN_ID = "span_id"
PARENT_SPAN_ID = "parent_span_id"
DUR_MS = "dur_ms"
STATUS = "status"
ERROR = "error"
STEP = "step"
RELATIVE_STEP = "relative_step"
EPOCH = "epoch"
ITERATION = "iteration"
TAGS = "tags"
RANK = "rank"
LOCAL_RANK = "local_rank"
WORLD_SIZE = "world_size"
HOST = "host"
PID = "pid"
TID = "tid"
ATTEMPT = "attempt"
JOB_ID = "job_id"
RUN_ID = "run_id"
SOURCE = "source"
SEQ = "seq"
CALLER = "caller"
ATTRS = "attrs"
VALUES = "values"

START_SUFFIX = "_start"
END_SUFFIX = "_end"

# Instants the runtime itself writes.
INSTANT_PROCESS_START = "process_start"
INSTANT_PROCESS_END = "process_end"  # written by shutdown(): its absence means the process died
INSTANT_EXCEPTION = "exception"  # an uncaught exception
INSTANT_HEARTBEAT = "heartbeat"  # the watchdog saw no record for heartbeat_s
INSTANT_STALL = "stall"  # a span passed its stall threshold (with every thread's stack)
INSTANT_PROFILE = "profile"  # a torch.profiler window closed (docs/profiling.md): steps, reason, path
PROFILES_DIR = "profiles"  # <run>/profiles/rank_<r>/...: the windows' Kineto traces
PROFILE_MARKER = "otel_train.profile_marker"  # the record_function a window records as it opens (clock anchor)
INSTANT_CLOCK_STEP = "clock_step"  # the wall clock moved away from the records' clock (docs/clock.md)
INSTANT_SPANS_DROPPED = "otel_train.spans_dropped"
INSTANT_WRITE_ERRORS = "otel_train.write_errors"

# Files.
STRUCTURED_LOGS_DIR = "structured_logs"
FILE_SUFFIX = ".jsonl"
FILE_RE = re.compile(
    r"^(?P<source>.+)\.global_rank_(?P<rank>\d+)\.(?P<stamp>\d{8}-\d{6})-(?P<rand>[0-9A-Za-z]{6})"
    r"\.jsonl(?:\.(?P<segment>\d+))?$"
)


def step_trace_id(run_id: str, step: int, group: int = 0) -> int:
    """The trace id of step ``step`` for the ranks of ``group`` (``rank // trace_group_size``): derived
    from the run id, the step and the group alone, so every rank finds it without talking to another."""
    digest = hashlib.sha256(f"{run_id}\x00{step}\x00{group}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1


def step_anchor_span_id(run_id: str, step: int, attempt: int) -> int:
    """The span id of the step's *anchor*: rank 0's ``step`` span in group 0's trace, which every other
    rank's step span links to (docs/deploy.md, "One step across groups")."""
    digest = hashlib.sha256(f"{run_id}\x00{step}\x00anchor\x00{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") or 1


DIGESTS_DIR = "digests"
DIGEST_SUFFIX = ".digest.json"


def digest_file_name(trace_file: str) -> str:
    """A process's digest, named after its active trace file, in the run's ``digests/`` folder beside
    ``structured_logs/`` (which holds trace files only): ``<run>/digests/….<stamp>-<rand>.digest.json``
    (docs/schema.md, "Digests")."""
    logs, name = os.path.split(trace_file)
    stem = name[: -len(FILE_SUFFIX)] if name.endswith(FILE_SUFFIX) else name
    return os.path.join(os.path.dirname(logs), DIGESTS_DIR, stem + DIGEST_SUFFIX)


def trace_file_name(source: str, rank: int, stamp: str, rand: str) -> str:
    """``<source>.global_rank_<rank>.<YYYYmmdd-HHMMSS>-<6 random>.jsonl`` (the active segment)."""
    return f"{source}.global_rank_{rank}.{stamp}-{rand}{FILE_SUFFIX}"


# OTel resource attribute keys. OTel semantic conventions where they exist, ``training.*`` otherwise.
RES_SERVICE_NAME = "service.name"
RES_HOST = "host.name"
RES_PID = "process.pid"
RES_RANK = "training.rank"
RES_LOCAL_RANK = "training.local_rank"
RES_WORLD_SIZE = "training.world_size"
RES_ATTEMPT = "training.attempt"
RES_JOB_ID = "training.job_id"
RES_RUN_ID = "training.run_id"
RES_SOURCE = "training.source"

# Span attribute keys the SDK itself sets (training context on OTLP spans).
ATTR_INCOMPLETE = "otel_train.incomplete"  # on spans ended by shutdown rather than by their code
ATTR_STEP = "training.step"
ATTR_RELATIVE_STEP = "training.relative_step"
ATTR_EPOCH = "training.epoch"
ATTR_ITERATION = "training.iteration"
ATTR_TAGS = "training.tags"
ATTR_LINK = "otel_train.link"  # on a span link: why it is there ("step_anchor")
LINK_STEP_ANCHOR = "step_anchor"

# Communication (docs/comm.md): every collective and point-to-point op is a span named
# ``comm.<op>``; a ``comm.group`` instant describes each process group once per member process; an
# ``otel_train.mesh`` instant places the rank in the parallel layout (``ot.set_mesh``).
COMM_PREFIX = "comm."
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "barrier",
            "gather", "scatter", "send", "recv")
P2P_OPS = ("send", "recv")
ATTR_COMM_GROUP = "comm.group"  # str: the process group's id, the same in every member's records
ATTR_COMM_SEQ = "comm.seq"  # int: collective_seq_id in the group; for p2p, the k-th send/recv of the pair
ATTR_COMM_PEER = "comm.peer"  # int: the other side's global rank (send/recv)
ATTR_COMM_BYTES = "comm.bytes"  # int
ATTR_COMM_DTYPE = "comm.dtype"  # str
ATTR_COMM_CLOCK = "comm.clock"  # "host" | "device"
COMM_CLOCK_HOST = "host"
COMM_CLOCK_DEVICE = "device"
INSTANT_COMM_GROUP = "comm.group"  # attrs: group, desc, ranks
INSTANT_MESH = "otel_train.mesh"  # attrs: dims {name: size}, coords {name: index}
ATTR_MICROBATCH = "microbatch"  # pipeline compute spans
ATTR_CHUNK = "chunk"  # pipeline virtual stage


def comm_span_name(op: str) -> str:
    """``comm.<op>`` for one of :data:`COMM_OPS`."""
    return COMM_PREFIX + op


def comm_op_of(name: str) -> str | None:
    """The op of a ``comm.*`` span name, None for any other name."""
    return name[len(COMM_PREFIX):] if name.startswith(COMM_PREFIX) and name != INSTANT_COMM_GROUP else None


# PyTorch Flight Recorder's vocabulary, read by the runtime (its in-process buffer, otel_train/comm)
# and by the analysis (dump files, otel_train/analysis/flight_recorder.py): one table for both.
FR_OP_NAMES = {
    "all_reduce": "all_reduce", "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "allreduce_sparse": "all_reduce",
    "all_reduce_barrier": "barrier", "barrier": "barrier",
    "all_gather": "all_gather", "allgather": "all_gather", "_allgather_base": "all_gather",
    "allgather_base": "all_gather", "all_gather_base": "all_gather", "all_gather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "allgather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_coalesced": "reduce_scatter",
    "broadcast": "broadcast", "_broadcast_oop": "broadcast", "reduce": "reduce", "_reduce_oop": "reduce",
    "all_to_all": "all_to_all", "alltoall": "all_to_all", "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all", "all_to_allv": "all_to_all",
    "gather": "gather", "scatter": "scatter", "send": "send", "recv": "recv", "recv_anysource": "recv",
}
"""Flight Recorder op names (after the ``backend:`` prefix, lower case) -> the ``comm.*`` op."""
"""``profiling_name`` op part (``gloo:all_reduce`` → ``all_reduce``), lower-cased -> the ``comm.*`` op."""
FR_ELEMENT_BYTES = {
    "float": ("float32", 4), "double": ("float64", 8), "half": ("float16", 2), "bfloat16": ("bfloat16", 2),
    "long": ("int64", 8), "int": ("int32", 4), "short": ("int16", 2), "char": ("int8", 1),
    "byte": ("uint8", 1), "bool": ("bool", 1), "complexfloat": ("complex64", 8),
    "complexdouble": ("complex128", 16), "complexhalf": ("complex32", 4),
    "float8_e4m3fn": ("float8_e4m3fn", 1), "float8_e5m2": ("float8_e5m2", 1),
    "float8_e4m3fnuz": ("float8_e4m3fnuz", 1), "float8_e5m2fnuz": ("float8_e5m2fnuz", 1),
    "uint16": ("uint16", 2), "uint32": ("uint32", 4), "uint64": ("uint64", 8),
}
"""c10 scalar type names (as dumps spell them, lower-cased) -> (torch dtype name, bytes per element)."""
