"""Findings that name the culprit, not the victims: the one copy of the rules that summarize,
``summarize --fast`` and live ``watch`` all apply to a :class:`~otel_train.analysis.spans.Run`.

Findings (``kind``), decided per group of processes that ran together (same source and attempt):

* ``hang``: a rank stopped inside a span (open, or ended ``incomplete`` by shutdown). Each stopped
  rank gets a position (step, then the phase's place in the step); the ranks furthest behind are
  the culprits and the ranks ahead of them, blocked in a collective waiting, are victims. When every
  stopped rank is at the same place and nothing else explains it, one finding with ``rank: null``
  says so (naming ranks missing from the trace when ``world_size`` says there should be more).
* ``crash``: a process ended without shutdown (no ``process_end`` instant) and no open peer is to
  blame: it died outside any span before any peer got stuck, or it died inside one while its peers
  lived on to shut down (or it ran alone). Peers stopped while waiting for a crashed rank are
  victims; a death after a peer got stuck is that peer's echo, not a finding.
* ``error``: a span ended with an exception; one finding per (rank, innermost span, exception type)
  with a count. Errors a victim raised after the hang/crash culprit stopped (collective timeouts)
  are not findings.
* ``straggler`` (:func:`straggler_findings`): a rank slower than the median of its peers in one
  phase in significantly more shared steps than chance gives, by enough to matter (docs/analysis.md
  "Stragglers"). Excess that is explained by waiting (a peer arrived later at this phase because it
  was slower in an earlier phase of the same step) is discounted, so the rank that is slow in
  ``data_fetch`` is named, not the peers that wait for it in ``backward``. Each one says what it
  costs per step, from the what-if model; one whose cost is ~0 (its excess does not lengthen the
  step: waiting absorbed by a later peer) is a victim, not named (docs/analysis.md "Victims").
* ``restart``: an attempt after the first; says whether it got further than the one before.

At the communication level (the run's comm graph, :mod:`otel_train.analysis.comm`; docs/comm.md
"Findings"):

* a ``hang`` names the op: when stopped ranks wait in ``comm.*`` ops, the ranks that never issued
  their part (members missing from the collective, the peer that never sent or received) are
  followed through their own waits to the rank that is not waiting in communication: that one is
  the culprit, every rank waiting on it is a victim (``comm.waiting``). Without comm ops the
  phase-level rule above decides;
* ``desync``: the members of one group issued different ops, or different bytes or dtypes, at the
  same seq; one finding per group (its first such seq), naming the minority side;
* ``straggler`` by arrival: the member that arrives last at a significant share of its group's
  collectives inside steps (all of them in a run without steps), by a margin (:data:`ARRIVAL_MAX_P`,
  :data:`ARRIVAL_MIN_SHARE`, :data:`ARRIVAL_MIN_GAP_MS`); its peers' waiting is its ``cost_ms`` (``waited_ms`` added to the
  phase rule's finding when that names it in the same phase). The phase-level rule drops a rank
  that, judged without the time its comm ops waited for a later peer, it would not name: a victim.

Hang and crash findings name the ``victims`` (the peers that waited) and carry the culprit's
``stacks`` when it wrote ``stall`` records (every thread's stack at its latest stall, the stalled
thread first). Live ``watch`` passes which processes are still ``alive`` and which are still
``running`` (making progress); after the fact every process has stopped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np

from otel_train import schema
from otel_train.analysis.clock import Clock
from otel_train.analysis.comm import CommGraph, CommOp, rank_ranges, wait_chains
from otel_train.analysis.spans import NO_STEP, ErrorSpan, ProcessState, Run
from otel_train.analysis.stacks import stall_stacks
from otel_train.analysis.stats import (
    PeerTable, align, binom_sf, columns, peer_medians, peer_table, per_step, sign_test, step_axis,
)
from otel_train.analysis.whatif import Window, scenarios, step_cost, sync_table
from otel_train.phases import STEP

HANG = "hang"
CRASH = "crash"
ERROR = "error"
STRAGGLER = "straggler"
RESTART = "restart"
DESYNC = "desync"
CLOCK_SKEW = "clock_skew"
FINDING_KINDS = (HANG, CRASH, ERROR, STRAGGLER, RESTART, DESYNC, CLOCK_SKEW)

STRAGGLER_MAX_P = 0.01
"""A rank is slower than its peers' median in more steps than chance would give: sign test p below this ..."""
STRAGGLER_MIN_STEPS = 10
"""... over at least this many shared steps ..."""
STRAGGLER_MIN_EXCESS_MS = 0.5
"""... and its median excess (after discounting waiting) is at least this many ms ..."""
STRAGGLER_MIN_EXCESS_PCT = 5.0
"""... and at least this percentage of the phase's median duration."""
STRAGGLER_MIN_COST_SHARE = 0.1
"""A phase-rule straggler must cost (what-if) at least this share of its excess: an excess that does not
lengthen the step is waiting absorbed by a later peer (a victim: docs/analysis.md "Victims") ..."""
STRAGGLER_MIN_COST_PCT = 1.0
"""... and at least this percentage of the step: a cost of ~0 is no straggler worth naming."""
ARRIVAL_MAX_P = 1e-3
"""A rank is last to arrive at more of its group's collectives than chance (1 / members) gives: binomial
p below this ..."""
ARRIVAL_MIN_SHARE = 0.9
"""... at least this share of them (a rank that shares its core with other work came last at 80 % of
its collectives in ``tests/test_answers_torchrun.py``'s busy runs; a rank slowed by 30 ms at 96 %) ..."""
ARRIVAL_MIN_GAP_MS = 1.0
"""... by a median margin over the second-to-last arrival of at least this many ms ..."""
ARRIVAL_MIN_GAP_PCT = 5.0
"""... and this percentage of the rank's median step time."""
ARRIVAL_VICTIM_SHARE = 0.5
"""... unless at least this share of its margin is time it waited earlier in the step in comm ops (a
recv for a slow pipeline stage) beyond its peers' median waiting: then it is a victim, not named."""


def _finding(kind: str, d: ProcessState | None, step: int | None, phase: str | None, message: str, **extra: Any):
    return {
        "kind": kind,
        "rank": d.rank if d is not None else None,
        "attempt": d.attempt if d is not None else extra.pop("attempt", None),
        "step": step,
        "phase": phase,
        "message": message,
        **extra,
    }


