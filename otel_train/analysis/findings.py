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
  costs per step, from the what-if model.
* ``restart``: an attempt after the first; says whether it got further than the one before.

Hang and crash findings name the ``victims`` (the peers that waited) and carry the culprit's
``stacks`` when it wrote ``stall`` records (every thread's stack at its latest stall, the stalled
thread first). Live ``watch`` passes which processes are still ``alive`` and which are still
``running`` (making progress); after the fact every process has stopped.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from otel_train.analysis.spans import ErrorSpan, ProcessState, Run
from otel_train.analysis.stacks import stall_stacks
from otel_train.analysis.stats import PeerTable, peer_table, sign_test, step_axis
from otel_train.analysis.whatif import Window, scenarios, step_cost, sync_table
from otel_train.phases import STEP

HANG = "hang"
CRASH = "crash"
ERROR = "error"
STRAGGLER = "straggler"
RESTART = "restart"
FINDING_KINDS = (HANG, CRASH, ERROR, STRAGGLER, RESTART)

STRAGGLER_MAX_P = 0.01
"""A rank is slower than its peers' median in more steps than chance would give: sign test p below this ..."""
STRAGGLER_MIN_STEPS = 10
"""... over at least this many shared steps ..."""
STRAGGLER_MIN_EXCESS_MS = 0.5
"""... and its median excess (after discounting waiting) is at least this many ms ..."""
STRAGGLER_MIN_EXCESS_PCT = 5.0
"""... and at least this percentage of the phase's median duration."""


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
    stragglers: bool = True,
) -> list[dict[str, Any]]:
    """All findings, culprits only: hangs and crashes first, then errors, stragglers, restarts.

    For a live snapshot: ``alive`` processes have not died (whether or not they wrote ``process_end``
    yet), ``running`` ones (a subset) are still making progress and so are neither hung nor crashed;
    ``stragglers=False`` leaves out the straggler rule (``watch`` asks it over recent steps itself).
    """
    order = {name: i for i, name in enumerate(run.phase_order())}
    out: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    slow: list[dict[str, Any]] = []
    for group in run.groups():
        culprits, stop_found = _stop_findings(group, order, alive, running)
        out.extend(stop_found)
        errors.extend(_error_findings(group, culprits))
        if stragglers:
            slow.extend(straggler_findings(group, run.phase_order()))
    return out + errors + slow + _restart_findings(run)


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
    running: Collection[ProcessState] = (),
) -> tuple[list[ProcessState], list[dict[str, Any]]]:
    """Hang and crash findings of one group; returns (culprits, findings)."""

    def dead(d: ProcessState) -> bool:
        return not d.ended_cleanly and d not in alive

    settled = [d for d in group if d not in running]
    stopped = [d for d in settled if d.unclosed]
    others = [d for d in settled if not d.unclosed]
    died_outside = [d for d in others if dead(d)]
    if stopped:
        # Only a death before anyone got stuck can explain the stuck ones; a later one is their echo
        # (e.g. a collective failing once the stuck rank was killed).
        first_stop = min(d.innermost.start_ts for d in stopped)  # type: ignore[union-attr]
        died_outside = [d for d in died_outside if (d.last_ts or 0.0) <= first_stop]
    found = []
    for d in died_outside:
        step, phase = _where(d)
        found.append(
            _finding(
                CRASH, d, step, phase,
                f"rank {d.rank} (attempt {d.attempt}) ended without shutdown after step {step}"
                f" (last record: {d.last_event}); it died outside any span",
                victims=[p.rank for p in stopped],
            )
        )
    culprits = list(died_outside)
    if not stopped or died_outside:
        return culprits, found  # stopped ranks, if any, were waiting for the crashed one
    failed = _fatal_error_before(stopped, others)
    if failed is not None:
        return [failed], found  # the launcher stopped the peers after this rank raised: victims
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
            return culprits, found
    for d in behind:
        crashed = dead(d) and (len(group) == 1 or any(not dead(p) for p in group if p is not d))
        found.append(_stopped_inside(d, crashed, ahead, others))
        culprits.append(d)
    return culprits, found


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
        message = f"rank {d.rank} (attempt {d.attempt}) died without shutdown inside {chain} at step {step}{waiting}"
    else:
        message = f"rank {d.rank} (attempt {d.attempt}) stopped inside {chain} at step {step}{waiting}"
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
        f"all {len(stopped)} ranks of attempt {first.attempt} stopped in {phase} at step {step}{hint}",
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


