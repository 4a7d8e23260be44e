"""3-D parallel training jobs (DP x PP x TP) simulated event by event, written as our trace files, with
injected causes of known cost and the ground truth the what-if has to find (docs/analysis.md
"Simulator: what-if ground truth").

A job is ``dp`` pipeline replicas of ``pp`` stages, each stage ``tp`` ranks (global rank
``(pp_i * dp + dp_i) * tp + tp_i``: tensor parallel fastest, then data parallel, Megatron's order;
8 ranks a host). Every step each rank runs its stage's pipeline schedule (``gpipe``, ``1f1b`` or
``interleaved`` 1F1B with ``chunks`` model chunks a rank) over ``microbatches``, then the data-parallel
gradient collective (``all_reduce``, or ``reduce_scatter`` + ``all_gather`` around the optimizer with
``zero=True``) and the optimizer. The simulation is of the schedule itself:

* a compute op (``forward`` / ``backward`` of one microbatch and chunk) lasts its duration; with
  ``tp > 1`` it is cut into segments, each followed by a tensor-parallel ``all_reduce`` (a child of the
  compute span, as the recorder writes it);
* a collective ends for every member ``transfer`` ms after the last member arrived;
* a ``send`` is eager: it lasts the link time of its pair and never waits for the receiver; a ``recv``
  ends ``recv_ms`` after both it was posted and its send ended. The k-th send from A to B is the k-th
  recv on B from A (``comm.seq``), which the simulation checks message by message.

Causes (:class:`Cause`) and the ground truth (:class:`Truth`): the same job is simulated again
without the cause (same jitter, same everything else); ``slowdown`` = actual mean step / that mean
step, the step being the job's (the last rank's end of step k minus its end of step k-1). ``top`` is
what the what-if must name: the slow worker's rank, ``"last_stage"``, ``"everyone"`` (sequence-length
imbalance), the slow link's pair (sorted), or the slow collective's span name (``comm.all_reduce``).

    truth = write_job(tmp_path / "run", dp=2, pp=4, tp=2, steps=4, microbatches=8,
                      schedule="1f1b", cause="worker", seed=1)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from analysis_fixtures import Proc
from comm_sim import comm_attrs

from otel_train import schema
from otel_train.phases import BACKWARD, FORWARD, OPTIMIZER, STEP

SCHEDULES = ("gpipe", "1f1b", "interleaved")
CAUSES = ("worker", "last_stage", "seqlen", "link", "collective")
RANKS_PER_HOST = 8
EVERYONE = "everyone"
LAST_STAGE = "last_stage"


@dataclass(frozen=True)
class Layout:
    """Who is where: dims, the schedule, and the rank order (tp fastest, then dp, then pp)."""

    dp: int
    pp: int
    tp: int
    microbatches: int
    schedule: str
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if min(self.dp, self.pp, self.tp, self.microbatches, self.chunks) < 1:
            raise ValueError("dp, pp, tp, microbatches and chunks must be >= 1")
        if self.schedule == "interleaved":
            # With 2 stages both directions of a pair would carry activations and gradients, whose
            # orders differ; Megatron also wants the microbatches in whole rounds of pp.
            if self.pp < 3 or self.chunks < 2 or self.microbatches % self.pp:
                raise ValueError("interleaved needs pp >= 3, chunks >= 2 and microbatches a multiple of pp")
        elif self.chunks != 1:
            raise ValueError("chunks > 1 only with the interleaved schedule")

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def virtual(self) -> int:
        """Virtual pipeline stages: ``chunks * pp`` (chunk c of stage s is virtual stage c*pp + s)."""
        return self.chunks * self.pp

    def rank(self, dp_i: int, pp_i: int, tp_i: int) -> int:
        return (pp_i * self.dp + dp_i) * self.tp + tp_i

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) index of ``rank``."""
        tp_i = rank % self.tp
        rest = rank // self.tp
        return rest % self.dp, rest // self.dp, tp_i


