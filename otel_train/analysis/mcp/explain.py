"""What each finding kind means and how it is decided: the ``explain`` tool's answers, each a short
summary of the docs page it cites (docs/analysis.md, "What summarize reports"; docs/comm.md,
"Findings"; docs/clock.md; docs/watch.md, "How it decides"; docs/analysis.md, "Diff")."""

from __future__ import annotations

from typing import Any

from otel_train.analysis.mcp.tools import hint

KINDS: dict[str, dict[str, str]] = {
    "hang": {
        "means": "A rank stopped inside a span while its peers waited: the rank that is behind (or in a "
                 "different phase) is the culprit; ranks blocked in a collective waiting for it are its victims.",
        "decided": "Each stopped rank's position (step, then the phase's place in the step) is compared; the "
                   "ranks furthest behind are culprits. With comm.* spans the communication level decides "
                   "first: the open op the stopped ranks wait in, the members that never issued it "
                   "(comm.missing), send/recv wait chains followed to the rank not itself waiting. Live "
                   "(watch): when the run stopped progressing for max(stall_min_s, stall_factor x the run's "
                   "p99 step time so far).",
        "evidence": "comm: {group, seq, op, waiting, missing, ops}; victims; stacks from stall records.",
        "docs": "docs/analysis.md#what-summarize-reports, docs/comm.md#findings, docs/watch.md#how-it-decides",
    },
    "crash": {
        "means": "A process ended without shutdown() (no process_end record) and no open peer is to blame.",
        "decided": "A death outside any span before any peer got stuck, or inside a span while its peers lived "
                   "on; a death after a peer got stuck is an echo of that hang, not a finding.",
        "evidence": "the process's last event and open spans; comm when it died inside an op.",
        "docs": "docs/analysis.md#what-summarize-reports",
    },
    "error": {
        "means": "A span ended with an exception.",
        "decided": "One finding per (rank, innermost failing span, exception type) with a count; collective "
                   "failures raised after another rank's first error are that rank's victims.",
        "evidence": "error type and message, count, victims.",
        "docs": "docs/analysis.md#what-summarize-reports",
    },
    "straggler": {
        "means": "A rank consistently slower than its peers in one phase, or the last to arrive at a "
                 "significant share of its group's collectives.",
        "decided": "Sign test against the peers' median at each shared step (p < 0.01, >= 10 steps, median "
                   "excess >= 0.5 ms and >= 5 %), waiting caused by an earlier slow phase discounted; with "
                   "comm spans also by arrival order (by: arrival). Cost from the what-if model.",
        "evidence": "score, p_value, excess_ms, cost_ms, cost_pct; the comm view's last_arrival and wait_ms.",
        "docs": "docs/analysis.md#stragglers",
    },
    "restart": {
        "means": "More than one attempt: where the later attempt restarted and whether it got further.",
        "decided": "Attempts from the records' attempt field (or start order); progress = a later attempt "
                   "reached a step past the one before.",
        "evidence": "progress true/false, the steps of each attempt.",
        "docs": "docs/analysis.md#what-summarize-reports",
    },
    "desync": {
        "means": "The members of one process group issued different ops, or the same op with different "
                 "sizes or dtypes, at the same comm.seq.",
        "decided": "Members' ops matched by (group, seq); the minority side is the culprit, one finding per group.",
        "evidence": "comm.ops: the op each rank issued at that seq; the message names each side's bytes.",
        "docs": "docs/comm.md#findings",
    },
    "clock_skew": {
        "means": "A host's clock is off the reference host's by more than 10 ms at the start or end of the run.",
        "decided": "Offsets and drift estimated from the moments ranks leave the same blocking collective; "
                   "every cross-host comparison already uses aligned times.",
        "evidence": "host, offset_ms, drift_ppm, residual_ms, samples (the clock view).",
        "docs": "docs/clock.md",
    },
    "regression": {
        "means": "diff: run B is slower than run A in a phase (or on a rank), beyond noise.",
        "decided": "Per phase and per rank p50 against A's, with a significance test and thresholds.",
        "evidence": "delta_p50_pct, p_value.",
        "docs": "docs/analysis.md#diff-otel-train-diff",
    },
    "improvement": {
        "means": "diff: run B is faster than run A in a phase (or on a rank), beyond noise.",
        "decided": "As for regression, the other direction.",
        "evidence": "delta_p50_pct, p_value.",
        "docs": "docs/analysis.md#diff-otel-train-diff",
    },
}


def explain(kind: str) -> dict[str, Any]:
    """The explanation of ``kind`` (or every kind's name when unknown)."""
    key = kind.strip().lower()
    if key not in KINDS:
        return {"error": f"unknown finding kind {kind!r}", "kinds": sorted(KINDS),
                "next": [hint("explain", "one of the kinds listed", kind="hang")]}
    return {"kind": key, **KINDS[key],
            "next": [hint("findings", f"the {key} findings of a run, with evidence", run="<run>", kind=key)]}