def findings(
    run: Run, *, alive: Collection[ProcessState] = (), running: Collection[ProcessState] = (),
    stragglers: bool = True, graphs: dict[tuple[str, int], CommGraph] | None = None,
) -> list[dict[str, Any]]:
    """All findings, culprits only: hangs and crashes first, then desyncs, errors, stragglers, restarts,
    clock skews (hosts off the reference by more than 10 ms: docs/clock.md).

    For a live snapshot: ``alive`` processes have not died (whether or not they wrote ``process_end``
    yet), ``running`` ones (a subset) are still making progress and so are neither hung nor crashed;
    ``stragglers=False`` leaves out the straggler rule (``watch`` asks it over recent steps itself).
    ``graphs``: the comm graphs by (source, attempt) (default: ``run.comm``; ``watch`` keeps its own).
    """
    graphs = run.comm if graphs is None else graphs
    order = {name: i for i, name in enumerate(run.phase_order())}
    out: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    slow: list[dict[str, Any]] = []
    for group in run.groups():
        graph = graphs.get((group[0].source, group[0].attempt))
        graph = graph if graph is not None and graph.ops else None
        culprits, stop_found, explained = _stop_findings(group, order, alive, running, graph)
        desyncs = desync_findings(group, graph) if graph is not None else []
        out.extend(_without_desync_victims(stop_found, desyncs))
        out.extend(desyncs)
        errors.extend(_error_findings(group, culprits, explained))
        if stragglers:
            slow.extend(straggler_findings(group, run.phase_order(), graph=graph))
    return out + errors + slow + _restart_findings(run) + clock_findings(run, graphs)