@dataclass(frozen=True)
class Costs:
    """ms of each op at nominal speed (forward/backward: one microbatch through a whole stage, shared
    by its chunks), the collectives' transfer times and sizes, and the compute jitter (relative sd)."""

    forward_ms: float = 4.0
    backward_ms: float = 8.0
    optimizer_ms: float = 3.0
    tp_segments: int = 2
    tp_ms: float = 0.2
    link_ms: float = 0.3
    recv_ms: float = 0.02
    dp_ms: float = 6.0
    jitter: float = 0.005
    act_bytes: int = 4 << 20
    grad_bytes: int = 64 << 20


@dataclass(frozen=True)
class Cause:
    """An injected cause. ``kind`` one of :data:`CAUSES`; ``factor`` how much slower what it touches is.

    * ``worker``: every compute op of ``rank`` (default: drawn from ``seed``) ``factor`` x slower;
    * ``last_stage``: the last virtual stage's forward/backward ``factor`` x the others' (the clean job
      has the same total work spread evenly: every stage at the mean);
    * ``seqlen``: each microbatch of a replica has its own length (lognormal, sd ``spread``, mean 1 per
      step), its forward/backward durations in proportion; clean: every microbatch of length 1;
    * ``link``: both directions of the p2p pair ``pair`` (default: drawn) take ``factor`` x the link time;
    * ``collective``: the data-parallel ``op`` (``all_reduce``, ``reduce_scatter``, ``all_gather``)
      takes ``factor`` x its transfer on a drawn ``fraction`` of the steps (congestion comes and goes;
      a collective slow at every step *is* its typical speed).
    """

    kind: str
    factor: float = 1.5
    rank: int | None = None
    pair: tuple[int, int] | None = None
    op: str = "all_reduce"
    fraction: float = 0.34
    spread: float = 0.3

    def __post_init__(self) -> None:
        if self.kind not in CAUSES:
            raise ValueError(f"cause must be one of {CAUSES}, got {self.kind!r}")


DEFAULT_FACTORS = {"worker": 1.5, "last_stage": 1.5, "seqlen": 1.0, "link": 10.0, "collective": 5.0}


def make_cause(cause: str | Cause | None) -> Cause | None:
    if cause is None or isinstance(cause, Cause):
        return cause
    return Cause(cause, factor=DEFAULT_FACTORS.get(cause, 1.5))


@dataclass
class Truth:
    """What the generated job is, and what the what-if should find."""

    layout: Layout
    cause: Cause | None
    steps: int
    actual_ms: float
    ideal_ms: float
    slowdown: float
    top: Any
    step_ms: list[float] = field(default_factory=list)
    clean_step_ms: list[float] = field(default_factory=list)
    plan: Plan | None = field(default=None, repr=False)
    zero: bool = False
    moved: int = 0  # comm ops written with device-stream overlaps (Recording.overlap)

    def definition(self, steps: Iterable[int] | None = None) -> float:
        """S as the contract defines the ``typical`` ideal, computed exactly in the simulator: every
        compute op at the mean of its name over all ranks and steps, every comm op at its nominal
        (median) transfer. What an exact implementation would answer: its distance from
        :attr:`slowdown` is the definition's, not the implementation's."""
        assert self.plan is not None
        ideal = run_steps(TypicalPlan(self.plan), make_groups(self.layout), False, self.zero)
        keep = sorted({int(k) for k in steps}) if steps is not None else list(range(self.steps))
        return float(np.mean([self.step_ms[k] for k in keep]) / np.mean([ideal[k] for k in keep]))

    def over(self, steps: Iterable[int]) -> float:
        """The true slowdown over some of the steps (e.g. those a what-if could time: the first step
        of a window only anchors the next)."""
        keep = sorted({int(k) for k in steps})
        return float(np.mean([self.step_ms[k] for k in keep]) / np.mean([self.clean_step_ms[k] for k in keep]))


# ---------------------------------------------------------------------------------------------
# Schedules: the order of (kind, microbatch, chunk) units on one pipeline stage


