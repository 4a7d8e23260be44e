"""The public tracing calls: the hot path. No settings parsing, no file I/O here.

The runtime installs a :class:`Tracing` object in ``_tracing`` at ``init`` and removes it at ``shutdown``;
while it is None every call returns at once (a shared no-op object for the common no-attribute case).
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from typing import Any, Callable, Mapping, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from otel_train import _report
from otel_train import context as step_context
from otel_train._report import safe_str
from otel_train._values import otel_attributes
from otel_train.phases import STEP

F = TypeVar("F", bound=Callable[..., Any])


class Tracing:
    """What the hot path needs from an initialised runtime (built by ``otel_train.runtime``)."""

    __slots__ = ("tracer", "start_step_span", "instant", "scalar", "add_event")

    def __init__(
        self,
        *,
        tracer: trace.Tracer,
        start_step_span: Callable[[Mapping[str, Any] | None], trace.Span] | None,
        instant: Callable[[str, Mapping[str, Any] | None], None],
        scalar: Callable[[Mapping[str, Any]], None],
        add_event: bool,
    ) -> None:
        self.tracer = tracer
        self.start_step_span = start_step_span  # None unless one trace per step is on
        self.instant = instant  # writes an instant record: (name, attrs)
        self.scalar = scalar  # writes a scalar record: (values)
        self.add_event = add_event  # copy instants onto the current span (for OTLP and other processors)


_tracing: Tracing | None = None
_call_site = step_context.call_site
_INVALID_SPAN = trace.INVALID_SPAN


class _Span:
    """Context manager and decorator returned by :func:`log_trace_span`."""

    __slots__ = ("_name", "_attrs", "_span", "_token")

    def __init__(self, name: str, attrs: Mapping[str, Any] | None) -> None:
        self._name = name
        self._attrs = attrs
        self._span: trace.Span | None = None
        self._token: object = None

    def __enter__(self) -> trace.Span:
        tracing = _tracing
        if tracing is None:
            return _INVALID_SPAN
        if self._span is not None:
            raise RuntimeError(f"otel_train.log_trace_span({self._name!r}) is already entered; use a new one")
        _call_site.frame = sys._getframe(1)
        try:
            if self._name == STEP and tracing.start_step_span is not None:
                span = tracing.start_step_span(self._attrs)
            else:
                span = tracing.tracer.start_span(self._name, attributes=self._attrs)
        finally:
            _call_site.frame = None
        self._span = span
        self._token = otel_context.attach(trace.set_span_in_context(span))
        return span

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        span = self._span
        if span is None:
            return False
        self._span = None
        try:
            otel_context.detach(self._token)
        finally:
            # After shutdown (or in a forked child) the span is not ours to end: shutdown already ended
            # it as incomplete, and a child must not write into its parent's file.
            if _tracing is not None:
                if exc is not None:
                    _record_error(span, exc)
                span.end()
        return False

    def __call__(self, fn: F) -> F:
        name, attrs = self._name, self._attrs
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            return _iteration_wrapper(fn, name, attrs)  # the span covers the iteration (docs/reliability.md)
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with _Span(name, attrs):
                    return await fn(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _Span(name, attrs):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class _Iteration:
    """The span of a decorated generator: it begins at the first ``next`` (or ``send``/``asend``) and
    ends when the generator is exhausted, raises, or is closed; the generator's body runs inside it at
    every resumption, and the consumer's code between two items does not."""

    __slots__ = ("_name", "_attrs", "_frame", "_span")

    def __init__(self, name: str, attrs: Mapping[str, Any] | None, frame: Any) -> None:
        self._name, self._attrs, self._frame = name, attrs, frame
        self._span: trace.Span | None = None

    def resume(self) -> object:
        """Make the span current for one resumption (starting it the first time); a token for pause()."""
        span = self._span
        if span is None:
            tracing = _tracing
            if tracing is None:
                return None
            _call_site.frame = self._frame
            try:
                span = self._span = tracing.tracer.start_span(self._name, attributes=self._attrs)
            finally:
                _call_site.frame = None
        return otel_context.attach(trace.set_span_in_context(span))

    @staticmethod
    def pause(token: object) -> None:
        if token is not None:
            otel_context.detach(token)

    def finish(self, exc: BaseException | None) -> None:
        span, self._span = self._span, _INVALID_SPAN
        if span is None or span is _INVALID_SPAN or _tracing is None:
            return
        if exc is not None and not isinstance(exc, GeneratorExit):
            _record_error(span, exc)
        span.end()


def _iteration_wrapper(fn: Any, name: str, attrs: Mapping[str, Any] | None) -> Any:
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def async_gen_wrapper(*args: Any, **kwargs: Any) -> Any:
            inner = fn(*args, **kwargs)
            it = _Iteration(name, attrs, inner.ag_frame)
            step, arg = inner.asend, None
            try:
                while True:
                    token = it.resume()
                    try:
                        item = await step(arg)
                    except StopAsyncIteration:
                        it.pause(token)
                        return
                    except BaseException as exc:
                        it.pause(token)
                        it.finish(exc)
                        raise
                    it.pause(token)
                    try:
                        arg, step = (yield item), inner.asend
                    except GeneratorExit:
                        token = it.resume()
                        try:
                            await inner.aclose()
                        finally:
                            it.pause(token)
                        raise
                    except BaseException as exc:  # thrown in by the consumer: the generator gets it
                        step, arg = inner.athrow, exc
            finally:
                it.finish(None)

        return async_gen_wrapper

    @functools.wraps(fn)
    def gen_wrapper(*args: Any, **kwargs: Any) -> Any:
        inner = fn(*args, **kwargs)
        it = _Iteration(name, attrs, inner.gi_frame)
        step, arg = inner.send, None
        try:
            while True:
                token = it.resume()
                try:
                    item = step(arg)
                except StopIteration as stop:
                    it.pause(token)
                    return stop.value
                except BaseException as exc:
                    it.pause(token)
                    it.finish(exc)
                    raise
                it.pause(token)
                try:
                    arg, step = (yield item), inner.send
                except GeneratorExit:
                    token = it.resume()
                    try:
                        inner.close()
                    finally:
                        it.pause(token)
                    raise
                except BaseException as exc:  # thrown in by the consumer: the generator gets it
                    step, arg = inner.throw, exc
        finally:
            it.finish(None)

    return gen_wrapper