def _error_findings(group: list[ProcessState], culprits: list[ProcessState]) -> list[dict[str, Any]]:
    """One finding per (rank, innermost failing span, exception type), culprits only.

    Dropped as victims: a rank's errors after a hang/crash culprit stopped, and collective failures
    ("Connection closed by peer", NCCL/gloo errors, timeouts) raised after another rank's first error;
    the culprit's finding names those ranks.
    """
    stop_ts = min(
        ((c.innermost.start_ts if c.innermost else c.last_ts) or 0.0 for c in culprits), default=None
    )
    errors = {id(d): _innermost_errors(d) for d in group}
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
            times = f" ({len(errs)} times, first at step {e.step})" if len(errs) > 1 else ""
            out.append(
                _finding(
                    ERROR, d, e.step, name,
                    f"rank {d.rank} (attempt {d.attempt}): {name} raised {etype}: {e.message} at step {e.step}{times}",
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
                       window: Window | None = None) -> list[dict[str, Any]]:
    """Straggler findings of one group of processes that ran together, over the steps ``window``
    (inclusive; live ``watch`` passes its recent steps) or all of them.

    A rank is named in a phase when, after discounting waiting that a later peer explains, it is
    slower than its peers' median in significantly more shared steps than chance gives (one-sided
    sign test, p < ``STRAGGLER_MAX_P``, at least ``STRAGGLER_MIN_STEPS`` steps) *and* its median
    excess is at least ``STRAGGLER_MIN_EXCESS_MS`` and ``STRAGGLER_MIN_EXCESS_PCT`` of the phase's
    median. Each finding carries its score, p-value and its cost per step (from the what-if model).
    """
    if len(group) < 2:
        return []
    names = [n for n in (order or Run(list(group)).phase_order()) if any(n in d.phases for d in group)]
    children = {n for n in names if any(d.parents.get(n) == STEP for d in group)}
    axis = step_axis(group, names)
    if window is not None:
        axis = axis[(axis >= window[0]) & (axis <= window[1])]
    # How late each rank arrived at the current step-child phase: its summed excess over its peers
    # in the earlier child phases of the same step. Waiting for a later peer is explained excess.
    lateness = np.zeros((axis.size, len(group)))
    out: list[dict[str, Any]] = []
    for name in names:
        table = peer_table(group, name, axis)
        excess = table.durs - table.peers
        net = excess - (lateness.max(axis=1, keepdims=True) - lateness) if name in children else excess
        if name in children:
            lateness += np.nan_to_num(excess)
        out.extend(_stragglers_in(group, table, net))
    return _with_costs(group, out, window)


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
                f"median (worst at step {worst_step}, +{float(col[worst]):.1f} ms)",
                score=score, p_value=p, excess_ms=extra, slow_steps=slower, steps=int(col.size),
            )
        )
    return out


def _with_costs(group: Sequence[ProcessState], found: list[dict[str, Any]], window: Window | None
                ) -> list[dict[str, Any]]:
    """Each straggler's cost per step: the step time with that rank's phase made typical (whatif)."""
    if not found:
        return found
    table = sync_table(group, window=window)
    if table is None:
        return found
    s = scenarios(table)
    actual = float(s.actual.mean())
    for f in found:
        typical = s.by_rank_phase.get((f["rank"], f["phase"]), s.by_rank[f["rank"]])
        cost = step_cost(actual, float(typical.mean()))
        f.update(cost)
        f["message"] += (f"; it costs {cost['cost_ms']:.1f} ms of every {actual:.1f} ms step "
                         f"({cost['cost_pct']:.0f} %, what-if)")
    return found


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