def _without_desync_victims(stop_found: list[dict[str, Any]], desyncs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A rank that stopped (hung, or died: gloo aborts a rank that receives the wrong size) waiting in an
    op its group desynced at is that desync's victim, not a culprit of its own."""
    waited = {r for f in desyncs for r in f["comm"]["waiting"] if r in f["victims"]}
    return [f for f in stop_found if not (f["kind"] in (HANG, CRASH) and f["rank"] in waited)]


def clock_findings(run: Run, graphs: dict[tuple[str, int], CommGraph]) -> list[dict[str, Any]]:
    """A ``clock_skew`` finding per host whose clock is off the reference's by more than
    :data:`~otel_train.analysis.clock.SKEW_MS` (at the start or the end of the run)."""
    clock = next((g.clock for g in graphs.values() if g.clock is not None), None)
    if clock is None:
        return []
    out = []
    for hc in clock.skewed():
        ranks = sorted({d.rank for d in run.processes if d.host == hc.host})
        d = next((p for p in run.processes if p.host == hc.host), None)
        message = (f"host {hc.host}'s clock (ranks {rank_ranges(ranks)}) is {hc.offset_s * 1e3:+.1f} ms off host "
                   f"{clock.reference}'s (the reference) at the first record, drifting {hc.drift * 1e6:+.1f} ppm "
                   f"(residual {hc.residual_s * 1e3:.3f} ms over {hc.samples} collectives): every cross-host "
                   "comparison uses aligned times (--no-align: the raw clocks)")
        f = _finding(CLOCK_SKEW, d, None, None, message, **hc.row())
        f["attempt"] = None
        out.append(f)
    return out


def _ranks(ds: Sequence[ProcessState]) -> str:
    return ",".join(str(d.rank) for d in ds)


def _where(d: ProcessState) -> tuple[int | None, str | None]:
    inner = d.innermost
    if inner is None:
        return d.final_step, d.last_closed
    return (inner.step if inner.step is not None else d.final_step), d.last_phase()


def _position(d: ProcessState, order: dict[str, int]) -> tuple[int, float]:
    step, _ = _where(d)
    inner = d.innermost
    assert inner is not None
    if inner.name == STEP:
        # Between phases: just after the last phase that closed in this step.
        place = order.get(d.last_closed, -1) + 0.5 if d.last_closed else -0.5
    else:
        place = float(order.get(inner.name, len(order)))
    return (step if step is not None else -1, place)


def _stop_findings(
    group: list[ProcessState], order: dict[str, int], alive: Collection[ProcessState] = (),
    running: Collection[ProcessState] = (), graph: CommGraph | None = None,
) -> tuple[list[ProcessState], list[dict[str, Any]], set[str]]:
    """Hang and crash findings of one group; returns (culprits, findings, span ids of the comm ops
    whose failures they explain)."""

    def dead(d: ProcessState) -> bool:
        return not d.ended_cleanly and d not in alive

    settled = [d for d in group if d not in running]
    stopped = [d for d in settled if d.unclosed]
    others = [d for d in settled if not d.unclosed]
    # A Flight Recorder dump may show a rank waiting in an op outside any span (collectives off).
    maybe = [d.rank for d in others if not d.ended_cleanly]
    waiting = graph.waiting(maybe) if graph is not None and maybe else {}
    inside = [d for d in others if d.rank in waiting and not d.ended_cleanly]
    others = [d for d in others if d not in inside]
    died_outside = [d for d in others if dead(d)]
    if stopped:
        # Only a death before anyone got stuck can explain the stuck ones; a later one is their echo
        # (e.g. a collective failing once the stuck rank was killed).
        first_stop = min(d.innermost.start_ts for d in stopped)  # type: ignore[union-attr]
        died_outside = [d for d in died_outside if (d.last_ts or 0.0) <= first_stop]
    if graph is not None:
        decided = _comm_stop_findings(group, stopped + inside, others, died_outside, graph, dead)
        if decided is not None:
            return decided
    found = [_died_outside(d, stopped) for d in died_outside]
    culprits = list(died_outside)
    if not stopped or died_outside:
        return culprits, found, set()  # stopped ranks, if any, were waiting for the crashed one
    failed = _fatal_error_before(stopped, others)
    if failed is not None:
        return [failed], found, set()  # the launcher stopped the peers after this rank raised: victims
    pos = {id(d): _position(d, order) for d in stopped}
    lowest = min(pos.values())
    behind = [d for d in stopped if pos[id(d)] == lowest]
    ahead = [d for d in stopped if pos[id(d)] != lowest]
    if not ahead and not others:
        gone = [d for d in stopped if dead(d)]
        if 0 < len(gone) < len(stopped):
            behind, ahead = gone, [d for d in stopped if not dead(d)]
        elif len(stopped) > 1:
            found.append(_all_stopped(stopped))
            return culprits, found, set()
    for d in behind:
        crashed = dead(d) and (len(group) == 1 or any(not dead(p) for p in group if p is not d))
        found.append(_stopped_inside(d, crashed, ahead, others))
        culprits.append(d)
    return culprits, found, set()


def _died_outside(d: ProcessState, stopped: list[ProcessState]) -> dict[str, Any]:
    step, phase = _where(d)
    return _finding(
        CRASH, d, step, phase,
        f"rank {d.rank} (attempt {d.attempt}) ended without shutdown after step {d.step_text(step)}"
        f" (last record: {d.last_event}); it died outside any span",
        victims=[p.rank for p in stopped],
    )


def _stopped_inside(d: ProcessState, crashed: bool, ahead: list[ProcessState], others: list[ProcessState]
                    ) -> dict[str, Any]:
    """The hang (or crash) finding of a culprit that stopped inside a span; ``ahead`` waited for it."""
    step, phase = _where(d)
    chain = " > ".join(u.name for u in d.unclosed)
    waiting = ""
    if ahead:
        places = sorted({_where(p)[1] or "?" for p in ahead})
        waiting = f"; peers {_ranks(ahead)} waited in {'/'.join(places)}"
    elif others:
        waiting = f"; peers {_ranks(others)} did not stop inside a span"
    if crashed:
        message = f"rank {d.rank} (attempt {d.attempt}) died without shutdown inside {chain} at step {d.step_text(step)}{waiting}"
    else:
        message = f"rank {d.rank} (attempt {d.attempt}) stopped inside {chain} at step {d.step_text(step)}{waiting}"
    stacks = stall_stacks(d)
    return _finding(CRASH if crashed else HANG, d, step, phase, message, victims=[p.rank for p in ahead],
                    **({"stacks": stacks} if stacks else {}))


def _fatal_error_before(stopped: list[ProcessState], others: list[ProcessState]) -> ProcessState | None:
    """A rank that did not stop inside a span but raised (outside a collective) in its last step
    before any stopped rank's last record: the stopped ranks were waiting for it, then killed."""
    errors = {id(d): [e for e in _innermost_errors(d) if e.step == d.final_step] for d in others}
    first = _first_error(errors, others)
    if first is None or is_collective_failure(first[1].error_type, first[1].message):
        return None
    if all(first[1].ts <= (d.last_ts or 0.0) for d in stopped):
        return first[0]
    return None


def _all_stopped(stopped: list[ProcessState]) -> dict[str, Any]:
    first = stopped[0]
    step, phase = _where(first)
    world = max((d.world_size or 0) for d in stopped)
    present = {d.rank for d in stopped}
    missing = [r for r in range(world) if r not in present]
    hint = (
        f"; ranks {','.join(map(str, missing))} wrote no trace for this attempt: look there"
        if missing
        else "; no rank stands out: suspect a collective, the network or storage"
    )
    return _finding(
        HANG, None, step, phase,
        f"all {len(stopped)} ranks of attempt {first.attempt} stopped in {phase} at step {first.step_text(step)}{hint}",
        attempt=first.attempt,
        ranks=sorted(present),
    )


def _innermost_errors(d: ProcessState) -> list[ErrorSpan]:
    parents = {e.parent_span_id for e in d.errors}
    return [e for e in d.errors if e.span_id not in parents]


_COLLECTIVE_FAILURE = re.compile(
    r"gloo|nccl|closed by peer|connection (?:closed|reset|refused)|broken pipe|timed out|timeout|watchdog"
    r"|process ?group|collective|Dist(?:Backend|Network|Store)Error",
    re.IGNORECASE,
)
"""An error that a rank gets when a peer of its collective died or never arrived (gloo, NCCL, c10d)."""


def is_collective_failure(error_type: str, message: str) -> bool:
    """Whether an exception looks like a failed collective (a peer died or never arrived)."""
    return _COLLECTIVE_FAILURE.search(f"{error_type}: {message}") is not None


def _first_error(
    errors: dict[int, list[ErrorSpan]], group: list[ProcessState]
) -> tuple[ProcessState, ErrorSpan] | None:
    """The error that came first, preferring one raised outside a collective: its rank is the culprit."""
    found = [(e.ts, i, d, e) for i, d in enumerate(group) for e in errors[id(d)]]
    own = [f for f in found if not is_collective_failure(f[3].error_type, f[3].message)]
    first = min(own or found, default=None, key=lambda f: (f[0], f[1]))
    return None if first is None else (first[2], first[3])


def _error_findings(group: list[ProcessState], culprits: list[ProcessState], explained: Collection[str] = ()
                    ) -> list[dict[str, Any]]:
    """One finding per (rank, innermost failing span, exception type), culprits only.

    Dropped as victims: a rank's errors after a hang/crash culprit stopped, and collective failures
    ("Connection closed by peer", NCCL/gloo errors, timeouts) raised after another rank's first error;
    the culprit's finding names those ranks.
    """
    stop_ts = min(
        ((c.innermost.start_ts if c.innermost else c.last_ts) or 0.0 for c in culprits), default=None
    )
    errors = {id(d): [e for e in _innermost_errors(d) if e.span_id not in explained] for d in group}
    first = _first_error(errors, group)
    victims: list[tuple[ProcessState, ErrorSpan]] = []
    out = []
    culprit_finding: dict[str, Any] | None = None
    for d in group:
        victim = stop_ts is not None and d not in culprits
        by_key: dict[tuple[str, str], list[ErrorSpan]] = {}
        for e in errors[id(d)]:
            if victim and e.ts >= stop_ts:  # type: ignore[operator]
                continue  # e.g. a collective timing out because the culprit never arrived
            if first is not None and d is not first[0] and e.ts >= first[1].ts and is_collective_failure(
                e.error_type, e.message
            ):
                victims.append((d, e))  # its all-reduce failed because the first rank to fail went away
                continue
            by_key.setdefault((e.name, e.error_type), []).append(e)
        for (name, etype), errs in by_key.items():
            e = errs[0]
            times = f" ({len(errs)} times, first at step {d.step_text(e.step)})" if len(errs) > 1 else ""
            out.append(
                _finding(
                    ERROR, d, e.step, name,
                    f"rank {d.rank} (attempt {d.attempt}): {name} raised {etype}: {e.message} at step {d.step_text(e.step)}{times}",
                    count=len(errs),
                )
            )
            if first is not None and first[1] in errs:
                culprit_finding = out[-1]
    if victims and culprit_finding is not None:
        ranks = sorted({d.rank for d, _ in victims})
        places = "/".join(sorted({e.name for _, e in victims}))
        culprit_finding["message"] += (
            f"; peers {','.join(map(str, ranks))} then failed in {places} with collective errors (victims)"
        )
        culprit_finding["victims"] = ranks
    return out


def straggler_findings(group: Sequence[ProcessState], order: Sequence[str] | None = None,
                       window: Window | None = None, graph: CommGraph | None = None) -> list[dict[str, Any]]:
    """Straggler findings of one group of processes that ran together, over the steps ``window``
    (inclusive; live ``watch`` passes its recent steps) or all of them.

    A rank is named in a phase when, after discounting waiting that a later peer explains, it is
    slower than its peers' median in significantly more shared steps than chance gives (one-sided
    sign test, p < ``STRAGGLER_MAX_P``, at least ``STRAGGLER_MIN_STEPS`` steps) *and* its median
    excess is at least ``STRAGGLER_MIN_EXCESS_MS`` and ``STRAGGLER_MIN_EXCESS_PCT`` of the phase's
    median. Each finding carries its score, p-value and its cost per step (from the what-if model);
    one whose cost is below ``STRAGGLER_MIN_COST_SHARE`` of its excess or ``STRAGGLER_MIN_COST_PCT``
    of the step is dropped (a victim; docs/analysis.md "Victims"). Without ``step`` spans the
    top-level phases that carry a step are the step's sequence.

    With a comm ``graph``: ``comm.*`` spans are left to the arrival rule (:func:`arrival_findings`);
    a rank named in a phase is dropped when, judged without the time its comm ops in that phase
    waited for a later member, it would not be named (a victim); and a rank the arrival rule names
    in the phase this rule names it in is one finding, with the arrival's evidence added.
    """
    if len(group) < 2:
        return []
    names = [n for n in (order or Run(list(group)).phase_order())
             if any(n in d.phases for d in group) and not n.startswith(schema.COMM_PREFIX)]
    children = _step_children(group, names)
    axis = step_axis(group, names)
    if window is not None:
        axis = axis[(axis >= window[0]) & (axis <= window[1])]
    # How late each rank arrived at the current step-child phase: its summed excess over its peers
    # in the earlier child phases of the same step. Waiting for a later peer is explained excess.
    lateness = np.zeros((axis.size, len(group)))
    out: list[dict[str, Any]] = []
    waits = _waits(group, graph) if graph is not None else {}
    for name in names:
        table = peer_table(group, name, axis)
        excess = table.durs - table.peers
        behind = lateness.max(axis=1, keepdims=True) - lateness if name in children else 0.0
        found = _stragglers_in(group, table, excess - behind)
        if found and waits and name != STEP:
            unwaited = _without_waiting(table, group, name, waits)
            kept = {f["rank"] for f in _stragglers_in(group, unwaited, unwaited.durs - unwaited.peers - behind)}
            found = [f for f in found if f["rank"] in kept]
        if name in children:
            lateness += np.nan_to_num(excess)
        out.extend(found)
    if graph is not None:
        out = _most_specific(group, out)
    out = _with_costs(group, out, window, graph.clock if graph is not None else None,
                      judge=not _pipelined(group, graph))
    return _with_arrivals(out, arrival_findings(group, graph, window, waits) if graph is not None else [])


def _step_children(group: Sequence[ProcessState], names: Sequence[str]) -> set[str]:
    """The phases that follow one another inside a step: the children of ``step``; in a run without
    ``step`` spans (``ot.set_step`` only), the top-level spans that carry a step."""
    if any(STEP in d.phases for d in group):
        return {n for n in names if any(d.parents.get(n) == STEP for d in group)}
    return {n for n in names if n != STEP and any(n in d.phases and d.parents.get(n) is None for d in group)}


def _most_specific(group: Sequence[ProcessState], found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """On a run with comm ops: a rank named in a phase and in one of its child phases is named in the
    child only; a phase that holds the rank's comm ops, whose excess its child phases do not explain
    (at least half of it), is time spent waiting around those ops (an async op's wait, a recv from a
    slow stage): not named (a slow rank there arrives last, which the arrival rule sees)."""
    by_rank = {d.rank: d for d in group}
    named = {(f["rank"], f["phase"]): f for f in found}
    out = []
    for f in found:
        d = by_rank[f["rank"]]
        kids = [n for n, parent in d.parents.items() if parent == f["phase"]]
        if any((f["rank"], k) in named for k in kids):
            continue
        holds_comm = any(k.startswith(schema.COMM_PREFIX) for k in kids)
        explained = sum(named[(f["rank"], k)]["excess_ms"] for k in kids if (f["rank"], k) in named)
        if holds_comm and explained < 0.5 * f["excess_ms"]:
            continue
        out.append(f)
    return out


def _with_arrivals(found: list[dict[str, Any]], arrivals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Phase-rule findings with the arrival evidence of the same (rank, phase) added; other arrival
    findings after them."""
    by_key = {(f["rank"], f["phase"]): f for f in found}
    rest = []
    for a in arrivals:
        f = by_key.get((a["rank"], a["phase"]))
        if f is None:
            rest.append(a)
            continue
        c = a["comm"]
        f.update(comm=c, victims=a["victims"], waited_ms=a["waited_ms"],
                 arrival={"p_value": a["p_value"], "gap_ms": a["gap_ms"], "last_at": c["last_at"],
                          "collectives": c["collectives"]})
        f["message"] += (f"; it arrived last at {c['last_at']}/{c['collectives']} collectives of group {c['group']}, "
                         f"{a['gap_ms']:.1f} ms after the next-latest at the median (peers waited "
                         f"{a['waited_ms']:.0f} ms in all)")
    return found + rest


def _stragglers_in(group: Sequence[ProcessState], table: PeerTable, net: np.ndarray) -> list[dict[str, Any]]:
    """The ranks that pass the straggler rule in one phase (``net``: excess not explained by waiting)."""
    out = []
    valid = ~np.isnan(net)
    typical = float(np.median(table.durs[valid])) if valid.any() else 0.0
    floor = max(STRAGGLER_MIN_EXCESS_MS, STRAGGLER_MIN_EXCESS_PCT / 100.0 * typical)
    for j, d in enumerate(group):
        col, durs, peers = net[valid[:, j], j], table.durs[valid[:, j], j], table.peers[valid[:, j], j]
        slower, decided = int((col > 0).sum()), int((col != 0).sum())
        if col.size < STRAGGLER_MIN_STEPS or slower <= decided / 2:
            continue
        p = sign_test(slower, decided)
        extra = float(np.median(col))
        if p >= STRAGGLER_MAX_P or extra < floor:
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            score = float(np.median(durs / peers))
        worst = int(col.argmax())
        worst_step = int(table.steps[valid[:, j]][worst])
        out.append(
            _finding(
                STRAGGLER, d, worst_step, table.phase,
                f"rank {d.rank} (attempt {d.attempt}) is slower than its peers in {table.phase} in {slower}/{col.size} "
                f"steps (sign test p={p:.1g}): +{extra:.1f} ms per step at the median, {score:.2f}x the peer "
                f"median (worst at step {d.step_text(worst_step)}, +{float(col[worst]):.1f} ms)",
                score=score, p_value=p, excess_ms=extra, slow_steps=slower, steps=int(col.size),
            )
        )
    return out


def _pipelined(group: Sequence[ProcessState], graph: CommGraph | None) -> bool:
    """Whether the group runs a pipeline (a ``pp`` mesh dim of size > 1, or send/recv ops): there the
    data-parallel what-if model behind a straggler's cost does not hold."""
    if any(d.mesh.get("pp", (1, 0))[0] > 1 for d in group):
        return True
    return graph is not None and bool(graph.p2p)


def _with_costs(group: Sequence[ProcessState], found: list[dict[str, Any]], window: Window | None,
                clock: Clock | None = None, judge: bool = True) -> list[dict[str, Any]]:
    """Each straggler's cost per step: the step time with that rank's phase made typical (whatif), with
    hosts on the run's clock estimate when it aligns them (docs/clock.md). With ``judge``, a finding
    whose cost is ~0 is dropped (:func:`_absorbed`); a pipeline's findings are not judged so (the
    data-parallel model cannot see what a stage's slowness costs: ``whatif --method typical`` can)."""
    if not found:
        return found
    table = sync_table(group, window=window, clock=clock if clock is not None and clock.applied else None)
    if table is None or table.unsynchronized() is not None:  # the model does not apply: no cost claimed
        return found
    s = scenarios(table)
    actual = float(s.actual.mean())
    kept = []
    for f in found:
        typical = s.by_rank_phase.get((f["rank"], f["phase"]), s.by_rank[f["rank"]])
        cost = step_cost(actual, float(typical.mean()))
        if judge and _absorbed(f, cost):
            continue
        f.update(cost)
        f["message"] += (f"; it costs {cost['cost_ms']:.1f} ms of every {actual:.1f} ms step "
                         f"({cost['cost_pct']:.0f} %, what-if; where it goes: otel-train whatif --plot heat.png)")
        kept.append(f)
    return kept


def _absorbed(f: dict[str, Any], cost: dict[str, float]) -> bool:
    """Whether a phase-rule straggler's what-if cost is ~0: below :data:`STRAGGLER_MIN_COST_SHARE` of
    its excess (the excess is waiting for a later peer, e.g. inside a collective whose other members
    arrive late: a victim) or below :data:`STRAGGLER_MIN_COST_PCT` of the step."""
    excess = f.get("excess_ms")
    if excess is None or not np.isfinite(cost["cost_ms"]):
        return False
    return cost["cost_ms"] < STRAGGLER_MIN_COST_SHARE * excess or cost["cost_pct"] < STRAGGLER_MIN_COST_PCT


def _restart_findings(run: Run) -> list[dict[str, Any]]:
    out = []
    by_source: dict[str, dict[int, list[ProcessState]]] = {}
    for d in run.processes:
        by_source.setdefault(d.source, {}).setdefault(d.attempt, []).append(d)
    for attempts in by_source.values():
        ordered = sorted(attempts)
        for prev, cur in zip(ordered, ordered[1:]):
            before = _reach(attempts[prev])
            after = _reach(attempts[cur])
            start = min((d.first_step for d in attempts[cur] if d.first_step is not None), default=None)
            if after is not None and (before is None or after > before):
                verdict = f"made progress: reached step {after} (+{after - (before or 0)} beyond attempt {prev})"
            else:
                verdict = f"made no progress: reached step {after}, attempt {prev} had reached {before}"
            out.append(
                _finding(
                    RESTART, None, start, None,
                    f"attempt {cur} ({len(attempts[cur])} ranks) restarted at step {start} after attempt {prev} "
                    f"stopped at step {before}; it {verdict}",
                    attempt=cur,
                    progress=after is not None and (before is None or after > before),
                )
            )
    return out


def _reach(ds: list[ProcessState]) -> int | None:
    return max((d.final_step for d in ds if d.final_step is not None), default=None)


# ---------------------------------------------------------------------------------------------
# Communication: the op a hang waits in, desyncs, arrival stragglers (docs/comm.md "Findings")


def _hms(ts: float | None) -> str:
    return "?" if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%H:%M:%S")


def _ranks_word(ranks: Collection[int], singular: str = "waits", plural: str = "wait") -> str:
    return f"rank {rank_ranges(ranks)} {singular}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)} {plural}"


def _comm_stop_findings(
    group: list[ProcessState], stopped: list[ProcessState], others: list[ProcessState],
    died_outside: list[ProcessState], graph: CommGraph, dead: Callable[[ProcessState], bool],
) -> tuple[list[ProcessState], list[dict[str, Any]], set[str]] | None:
    """Hang (or crash) findings from the ops the stopped ranks wait in and the ops that failed with a
    collective error (waited until a timeout); None when there are none, or only failures that name
    no culprit (the error rule decides)."""
    open_waits = graph.waiting(d.rank for d in stopped) if stopped else {}
    failed, explained = _failed_ops(group, graph)
    waits = {r: list(ops) for r, ops in open_waits.items()}
    for r, ops in failed.items():
        waits.setdefault(r, []).extend(ops)
    if not waits:
        return None
    by_rank = {d.rank: d for d in group}
    fatal = None if died_outside else _fatal_error_before(stopped, others)
    chains = wait_chains(graph, waits)
    if fatal is not None and (not chains or fatal.rank in chains):
        return [fatal], [], set()  # it raised, the launcher stopped the others: its error finding names it
    chains = {c: links for c, links in chains.items()
              if not all(graph.desynced.get(op.group) == op.seq for _, op in links)}
    if not chains:
        if any(graph.desynced.get(op.group) == op.seq for ops in waits.values() for op in ops):
            return _desync_culprits(group, graph), [], explained  # the desync finding names the culprit
        return ([], [_all_waiting(group[0].attempt, open_waits, graph)], set()) if open_waits else None
    found, culprits = [], []
    for c in sorted(chains):
        d = by_rank.get(c)
        crashed = d is not None and dead(d) and (len(group) == 1 or any(not dead(p) for p in group if p is not d))
        found.append(_comm_hang(c, d, group[0].attempt, chains[c], graph, crashed, waits.get(c, ())))
        explained |= {op.span_id for _, op in chains[c] if op.span_id} | {op.span_id for op in failed.get(c, ()) if op.span_id}
        if d is not None:
            culprits.append(d)
    found += [_died_outside(d, stopped) for d in died_outside if d.rank not in chains]
    return culprits + [d for d in died_outside if d.rank not in chains], found, explained


def _failed_ops(group: list[ProcessState], graph: CommGraph) -> tuple[dict[int, list[CommOp]], set[str]]:
    """The comm ops that failed with a collective error (a peer never came: a timeout), by rank, and
    the span ids a desync explains (its seq's, and those from its step on: a peer went away after
    it); none when a rank raised an error of its own (the error rule names it, its peers' failures follow)."""
    errors = [e for d in group for e in _innermost_errors(d)]
    if not errors or any(not is_collective_failure(e.error_type, e.message) for e in errors):
        return {}, set()
    failures = {e.span_id for e in errors}
    failed: dict[int, list[CommOp]] = {}
    for op in graph.all_ops():
        if op.state == schema.STATUS_ERROR and op.span_id in failures:
            failed.setdefault(op.rank, []).append(op)
    desync_steps = [op.step for g, seq in graph.desynced.items() for op in graph.collectives.get((g, seq), {}).values()
                    if op.step is not None]
    since = min(desync_steps) if desync_steps else None
    explained = {op.span_id for ops in failed.values() for op in ops if op.span_id and (
        graph.desynced.get(op.group) == op.seq or (since is not None and op.step is not None and op.step >= since))}
    return failed, explained


def _comm_hang(c: int, d: ProcessState | None, attempt: int, links: list[tuple[int, CommOp]],
               graph: CommGraph, crashed: bool, own: Sequence[CommOp] = ()) -> dict[str, Any]:
    """The finding of a rank that never issued its part of the op its peers wait in (``own``: the
    ops the culprit itself went on to wait in)."""
    direct = [(w, op) for w, op in links if c in graph.blockers(op)]
    by_key: dict[tuple[Any, ...], list[tuple[int, CommOp]]] = {}
    for w, o in direct:
        by_key.setdefault(o.pair if o.p2p else (o.group, o.seq), []).append((w, o))
    # The op most of its direct waiters wait in; a send/recv (a stage's neighbour) before a collective.
    key = min(by_key, key=lambda k: (-len(by_key[k]), len(k) != 3, by_key[k][0][1].seq))
    first = by_key[key]
    op = min((o for _, o in first), key=lambda o: graph.at(o) or 0.0)
    waiting = sorted({w for w, _ in links})
    there = sorted({w for w, _ in first})
    also = [min(ws, key=lambda wo: wo[0]) for k, ws in sorted(by_key.items(), key=lambda kv: str(kv[0])) if k != key]
    if op.p2p:
        ops = {str(w): o.op for w, o in first}
        missing = [c]
    else:
        ops = {str(r): o.op for r, o in sorted(graph.collectives.get((op.group, op.seq), {}).items())}
        missing = graph.blockers(op)
    comm = {"group": op.group, "seq": op.seq, "op": op.op, "waiting": waiting, "missing": missing, "ops": ops}
    if op.peer is not None:
        comm["peer"] = c
    message = _comm_hang_message(c, d, op, there, waiting, graph, crashed, own, also)
    step, phase = _where(d) if d is not None else (None, None)
    stacks = stall_stacks(d) if d is not None else None
    out = _finding(CRASH if crashed else HANG, d, step, phase, message, victims=waiting, comm=comm,
                   attempt=attempt, **({"stacks": stacks} if stacks else {}))
    out["rank"] = c
    return out


def _comm_hang_message(c: int, d: ProcessState | None, op: CommOp, there: list[int], waiting: list[int],
                       graph: CommGraph, crashed: bool, own: Sequence[CommOp] = (),
                       also: Sequence[tuple[int, CommOp]] = ()) -> str:
    since = _hms(graph.at(op))
    stage = graph.stage(c)
    who = f"rank {c}" + (f" (pp stage {stage})" if stage is not None else "")
    when = f"since {since}" if op.waiting else f"from {since} until it failed"
    if op.p2p:
        w = there[0]
        verb, prep = ("sent to", "from") if op.op == "recv" else ("received from", "to")
        text = (f"{who} never {verb} rank {w}, which {'waits' if op.waiting else 'waited'} in {op.op} #{op.seq} "
                f"{prep} {c} {when}")
    else:
        desc = graph.desc(op.group)
        text = (f"{who} never issued {op.op} #{op.seq} of group {op.group}{f' ({desc})' if desc else ''}; "
                f"{_ranks_word(there) if op.waiting else _ranks_word(there, 'waited', 'waited')} in it {when}")
    for w, o in also:
        where = f"{o.op} #{o.seq} {'from' if o.op == 'recv' else 'to'} {c}" if o.p2p else f"{o.op} #{o.seq} of group {o.group}"
        text += f"; rank {w} {'waits' if o.waiting else 'waited'} in {where} too"
    later = [w for w in waiting if w not in there and all(w != a for a, _ in also)]
    if later:
        text += f"; {_ranks_word(later, 'waits on', 'wait on')} those in turn"
    if own:
        mine = own[0]
        return text + (f"; rank {c} went on and {'waits' if mine.waiting else 'failed'} in {mine.op} #{mine.seq} "
                       f"of group {mine.group} at step {mine.step}")
    return text + _culprit_state(c, d, crashed)


def _culprit_state(c: int, d: ProcessState | None, crashed: bool) -> str:
    if d is None:
        return f"; rank {c} wrote no trace for this attempt: look there"
    step, _ = _where(d)
    chain = " > ".join(u.name for u in d.unclosed)
    if chain:
        return f"; rank {c} {'died' if crashed else 'is stopped'} inside {chain} at step {d.step_text(step)}"
    if d.ended_cleanly:
        return f"; rank {c} shut down after step {d.step_text(step)}"
    return f"; rank {c} {'died' if crashed else 'stopped'} outside any span after step {d.step_text(step)} (last record: {d.last_event})"


def _all_waiting(attempt: int, waits: dict[int, list[CommOp]], graph: CommGraph) -> dict[str, Any]:
    """Every stopped rank waits in communication and none waits for a rank that is not: every member
    issued the op (suspect the network or a device), or the ranks wait for each other (a cycle)."""
    first = min((ops[0] for ops in waits.values()), key=lambda o: (o.seq, graph.at(o) or 0.0))
    ranks = sorted(waits)
    blocked = any(graph.blockers(op) for ops in waits.values() for op in ops)
    where = f"{first.op} #{first.seq} of group {first.group}"
    if blocked:
        message = (f"ranks {rank_ranges(ranks)} of attempt {attempt} wait for each other in communication "
                   f"(a cycle, e.g. {where}): a schedule that deadlocks")
    else:
        message = (f"{_ranks_word(ranks)} in {where} since {_hms(graph.at(first))}, which every member issued: "
                   "suspect the network, a device or a peer's backend")
    ops = {str(r): o.op for r, o in sorted(graph.collectives.get((first.group, first.seq), {}).items())}
    comm = {"group": first.group, "seq": first.seq, "op": first.op, "waiting": ranks,
            "missing": graph.blockers(first), "ops": ops or {str(first.rank): first.op}}
    return _finding(HANG, None, first.step, schema.comm_span_name(first.op), message, attempt=attempt,
                    ranks=ranks, victims=[], comm=comm)


def _desync_culprits(group: list[ProcessState], graph: CommGraph) -> list[ProcessState]:
    by_rank = {d.rank: d for d in group}
    out = []
    for g in sorted(graph.desynced):
        found = graph.minority(g)
        if found is not None:
            out += [by_rank[r] for r in found[1] if r in by_rank]
    return out


def desync_findings(group: list[ProcessState], graph: CommGraph) -> list[dict[str, Any]]:
    """One finding per group whose members disagree at a seq (its first such seq): the minority side."""
    by_rank = {d.rank: d for d in group}
    out = []
    for g in sorted(graph.desynced):
        found = graph.minority(g)
        if found is None:
            continue
        seq, culprits, sides = found
        culprit_sig = next(sig for sig, ranks in sides.items() if ranks == culprits)
        ops = graph.collectives.get((g, seq)) or {
            op.rank: op for pair in graph.p2p.values() for op in pair if op is not None and op.group == g and op.seq == seq}
        order = sorted(sides, key=lambda sig: (sig == culprit_sig, min(sides[sig])))
        parts = [f"{'ranks' if len(sides[sig]) > 1 else 'rank'} {', '.join(map(str, sides[sig]))} "
                 f"{ops[sides[sig][0]].describe()}" for sig in order]
        op = ops[culprits[0]]
        desc = graph.desc(g)
        others = sorted(r for sig in order if sig != culprit_sig for r in sides[sig])
        comm = {"group": g, "seq": seq, "op": op.op, "waiting": sorted(r for r, o in ops.items() if o.waiting),
                "missing": [] if op.p2p else graph.blockers(op), "ops": {str(r): o.op for r, o in sorted(ops.items())}}
        message = f"group {g}{f' ({desc})' if desc else ''} seq {seq}: {', '.join(parts)}"
        out.append(_finding(DESYNC, by_rank.get(culprits[0]), op.step, schema.comm_span_name(op.op), message,
                            attempt=group[0].attempt, victims=others, comm=comm, ranks=culprits))
        out[-1]["rank"] = culprits[0]
    return out


def _waits(group: Sequence[ProcessState], graph: CommGraph) -> dict[int, np.ndarray]:
    """Rank -> rows (start, end, waited s) of its comm ops that waited for a later member: an op's
    duration minus the shortest duration among its members (the transfer itself; own clocks only),
    or, where that is more, the time until the latest other member on its host arrived (capped by
    its duration): a recv whose send also lasted long (gloo's send blocks until its recv is posted,
    and a send batched with a recv ends with the batch) still waited until its send began."""
    out: dict[int, list[tuple[float, float, float]]] = {}
    host = {d.rank: d.host for d in group}
    matched = [list(ops.values()) for ops in graph.collectives.values()]
    matched += [[op for op in pair if op is not None] for pair in graph.p2p.values()]
    for ops in matched:
        closed = [o for o in ops if o.end is not None and o.start is not None]
        if len(closed) < 2:
            continue
        shortest = min(o.end - o.start for o in closed)  # type: ignore[operator]
        for o in closed:
            later = max((p.start for p in closed if p is not o and host.get(p.rank) == host.get(o.rank)),
                        default=o.start)
            waited = max((o.end - o.start) - shortest,  # type: ignore[operator]
                         min(later - o.start, o.end - o.start))  # type: ignore[operator]
            if waited > 0:
                out.setdefault(o.rank, []).append((o.start, o.end, waited))  # type: ignore[arg-type]
    return {r: np.array(rows, dtype=float) for r, rows in out.items()}


def _without_waiting(table: PeerTable, group: Sequence[ProcessState], name: str, waits: dict[int, np.ndarray]
                     ) -> PeerTable:
    """``table`` with the waiting of the comm ops inside each span of ``name`` taken out of its step."""
    durs = table.durs.copy()
    for j, d in enumerate(group):
        rows = waits.get(d.rank)
        steps, ms, ends = columns(d, name)
        if rows is None or not ms.size:
            continue
        starts = ends - ms / 1000.0
        order = np.argsort(starts)
        at = np.searchsorted(starts[order], rows[:, 0], side="right") - 1
        ok = at >= 0
        span = order[np.clip(at, 0, None)]
        ok &= ends[span] >= rows[:, 1]
        ok &= steps[span] != NO_STEP
        if not ok.any():
            continue
        uniq, inverse = np.unique(steps[span[ok]], return_inverse=True)
        taken = np.bincount(inverse, weights=rows[ok, 2] * 1000.0, minlength=uniq.size)
        durs[:, j] -= np.nan_to_num(align(table.steps, uniq, taken))
    return PeerTable(table.phase, table.steps, durs, peer_medians(durs))


def arrival_findings(group: Sequence[ProcessState], graph: CommGraph | None, window: Window | None = None,
                     waits: dict[int, np.ndarray] | None = None) -> list[dict[str, Any]]:
    """Stragglers by arrival: at each collective the last member to arrive made the others wait.

    Per group (and clock domain: arrivals on the reference clock, docs/clock.md), a rank is named when it is
    last at a share of the collectives that 1 / members cannot explain (binomial p < ``ARRIVAL_MAX_P``,
    at least ``ARRIVAL_MIN_SHARE``) by a median margin of at least ``ARRIVAL_MIN_GAP_MS`` and
    ``ARRIVAL_MIN_GAP_PCT`` of its median step; ``cost_ms`` is what its peers waited at those collectives.
    A rank late because it waited in comm ops earlier in the step (``ARRIVAL_VICTIM_SHARE``) is not named.
    """
    if graph is None:
        return []
    waits = _waits(group, graph) if waits is None else waits
    by_key: dict[tuple[str, tuple[int, ...]], list[Any]] = {}
    for a in _training_arrivals(graph, window):
        by_key.setdefault((a.group, a.members), []).append(a)
    by_rank = {d.rank: d for d in group}
    best: dict[int, dict[str, Any]] = {}
    for (g, members), seen in by_key.items():
        for rank in {a.last for a in seen}:
            d = by_rank.get(rank)
            f = _arrival_finding(d, g, members, seen, group, graph) if d is not None else None
            if f is not None and _late_by_waiting(d, g, [a for a in seen if a.last == rank], group, graph, waits):
                f = None  # a victim: its lateness is waiting for someone else (issue 17, item 6)
            if f is not None and (rank not in best or f["cost_ms"] > best[rank]["cost_ms"]):
                best[rank] = f
    return [best[r] for r in sorted(best)]


def _training_arrivals(graph: CommGraph, window: Window | None) -> list[Any]:
    """The arrivals judged: those inside the window's steps; without a window, those inside any step when
    the run has steps (start-up collectives, before the first step, are set-up's, not training's: a
    2-rank, 60-step job has 66 collectives, 6 of them start-up), else all of them."""
    arrivals = list(graph.arrivals())
    stepped = [a for a in arrivals if a.step is not None]
    if window is not None:
        return [a for a in stepped if window[0] <= a.step <= window[1]]
    return stepped or arrivals


def _arrival_finding(d: ProcessState, g: str, members: tuple[int, ...], seen: list[Any],
                     group: Sequence[ProcessState], graph: CommGraph) -> dict[str, Any] | None:
    last = [a for a in seen if a.last == d.rank]
    n, k = len(seen), len(last)
    p = binom_sf(k, n, 1.0 / len(members))
    if p >= ARRIVAL_MAX_P or k < ARRIVAL_MIN_SHARE * n:
        return None
    gap = float(np.median([a.gap_ms for a in last]))
    _, step_ms = per_step(d, STEP)
    floor = max(ARRIVAL_MIN_GAP_MS, ARRIVAL_MIN_GAP_PCT / 100.0 * float(np.median(step_ms)) if step_ms.size else 0.0)
    if gap < floor:
        return None
    cost = float(sum(a.waited_ms for a in last))
    worst = max(last, key=lambda a: a.gap_ms)
    steps = {a.step for a in last if a.step is not None}
    phase, slow = _arrival_phase(d, last, group, graph)
    desc = graph.desc(g)
    peers = [m for m in members if m != d.rank]
    ops = sorted({a.op for a in last})
    message = (f"rank {d.rank} (attempt {d.attempt}) arrived last at {k}/{n} collectives of group {g}"
               f"{f' ({desc})' if desc else ''} ({'/'.join(ops)}; binomial p={p:.1g}), {gap:.1f} ms after the "
               f"next-latest at the median; {_ranks_word(peers, 'waited', 'waited')} {cost:.0f} ms in all"
               f"{f' ({cost / len(steps):.1f} ms per step)' if steps else ''}; "
               + (f"it was slower than its peers in {phase} before" if slow else
                  f"its last phase before arriving: {phase} (the time went outside any span)"))
    comm = {"group": g, "seq": worst.seq, "op": worst.op, "waiting": peers, "missing": [],
            "ops": {str(m): worst.op for m in members}, "last_at": k, "collectives": n}
    return _finding(STRAGGLER, d, worst.step, phase, message, p_value=p, gap_ms=gap, cost_ms=cost, waited_ms=cost,
                    cost_per_step_ms=cost / len(steps) if steps else None, slow_steps=len(steps), victims=peers,
                    comm=comm, by="arrival")


def _late_by_waiting(d: ProcessState, g: str, last: list[Any], group: Sequence[ProcessState], graph: CommGraph,
                     waits: dict[int, np.ndarray]) -> bool:
    """Whether ``d``'s lateness at the collectives it arrived last at is its own waiting: the median,
    over them, of (what it waited in comm ops earlier in the step minus the other members' median of
    the same) is at least ``ARRIVAL_VICTIM_SHARE`` of its median margin."""
    if not waits or not last:
        return False
    before = {p.rank: _Waited(waits.get(p.rank), p) for p in group}
    excess = []
    for a in last:
        ops = graph.collectives.get((g, a.seq), {})
        w = {m: before[m].until(ops[m].start) for m in a.members if m in before and m in ops and ops[m].start is not None}
        others = [v for m, v in w.items() if m != d.rank]
        if d.rank in w and others:
            excess.append(w[d.rank] - float(np.median(others)))
    gap = float(np.median([a.gap_ms for a in last]))
    return bool(excess) and float(np.median(excess)) >= ARRIVAL_VICTIM_SHARE * gap


class _Waited:
    """One rank's waiting in comm ops (rows of :func:`_waits`), summed from the start of the step
    span holding a time to that time (ms; own clock)."""

    def __init__(self, rows: np.ndarray | None, d: ProcessState) -> None:
        rows = np.empty((0, 3)) if rows is None else rows[np.argsort(rows[:, 1])]
        self.ends, self.cum = rows[:, 1], np.concatenate([[0.0], np.cumsum(rows[:, 2])])
        _, ms, ends = columns(d, STEP)
        self.starts = np.sort(ends - ms / 1000.0)

    def until(self, t: float) -> float:
        i = int(np.searchsorted(self.starts, t, side="right")) - 1
        if i < 0 or not self.ends.size:
            return 0.0
        lo, hi = np.searchsorted(self.ends, (self.starts[i], t + 1e-9))
        return float(self.cum[hi] - self.cum[lo]) * 1000.0


def _arrival_phase(d: ProcessState, last: list[Any], group: Sequence[ProcessState], graph: CommGraph
                   ) -> tuple[str | None, bool]:
    """The phase that made ``d`` late: the one with the most excess over its peers in the steps it
    arrived last in (comm spans and ``step`` aside), when that is at least half its margins (True);
    else the last phase it closed before the op (False)."""
    steps = np.unique(np.array([a.step for a in last if a.step is not None], dtype=np.int64))
    j = next(i for i, p in enumerate(group) if p is d)
    best, excess = None, 0.5 * sum(a.gap_ms for a in last)  # it must explain half the lateness at least
    for name in d.phases:
        if name == STEP or name.startswith(schema.COMM_PREFIX) or not steps.size:
            continue
        table = peer_table(group, name, steps)
        total = float(np.nansum(table.durs[:, j] - table.peers[:, j]))
        if total > excess:
            best, excess = name, total
    if best is not None:
        return best, True
    ops = [graph.collectives.get((a.group, a.seq), {}).get(d.rank) for a in last]
    phases = [o.phase for o in ops if o is not None and o.phase]
    return (max(set(phases), key=phases.count) if phases else None), False