class _NoopSpan(_Span):
    """Shared per name while tracing is off: entering it does nothing, decorating still traces later."""

    __slots__ = ()

    def __enter__(self) -> trace.Span:
        return _INVALID_SPAN

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        return False


_noop_spans: dict[str, _NoopSpan] = {}


def log_trace_span(name: str, /, **attributes: Any) -> _Span:
    """A span around a block (``with``) or a function (decorator; sync or ``async def``).

    The JSONL sink writes a start record at entry and an end record at exit. An exception marks the
    span as error (type and message recorded) and propagates unchanged. ``with`` yields the OTel span.
    """
    if _tracing is None and not attributes:
        noop = _noop_spans.get(name)
        if noop is None:
            if len(_noop_spans) >= 1024:  # names should be low-cardinality; don't grow without bound
                _noop_spans.clear()
            noop = _noop_spans[name] = _NoopSpan(name, None)
        return noop
    return _Span(name, attributes or None)


def log_trace_instant(name: str, /, **attributes: Any) -> None:
    """A point event inside the current span and step."""
    tracing = _tracing
    if tracing is None:
        return
    tracing.instant(name, attributes)
    if tracing.add_event:
        span = trace.get_current_span()
        if span.is_recording():
            try:
                span.add_event(name, otel_attributes(attributes))
            except Exception as exc:  # a non-str name, a span whose own processors fail
                _report.report_exception("copying an instant onto its span", exc)


def log_trace_scalar(values: Mapping[str, int | float | bool]) -> None:
    """Record numeric values (e.g. loss, lr, batch size). Non-numbers, tensors included, raise TypeError.

    Never calls ``.item()``: convert device values yourself where a sync is acceptable.
    """
    if not isinstance(values, Mapping):
        raise TypeError(f"otel_train.log_trace_scalar: values must be a mapping of str to number, "
                        f"got {type(values).__name__}")
    for key, value in values.items():
        if not isinstance(key, str):
            raise TypeError(f"otel_train.log_trace_scalar: key {key!r} must be a str")
        if type(value) not in (int, float, bool) and not _is_plain_number(value):
            raise TypeError(f"otel_train.log_trace_scalar: value of {key!r} must be an int, float or bool, "
                            f"got {type(value).__module__}.{type(value).__qualname__} "
                            "(convert tensors yourself, e.g. loss.detach().item(), where a device sync is fine)")
    tracing = _tracing
    if tracing is None:
        return
    tracing.scalar({k: _json_number(v) for k, v in values.items()})


def _record_error(span: trace.Span, exc: BaseException) -> None:
    """Mark ``span`` as failed by ``exc``; an exception whose ``__str__`` raises is still recorded."""
    for listener in tuple(step_context.error_listeners):
        try:
            listener(exc)
        except Exception as err:  # noqa: BLE001 - a listener failing must not change what the span says
            _report.report_exception("error listener", err)
    message = f"{type(exc).__name__}: {safe_str(exc)}"
    try:
        span.record_exception(exc, escaped=True)
    except Exception:  # noqa: BLE001 - the SDK calls str(exc): record what we can without it
        span.add_event("exception", {"exception.type": type(exc).__qualname__, "exception.message": safe_str(exc),
                                     "exception.escaped": "True"})
    span.set_status(Status(StatusCode.ERROR, message))


def _is_plain_number(value: object) -> bool:
    # int/float subclasses and numpy scalars are host values; anything else (a tensor) is not accepted.
    if isinstance(value, (int, float)):
        return True
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0


def _json_number(value: Any) -> int | float | bool | str:
    # JSON has no NaN/inf; a diverging loss must stay visible, so those become "nan", "inf", "-inf".
    if isinstance(value, bool):
        return value
    if isinstance(value, int) or hasattr(value, "__index__"):
        return int(value)
    number = float(value)
    if math.isfinite(number):
        return number
    return "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")


def add_step_tag(tag: str) -> None:
    """Tag the current step (e.g. ``"checkpoint"``, ``"nan_skip"``); tags clear when the step changes."""
    step_context.add_tag(tag)


def set_step(step: int, *, epoch: int | None = None, iteration: int | None = None) -> None:
    """Set the training context every following record carries."""
    if step_context.set_step(step, epoch, iteration) and _tracing is not None:
        for listener in tuple(step_context.step_listeners):
            try:
                listener(step)
            except Exception as exc:  # a telemetry source failing must not stop training
                _report.report_exception(f"step listener {getattr(listener, '__qualname__', listener)!r}", exc)


def training_step(step: int, *, epoch: int | None = None, iteration: int | None = None) -> _Span:
    """``set_step(...)`` plus a span named ``step`` around the body."""
    set_step(step, epoch=epoch, iteration=iteration)
    return log_trace_span(STEP)