def schedule_units(layout: Layout, stage: int) -> list[tuple[str, int, int]]:
    """The compute units of one step on ``stage``, in order: ("F"|"B", microbatch, chunk)."""
    m, p = layout.microbatches, layout.pp
    if layout.schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if layout.schedule == "1f1b":
        warm = min(p - stage - 1, m)
        units = [("F", i, 0) for i in range(warm)]
        for i in range(m - warm):
            units += [("F", warm + i, 0), ("B", i, 0)]
        return units + [("B", i, 0) for i in range(m - warm, m)]
    return _interleaved(layout, stage)


def _interleaved(layout: Layout, stage: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B: forward unit k is chunk (k // pp) % v of microbatch
    (k // (pp v)) pp + k % pp, backward units the same with the chunks reversed."""
    m, p, v = layout.microbatches, layout.pp, layout.chunks
    total = m * v

    def unit(kind: str, k: int) -> tuple[str, int, int]:
        chunk = (k // p) % v
        return kind, (k // (p * v)) * p + k % p, (v - 1 - chunk if kind == "B" else chunk)

    warm = total if m == p else min(total, (p - stage - 1) * 2 + (v - 1) * p)
    units = [unit("F", k) for k in range(warm)]
    for k in range(total - warm):
        units += [unit("F", warm + k), unit("B", k)]
    return units + [unit("B", k) for k in range(total - warm, total)]


# ---------------------------------------------------------------------------------------------
# Programs: each rank's ops, in order


@dataclass(frozen=True)
class Groups:
    """Process groups: id -> (desc, members); per rank its tp / dp / pp group ids."""

    members: dict[str, tuple[str, list[int]]]
    tp: dict[int, str]
    dp: dict[int, str]
    pp: dict[int, str]


def make_groups(layout: Layout) -> Groups:
    members: dict[str, tuple[str, list[int]]] = {"0": ("default_pg", list(range(layout.world)))}
    of: dict[str, dict[int, str]] = {"tp": {}, "dp": {}, "pp": {}}
    lanes = {
        "tp": [[layout.rank(d, p, t) for t in range(layout.tp)] for p in range(layout.pp) for d in range(layout.dp)],
        "dp": [[layout.rank(d, p, t) for d in range(layout.dp)] for p in range(layout.pp) for t in range(layout.tp)],
        "pp": [[layout.rank(d, p, t) for p in range(layout.pp)] for d in range(layout.dp) for t in range(layout.tp)],
    }
    for desc, groups in lanes.items():
        for ranks in groups:
            if len(ranks) < 2:
                continue
            gid = str(len(members))
            members[gid] = (desc, ranks)
            for r in ranks:
                of[desc][r] = gid
    return Groups(members, of["tp"], of["dp"], of["pp"])


class Plan:
    """Durations of every op, with and without the cause; the jitter and the lengths are drawn once
    from ``seed``, so the job and its clean twin differ only by the cause."""

    def __init__(self, layout: Layout, steps: int, costs: Costs, cause: Cause | None, seed: int) -> None:
        self.layout, self.steps, self.costs, self.cause = layout, steps, costs, cause
        rng = np.random.default_rng([seed, 0])
        units = 2 * layout.microbatches * layout.chunks
        self.jitter = 1.0 + costs.jitter * rng.standard_normal((layout.world, steps, units + 1))
        lengths = np.ones((steps, layout.dp, layout.microbatches))
        if cause is not None and cause.kind == "seqlen":
            raw = np.random.default_rng([seed, 1]).lognormal(0.0, cause.spread, lengths.shape)
            lengths = raw / raw.mean(axis=(1, 2), keepdims=True)
        self.lengths = lengths
        picks = np.random.default_rng([seed, 2])
        # Never step 0 alone: a what-if times a step from the end of the one before (step 0 anchors).
        later = max(steps - 1, 1)
        n_slow = max(1, round((cause.fraction if cause else 0.0) * later))
        self.slow_steps = set((1 + picks.choice(later, size=min(n_slow, later), replace=False)).tolist())
        self.slow_rank = cause.rank if cause and cause.rank is not None else int(picks.integers(layout.world))
        self.slow_pair = self._pair(picks) if cause and cause.kind == "link" else None

    def _pair(self, picks: np.random.Generator) -> tuple[int, int]:
        if self.cause is not None and self.cause.pair is not None:
            return tuple(sorted(self.cause.pair))  # type: ignore[return-value]
        lo = self.layout
        if lo.pp < 2:
            raise ValueError("a slow link needs pp >= 2")
        d, t, s = int(picks.integers(lo.dp)), int(picks.integers(lo.tp)), int(picks.integers(lo.pp - 1))
        return lo.rank(d, s, t), lo.rank(d, s + 1, t)

    def active(self, clean: bool) -> Cause | None:
        return None if clean else self.cause

    def compute(self, rank: int, step: int, unit: int, kind: str, mb: int, chunk: int, clean: bool) -> float:
        lo, c = self.layout, self.costs
        dp_i, pp_i, _ = lo.coords(rank)
        ms = (c.forward_ms if kind == "F" else c.backward_ms) / lo.chunks
        ms *= float(self.jitter[rank, step, unit])
        cause = self.active(clean)
        if cause is None or cause.kind == "seqlen":
            return ms * (float(self.lengths[step, dp_i, mb]) if cause else 1.0)
        if cause.kind == "worker" and rank == self.slow_rank:
            return ms * cause.factor
        if cause.kind == "last_stage":
            last = chunk * lo.pp + pp_i == lo.virtual - 1
            return ms * (cause.factor if last else 1.0)
        return ms

    def balanced(self, ms: float) -> float:
        """The clean twin of a stage imbalance: every virtual stage at the mean."""
        cause = self.cause
        if cause is None or cause.kind != "last_stage":
            return ms
        return ms * (1.0 + (cause.factor - 1.0) / self.layout.virtual)

    def optimizer(self, rank: int, step: int, clean: bool) -> float:
        ms = self.costs.optimizer_ms * float(self.jitter[rank, step, -1])
        cause = self.active(clean)
        return ms * cause.factor if cause and cause.kind == "worker" and rank == self.slow_rank else ms

    def link(self, src: int, dst: int, clean: bool) -> float:
        cause = self.active(clean)
        slow = cause is not None and cause.kind == "link" and tuple(sorted((src, dst))) == self.slow_pair
        return self.costs.link_ms * (cause.factor if slow else 1.0)  # type: ignore[union-attr]

    def dp_transfer(self, op: str, step: int, clean: bool, zero: bool) -> float:
        ms = self.costs.dp_ms / (2.0 if zero else 1.0)
        cause = self.active(clean)
        if cause is not None and cause.kind == "collective" and cause.op == op and step in self.slow_steps:
            return ms * cause.factor
        return ms


class TypicalPlan(Plan):
    """A plan's job with every op made typical the contract's way (see :meth:`Truth.definition`)."""

    def __init__(self, plan: Plan) -> None:  # noqa: D107 - shares the plan's draws
        self.__dict__.update(plan.__dict__)
        lo, sums = plan.layout, {"F": [], "B": []}
        for rank in range(lo.world):
            units = schedule_units(lo, lo.coords(rank)[1])
            for step in range(plan.steps):
                for u, (kind, mb, chunk) in enumerate(units):
                    sums[kind].append(plan.compute(rank, step, u, kind, mb, chunk, False))
        self.means = {k: float(np.mean(v)) for k, v in sums.items()}
        self.opt_mean = float(np.mean([plan.optimizer(r, s, False) for r in range(lo.world)
                                       for s in range(plan.steps)]))

    def compute(self, rank: int, step: int, unit: int, kind: str, mb: int, chunk: int, clean: bool) -> float:
        return self.means[kind]

    def optimizer(self, rank: int, step: int, clean: bool) -> float:
        return self.opt_mean

    def link(self, src: int, dst: int, clean: bool) -> float:
        return Plan.link(self, src, dst, True)

    def dp_transfer(self, op: str, step: int, clean: bool, zero: bool) -> float:
        return Plan.dp_transfer(self, op, step, True, zero)


def step_program(plan: Plan, groups: Groups, rank: int, step: int, clean: bool, zero: bool,
                 seqs: dict[Any, int]) -> list[tuple]:
    """Rank ``rank``'s ops in ``step``: ("step", k), ("open", name, attrs), ("work", ms), ("close",),
    ("send", peer, group, nbytes, ms, seq, key), ("recv", peer, group, nbytes, ms, seq, key),
    ("coll", op, group, nbytes, ms, seq). ``seqs`` (the rank's group and pair counters) carries
    ``comm.seq`` from one step to the next."""
    lo, c = plan.layout, plan.costs
    dp_i, pp_i, tp_i = lo.coords(rank)

    def next_seq(key: Any) -> int:
        seqs[key] = seqs.get(key, -1) + 1
        return seqs[key]

    def coll(op: str, gid: str | None, nbytes: int, ms: float) -> list[tuple]:
        return [] if gid is None else [("coll", op, gid, nbytes, ms, next_seq(gid))]

    def neighbour(vs: int) -> int:
        return lo.rank(dp_i, vs % lo.pp, tp_i)

    prog: list[tuple] = [("step", step)]
    for u, (kind, mb, chunk) in enumerate(schedule_units(lo, pp_i)):
        vs = chunk * lo.pp + pp_i
        src = vs - 1 if kind == "F" else vs + 1  # where the input comes from
        dst = vs + 1 if kind == "F" else vs - 1  # where the output goes
        if 0 <= src < lo.virtual:
            peer = neighbour(src)
            prog.append(("recv", peer, groups.pp[rank], c.act_bytes, c.recv_ms, next_seq(("r", peer)), (kind, mb, vs)))
        ms = plan.compute(rank, step, u, kind, mb, chunk, clean)
        ms = plan.balanced(ms) if clean else ms
        attrs = {schema.ATTR_MICROBATCH: mb, "stage": vs}
        if lo.chunks > 1:
            attrs[schema.ATTR_CHUNK] = chunk
        prog.append(("open", FORWARD if kind == "F" else BACKWARD, attrs))
        segments = c.tp_segments if lo.tp > 1 else 1
        for _ in range(segments):
            prog.append(("work", ms / segments))
            prog += coll("all_reduce", groups.tp.get(rank), c.act_bytes, c.tp_ms)
        prog.append(("close",))
        if 0 <= dst < lo.virtual:
            peer = neighbour(dst)
            prog.append(("send", peer, groups.pp[rank], c.act_bytes, plan.link(rank, peer, clean),
                         next_seq(("s", peer)), (kind, mb, dst)))
    dp_gid = groups.dp.get(rank)
    first = "reduce_scatter" if zero else "all_reduce"
    prog += coll(first, dp_gid, c.grad_bytes, plan.dp_transfer(first, step, clean, zero))
    prog += [("open", OPTIMIZER, {}), ("work", plan.optimizer(rank, step, clean)), ("close",)]
    if zero:
        prog += coll("all_gather", dp_gid, c.grad_bytes, plan.dp_transfer("all_gather", step, clean, zero))
    prog.append(("close",))
    return prog


def build_program(plan: Plan, groups: Groups, rank: int, clean: bool, zero: bool) -> list[tuple]:
    """Rank ``rank``'s ops for every step (:func:`step_program`, one after another)."""
    seqs: dict[Any, int] = {}
    return [op for step in range(plan.steps) for op in step_program(plan, groups, rank, step, clean, zero, seqs)]


# ---------------------------------------------------------------------------------------------
# The discrete-event simulation


class Deadlock(RuntimeError):
    """No rank can make progress: the schedule's sends and recvs do not match."""


class Simulation:
    """Runs every rank's program against the others'; ``events[rank]`` is its timeline:
    ("step", k, t), ("open", t, name, attrs), ("close", t)."""

    def __init__(self, programs: list[list[tuple]], groups: Groups, start: list[float] | None = None,
                 outside: bool = False) -> None:
        self.programs, self.groups, self.outside = programs, groups, outside
        n = len(programs)
        self.pc, self.now = [0] * n, list(start) if start is not None else [0.0] * n
        self.events: list[list[tuple]] = [[] for _ in range(n)]
        self.sent: dict[tuple[int, int, int], tuple[float, Any]] = {}
        self.arrivals: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
        self.done: dict[tuple[str, int], float] = {}

    def run(self) -> Simulation:
        pending = set(range(len(self.programs)))
        while pending:
            moved = [r for r in sorted(pending) if self._advance(r)]
            pending = {r for r in pending if self.pc[r] < len(self.programs[r])}
            if pending and not moved:
                stuck = {r: self.programs[r][self.pc[r]] for r in sorted(pending)[:4]}
                raise Deadlock(f"no rank can move; first stuck ops: {stuck}")
        return self

    def _advance(self, r: int) -> bool:
        prog, ev, moved = self.programs[r], self.events[r], False
        while self.pc[r] < len(prog):
            op, t = prog[self.pc[r]], self.now[r]
            kind = op[0]
            if kind == "work":
                self.now[r] = t + op[1]
            elif kind == "open":
                ev.append(("open", t, op[1], op[2]))
            elif kind == "close":
                ev.append(("close", t))
            elif kind == "step":
                ev.append(("step", op[1], t))
            elif kind == "send":
                end = t + op[4]
                self.sent[(r, op[1], op[5])] = (end, op[6])
                self._comm(r, "send", op[2], op[5], op[3], t, end, peer=op[1])
            elif kind == "recv":
                got = self.sent.get((op[1], r, op[5]))
                if got is None:
                    return moved
                if got[1] != op[6]:
                    raise Deadlock(f"rank {r}: recv {op[5]} from {op[1]} expects {op[6]}, the send was {got[1]}")
                self._comm(r, "recv", op[2], op[5], op[3], t, max(t, got[0]) + op[4], peer=op[1])
            elif not self._collective(r, op, t):
                return moved
            self.pc[r] += 1
            moved = True
        return moved

    def _collective(self, r: int, op: tuple, t: float) -> bool:
        _, name, gid, nbytes, ms, seq = op
        key = (gid, seq)
        arrived = self.arrivals[key]
        arrived.setdefault(r, t)
        if key not in self.done:
            if len(arrived) < len(self.groups.members[gid][1]):
                return False
            self.done[key] = max(arrived.values()) + ms
        # Recording.waits_outside: a data-parallel op's span begins at the last arrival (the wait is untraced).
        begin = max(arrived.values()) if self.outside and self.groups.members[gid][0] == "dp" else arrived[r]
        self._comm(r, name, gid, seq, nbytes, begin, self.done[key])
        return True

    def _comm(self, r: int, op: str, gid: str, seq: int, nbytes: int, start: float, end: float,
              peer: int | None = None) -> None:
        attrs = comm_attrs(gid, seq, nbytes, "bfloat16", peer)
        self.events[r].append(("open", start, schema.comm_span_name(op), attrs))
        self.events[r].append(("close", end))
        self.now[r] = end

    def step_times(self) -> list[float]:
        """The job's step times: the last rank's end of step k minus its end of step k-1."""
        last = np.max(np.array([self._step_ends(r) for r in range(len(self.events))]), axis=0)
        return np.diff(np.concatenate([[0.0], last])).tolist()

    def _step_ends(self, r: int) -> list[float]:
        """When each step span of rank ``r`` closed (its last close before the next step)."""
        ends, depth = [], 0
        for e in self.events[r]:
            if e[0] == "step":
                depth = 1
            elif e[0] == "open":
                depth += 1
            elif e[0] == "close":
                depth -= 1
                if depth == 0:
                    ends.append(e[1])
        return ends


# ---------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class Recording:
    """How the job's records are written (the job itself, and its truth, are the same either way):

    * ``untraced_recv``: no ``comm.recv`` span: a recv that waits for its send is untraced time that
      ends when the send ends (plus the recv's own ``recv_ms``), an idle wait on an untraced dependency;
    * ``waits_outside``: a data-parallel collective's span begins when its last member arrived (as where
      the backend's timing starts then): the members' waiting is untraced time that ends when the last
      member's op before it ended;
    * ``overlap``: the share of comm ops written with device-stream times: one followed at once by a
      compute span ends 3-15 us after that span began; one that follows another comm op at once begins
      up to 0.14 ms before that op ended (CUDA events on several streams);
    * ``device_clock``: every comm span says ``comm.clock: device``.
    """

    untraced_recv: bool = False
    waits_outside: bool = False
    overlap: float = 0.0
    device_clock: bool = False
    seed: int = 0


def device_stream(timeline: list[tuple], rng: np.random.Generator, share: float) -> tuple[list[tuple], int]:
    """One rank's timeline with device-stream overlaps (:class:`Recording` ``overlap``); how many ops moved
    (each by 3 us at least: more than the records' resolution)."""
    out, moved = list(timeline), set()
    for i in range(len(out) - 2):
        e, close, nxt = out[i], out[i + 1], out[i + 2]
        if e[0] != "open" or not e[2].startswith(schema.COMM_PREFIX) or close[0] != "close":
            continue
        if nxt[0] == "open" and not nxt[2].startswith(schema.COMM_PREFIX) and abs(nxt[1] - close[1]) < 1e-9 \
                and rng.random() < share:
            out[i + 1] = ("close", close[1] + rng.uniform(0.003, 0.015))
            moved.add(i)
        prev = out[i - 1] if i >= 2 else None
        if prev is not None and prev[0] == "close" and out[i - 2][0] == "open" and \
                out[i - 2][2].startswith(schema.COMM_PREFIX) and abs(e[1] - prev[1]) < 1e-9 and rng.random() < share:
            early = min(rng.uniform(0.003, 0.14), 0.9 * (prev[1] - out[i - 2][1]))
            out[i] = ("open", e[1] - early, e[2], e[3])
            moved.add(i)
    return out, len(moved)


def recorded(timeline: list[tuple], rec: Recording) -> list[tuple]:
    """A rank's timeline as :class:`Recording` ``rec`` writes it (untraced recvs dropped, device clock)."""
    out, skip = [], False
    for e in timeline:
        if skip:
            skip = False
            continue
        if e[0] == "open" and rec.untraced_recv and e[2] == schema.comm_span_name("recv"):
            skip = True
            continue
        if e[0] == "open" and rec.device_clock and e[2].startswith(schema.COMM_PREFIX):
            e = (*e[:3], {**e[3], schema.ATTR_COMM_CLOCK: schema.COMM_CLOCK_DEVICE})
        out.append(e)
    return out


class _Proc(Proc):
    """:class:`analysis_fixtures.Proc`, encoding with msgspec (the same compact JSON, faster: benchmarks
    write millions of records)."""

    def _emit(self, rec: dict) -> None:
        self.lines.append(_encode(rec).decode())


_encode = msgspec.json.Encoder().encode


class RecordSink:
    """The trace files of a simulated job, written step by step (memory holds one step's records):
    what each rank's runtime would have written, one file per rank, 8 ranks a host."""

    def __init__(self, run_dir: Path, layout: Layout, groups: Groups, recording: Recording = Recording()) -> None:
        self.recording, self.moved = recording, 0
        self.rng = np.random.default_rng([recording.seed, 3])
        self.logs = Path(run_dir) / schema.STRUCTURED_LOGS_DIR
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs = []
        for rank in range(layout.world):
            p = _Proc(rank=rank, world_size=layout.world, host=f"node{rank // RANKS_PER_HOST}")
            dp_i, pp_i, tp_i = layout.coords(rank)
            for gid, (desc, ranks) in groups.members.items():
                if rank in ranks:
                    p.instant(schema.INSTANT_COMM_GROUP, group=gid, desc=desc, ranks=ranks)
            p.instant(schema.INSTANT_MESH, dims={"pp": layout.pp, "dp": layout.dp, "tp": layout.tp},
                      coords={"pp": pp_i, "dp": dp_i, "tp": tp_i})
            self.procs.append(p)
        self.files = [open(self.logs / p.file_name, "w", encoding="utf-8") for p in self.procs]  # noqa: SIM115

    def write(self, events: list[list[tuple]]) -> None:
        """One step's timelines (:class:`Simulation` ``events``), as records."""
        for p, timeline in zip(self.procs, events):
            if self.recording.overlap:
                timeline, moved = device_stream(timeline, self.rng, self.recording.overlap)
                self.moved += moved
            for e in recorded(timeline, self.recording):
                if e[0] == "step":
                    p.now_ms = e[2]
                    p.set_step(e[1])
                    p.start(STEP)
                elif e[0] == "open":
                    p.now_ms = e[1]
                    p.start(e[2], **e[3])
                else:
                    p.now_ms = e[1]
                    p.end()
        self._flush()

    def close(self) -> Path:
        for p in self.procs:
            p.shutdown()
        self._flush()
        for f in self.files:
            f.close()
        return self.logs

    def _flush(self) -> None:
        for p, f in zip(self.procs, self.files):
            if p.lines:
                f.write("\n".join(p.lines) + "\n")
                p.lines.clear()


def run_steps(plan: Plan, groups: Groups, clean: bool, zero: bool, sink: RecordSink | None = None) -> list[float]:
    """Simulate the job step by step (every rank starts step k where it ended step k-1; comm.seq
    carries on), each step's records to ``sink``; returns the job's step times (ms)."""
    n = plan.layout.world
    seqs: list[dict[Any, int]] = [{} for _ in range(n)]
    now, ends = [0.0] * n, [0.0]
    for step in range(plan.steps):
        programs = [step_program(plan, groups, r, step, clean, zero, seqs[r]) for r in range(n)]
        sim = Simulation(programs, groups, now, sink is not None and sink.recording.waits_outside).run()
        now = sim.now
        ends.append(max(now))
        if sink is not None:
            sink.write(sim.events)
    return np.diff(ends).tolist()


def simulate(layout: Layout, steps: int, costs: Costs, cause: Cause | None, seed: int, *, clean: bool,
             zero: bool = False) -> tuple[Groups, Simulation, Plan]:
    """The whole job as one :class:`Simulation` (every step's events kept: for small jobs and tests)."""
    plan = Plan(layout, steps, costs, cause, seed)
    groups = make_groups(layout)
    programs = [build_program(plan, groups, r, clean, zero) for r in range(layout.world)]
    return groups, Simulation(programs, groups).run(), plan


def truth_top(plan: Plan, cause: Cause | None) -> Any:
    if cause is None:
        return None
    return {"worker": plan.slow_rank, "last_stage": LAST_STAGE, "seqlen": EVERYONE,
            "link": plan.slow_pair, "collective": schema.comm_span_name(cause.op)}[cause.kind]


def write_job(path: str | Path, *, dp: int = 2, pp: int = 4, tp: int = 2, steps: int = 4, microbatches: int = 8,
              schedule: str = "1f1b", cause: str | Cause | None = None, seed: int = 0, chunks: int | None = None,
              costs: Costs | None = None, zero: bool | None = None, recording: Recording = Recording()) -> Truth:
    """Simulate the job (and its clean twin), write its trace files under ``path``; returns the truth.

    ``chunks`` defaults to 2 for ``interleaved`` (1 otherwise); ``zero`` (reduce_scatter + all_gather
    instead of all_reduce) defaults to whether the cause is a slow reduce_scatter or all_gather."""
    cz = make_cause(cause)
    if cz is not None and cz.kind == "collective" and dp < 2:
        raise ValueError("a slow data-parallel collective needs dp >= 2")
    layout = Layout(dp, pp, tp, microbatches, schedule, chunks or (2 if schedule == "interleaved" else 1))
    zero = (cz is not None and cz.kind == "collective" and cz.op != "all_reduce") if zero is None else zero
    plan = Plan(layout, steps, costs or Costs(), cz, seed)
    groups = make_groups(layout)
    sink = RecordSink(Path(path), layout, groups, recording)
    try:
        actual = run_steps(plan, groups, False, zero, sink)
    finally:
        sink.close()
    ideal = run_steps(plan, groups, True, zero)
    mean_a, mean_i = float(np.mean(actual)), float(np.mean(ideal))
    return Truth(layout, cz, steps, mean_a, mean_i, mean_a / mean_i, truth_top(plan, cz), actual, ideal, plan, zero,
                 sink.moved)
