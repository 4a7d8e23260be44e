"""Hugging Face Transformers integration: one ``step`` span per optimizer step with its phases.

    import otel_train as ot
    from otel_train.transformers import TraceCallback, instrument

    ot.init("runs/exp1", enabled=True)
    trainer = transformers.Trainer(..., callbacks=[TraceCallback()])
    # or: instrument(trainer)  -- the same, plus hook spans for the other callbacks (trace_hooks)
    trainer.train()
    ot.shutdown()

Boundaries (Trainer 5.x callback events; see docs/integrations-frameworks.md):
``step`` on_step_begin → on_step_end; ``forward`` forward pre/post hooks on the model (one per
micro-batch); ``backward`` from the end of a training forward to on_substep_end (accumulating) or
on_pre_optimizer_step (includes the loss scaling and gradient clipping between them);
``optimizer`` on_pre_optimizer_step → on_optimizer_step; ``eval`` from the on_step_end/on_epoch_end
that leaves ``control.should_evaluate`` set → on_evaluate; ``checkpoint`` from the moment a save is
decided (that on_step_end/on_epoch_end, or on_evaluate) → on_save. Only ``train()`` is traced: the
hooks live from on_train_begin to on_train_end, and a direct ``evaluate()`` has no start event.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import transformers

import otel_train as ot
from otel_train import integration_spans, phases, runtime
from otel_train.integration_spans import HeldSpan
from otel_train.phases import HOOK_SPAN

__all__ = ["TraceCallback", "TransformersTraceCallback", "instrument"]
_EVENTS = tuple(name for name in vars(transformers.TrainerCallback) if name.startswith("on_"))


class TransformersTraceCallback(transformers.TrainerCallback):
    """Traces a ``transformers.Trainer``: per optimizer step a ``step`` span
    (``set_step(state.global_step, epoch=int(state.epoch))``) holding ``forward`` and ``backward``
    for each micro-batch and one ``optimizer``; ``eval`` around evaluation and ``checkpoint``
    around saving, between steps; batch shape scalars every ``batch_stats_every`` steps.

    Does nothing while tracing is off (``ot.init`` not called or disabled)."""

    def __init__(self) -> None:
        self._active = False
        self._stats_every = 0
        self._stats_step: int | None = None
        self._handles: list[Any] = []
        self._forward: integration_spans.ForwardSpans | None = None
        self._step: HeldSpan | None = None
        self._phase: HeldSpan | None = None  # the open backward or optimizer span
        self._phase_name: str | None = None
        self._between: HeldSpan | None = None  # the open eval or checkpoint span
        self._between_name: str | None = None
        self._guarded = integration_spans.FirstFailureGuard("transformers")

    # -- Trainer events -----------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        settings = runtime.current_settings()
        if settings is None or model is None or self._active:
            return
        self._active = True
        self._stats_every = settings.batch_stats_every
        # Ours first: batch stats belong before the first forward span of the step.
        self._handles.append(model.register_forward_pre_hook(self._pre_forward, with_kwargs=True, prepend=True))
        self._forward = integration_spans.ForwardSpans(model)
        # Ours after ForwardSpans' post-hook, which has just ended the forward span.
        self._handles.append(model.register_forward_hook(self._post_forward))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._active:
            self._guarded(self._open_step, state)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._active:
            self._guarded(self._end_phase)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._active:
            self._guarded(self._start_phase, phases.OPTIMIZER)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._active:
            self._guarded(self._end_phase)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._active:
            self._guarded(self._close_step)
            self._guarded(self._after_step, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._active:
            self._guarded(self._after_step, control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._active:
            self._guarded(self._end_between, phases.EVAL)
            if control.should_save:
                self._guarded(self._start_between, phases.CHECKPOINT, {})

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._active:
            self._guarded(self._end_between, phases.CHECKPOINT)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._active:
            return
        self._guarded(self._close_step)
        self._guarded(self._end_between, None)
        for handle in self._handles:
            handle.remove()
        if self._forward is not None:
            self._forward.remove()
        self._handles, self._forward, self._active = [], None, False

    # -- model hooks --------------------------------------------------------------------------

    def _pre_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        if integration_spans.is_compiling():
            return
        if not module.training:
            return
        every = self._stats_every
        step = self._stats_step
        if every and self._step is not None and step is not None and step % every == 0:
            self._stats_step = None  # once per step: the first micro-batch
            self._guarded(integration_spans.log_batch_stats, kwargs or args)

    def _post_forward(self, module: Any, args: Any, output: Any) -> None:
        if integration_spans.is_compiling() or not module.training or self._step is None:
            return
        if torch.is_grad_enabled():
            self._guarded(self._start_phase, phases.BACKWARD)

    # -- span bookkeeping (innermost first when closing) ----------------------------------------

    def _open_step(self, state: Any) -> None:
        self._close_step()
        self._end_between(None)
        self._step = HeldSpan.step(state.global_step, epoch=int(state.epoch or 0))
        self._stats_step = state.global_step

    def _close_step(self) -> None:
        self._end_phase()
        if self._step is not None:
            self._step.end()
            self._step = None

    def _start_phase(self, name: str) -> None:
        self._end_phase()
        if self._step is not None:
            self._phase, self._phase_name = HeldSpan(name), name

    def _end_phase(self) -> None:
        if self._phase is not None:
            self._phase.end()
            self._phase, self._phase_name = None, None

    def _after_step(self, control: Any) -> None:
        # DefaultFlowCallback (first in the list) has just decided what happens before the next step.
        if control.should_evaluate:
            self._start_between(phases.EVAL, {"stage": "train"})
        elif control.should_save:
            self._start_between(phases.CHECKPOINT, {})

    def _start_between(self, name: str, attrs: dict[str, Any]) -> None:
        if self._between_name == name:
            return
        self._end_between(None)
        self._between, self._between_name = HeldSpan(name, attrs), name

    def _end_between(self, name: str | None) -> None:
        if self._between is not None and name in (None, self._between_name):
            self._between.end()
            self._between, self._between_name = None, None



TraceCallback = TransformersTraceCallback
"""The name README.md and docs/integrations-frameworks.md use (``otel_train.transformers.TraceCallback``)."""


def instrument(trainer: transformers.Trainer) -> TransformersTraceCallback:
    """Add a :class:`TransformersTraceCallback` to ``trainer``; with ``trace_hooks`` on, also wrap every event
    each of the trainer's other callbacks implements in a ``hooks.callback`` span (attributes
    ``callback``, ``hook``). The wrapping replaces those bound methods on the callback instances."""
    callback = TransformersTraceCallback()
    trainer.add_callback(callback)
    settings = runtime.current_settings()
    if settings is not None and settings.trace_hooks:
        for other in trainer.callback_handler.callbacks:
            if other is not callback:
                _trace_events(other)
    return callback


def _trace_events(callback: transformers.TrainerCallback) -> None:
    cls = type(callback)
    for event in _EVENTS:
        if getattr(cls, event) is getattr(transformers.TrainerCallback, event):
            continue  # the no-op default: nothing to time
        method = getattr(callback, event)
        if getattr(method, "_otel_train_traced", False):
            continue
        setattr(callback, event, _traced(method, cls.__name__, event))


def _traced(method: Callable[..., Any], callback_name: str, event: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def traced(*args: Any, **kwargs: Any) -> Any:
        with ot.log_trace_span(HOOK_SPAN, callback=callback_name, hook=event):
            return method(*args, **kwargs)

    traced._otel_train_traced = True  # type: ignore[attr-defined]
    return traced
