"""Span and trace ids: a private random generator, and the derived ids of one trace per step.

Step N of the ranks of one group shares a trace whose ids come from the run id, step, group and
attempt, so no rank talks to another (docs/deploy.md, "One step across groups").
"""

from __future__ import annotations

import os
import random
import threading
from typing import Any, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import INVALID_SPAN_ID, INVALID_TRACE_ID, Link, SpanContext, TraceFlags

from otel_train import context as step_context
from otel_train import schema as S
from otel_train.phases import STEP
from otel_train.resource import RunContext

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class StepTraceIdGenerator(IdGenerator):
    """Random ids from a private generator, except ids requested for the next span on this thread.

    Private, because training code seeds and restores the global ``random`` state (every rank with the
    same seed; Lightning's ``isolate_rng``), which would make the SDK's default ids collide.
    """

    def __init__(self) -> None:
        self._random = random.Random(os.urandom(16))
        self._next = threading.local()

    def request_trace_id(self, trace_id: int) -> None:
        self._next.trace_id = trace_id

    def request_span_id(self, span_id: int) -> None:
        self._next.span_id = span_id

    def generate_span_id(self) -> int:
        span_id = getattr(self._next, "span_id", None)
        if span_id is not None:
            self._next.span_id = None
            return span_id
        span_id = self._random.getrandbits(64)
        while span_id == INVALID_SPAN_ID:
            span_id = self._random.getrandbits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = getattr(self._next, "trace_id", None)
        if trace_id is not None:
            self._next.trace_id = None
            return trace_id
        trace_id = self._random.getrandbits(128)
        while trace_id == INVALID_TRACE_ID:
            trace_id = self._random.getrandbits(128)
        return trace_id


def step_span_starter(tracer: trace.Tracer, ids: StepTraceIdGenerator, ctx: RunContext, group_size: int) -> Any:
    """Step N of the ranks of one group (``rank // group_size``) shares a trace; every step span links to
    the step's anchor, rank 0's step span in group 0's trace (docs/deploy.md, "One step across groups").
    All ids come from the run id, step, group and attempt: no rank talks to another."""
    empty = Context()
    run_id, group, attempt, anchor = ctx.run_id, ctx.rank // group_size, ctx.attempt, ctx.rank == 0
    link_attrs = {S.ATTR_LINK: S.LINK_STEP_ANCHOR}

    def start_step_span(attrs: Mapping[str, Any] | None) -> trace.Span:
        step = step_context.current().step
        if step is None:
            return tracer.start_span(STEP, attributes=attrs)
        # A root span of the group's trace for this step; links to what encloses it and to the anchor.
        outer = trace.get_current_span().get_span_context()
        links = [Link(outer)] if outer.is_valid else []
        anchor_id = S.step_anchor_span_id(run_id, step, attempt)
        if anchor:
            ids.request_span_id(anchor_id)
        else:
            anchor_ctx = SpanContext(S.step_trace_id(run_id, step, 0), anchor_id, True, _SAMPLED)
            links.append(Link(anchor_ctx, link_attrs))
        ids.request_trace_id(S.step_trace_id(run_id, step, group))
        return tracer.start_span(STEP, context=empty, attributes=attrs, links=links or None)

    return start_step_span
