"""Lightning integration: one ``step`` span per training batch with its phases inside.

    import otel_train as ot
    from otel_train.lightning import TraceCallback

    ot.init("runs/exp1", enabled=True)
    trainer = lightning.pytorch.Trainer(..., callbacks=[TraceCallback()])
    trainer.fit(model, datamodule)
    ot.shutdown()

Where the boundaries come from: Lightning reports every phase it runs to ``trainer.profiler``
(``start(action)`` / ``stop(action)``, strictly nested): the batch fetch, ``batch_to_device``,
``training_step``, ``backward``, each callback hook, ``save_checkpoint``. ``TraceCallback.setup``
wraps the trainer's profiler (the user's own profiler keeps receiving every call) and ``teardown``
puts it back. Callback hooks alone can't see the fetch or the end of a checkpoint write, and no
private Lightning function is patched. See docs/integrations-frameworks.md for the phase mapping.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl

from otel_train import integration_spans, phases, runtime
from otel_train.integration_spans import HeldSpan
from otel_train.phases import HOOK_SPAN

__all__ = ["TraceCallback"]


# Where each group phase starts; a group lasts until the next group starts or the step ends.
_FETCH = "train_dataloader_next"
_STEP_END_HOOK = "on_train_batch_end"
_EVAL_START_HOOKS = ("on_validation_start", "on_test_start")
_EVAL_END_HOOKS = ("on_validation_end", "on_test_end")
_GROUP_OF_HOOK = {
    "on_before_batch_transfer": phases.BATCH_TO_DEVICE,
    "batch_to_device": phases.BATCH_TO_DEVICE,
    "on_train_batch_start": phases.HOOKS_BEFORE_STEP,
    "training_step": phases.FORWARD,
    "backward": phases.BACKWARD,
    "on_before_backward": phases.BACKWARD,  # manual_backward() is reported only through this hook
    "on_before_optimizer_step": phases.OPTIMIZER,
    "on_train_batch_end": phases.HOOKS_AFTER_STEP,
}
# "[Owner]Name.hook" (callback state keys may hold dots, hook names never do).
_ACTION_RE = re.compile(r"^\[(?P<owner>[^\]]+)\](?P<key>.*)\.(?P<hook>\w+)$")
_CLASS_NAME_RE = re.compile(r"^[A-Za-z_][\w.]*?(?=\{|$)")


class _Action:
    """What one profiler action means for the trace (computed once per distinct action name)."""

    __slots__ = ("group", "opens_step", "closes_step", "opens_eval", "closes_eval", "span_name", "span_attrs")

    def __init__(self) -> None:
        self.group: str | None = None
        self.opens_step = False
        self.closes_step = False
        self.opens_eval = False
        self.closes_eval = False
        self.span_name: str | None = None
        self.span_attrs: dict[str, Any] | None = None


class _ActionTracer:
    """Turns the trainer's profiler actions into spans; holds the open ones, innermost last."""

    def __init__(self, trainer: pl.Trainer, own: pl.Callback, trace_hooks: bool) -> None:
        self._trainer = trainer
        self._trace_hooks = trace_hooks
        self._callbacks = {cb.state_key: cb for cb in trainer.callbacks if cb is not own}
        self._own_key = own.state_key
        self._actions: dict[str, _Action] = {}
        self._step: HeldSpan | None = None
        self._group: HeldSpan | None = None
        self._group_name: str | None = None
        self._eval: HeldSpan | None = None
        # (action, span, the exception being handled when it started: not this action's failure)
        self._action_spans: list[tuple[str, HeldSpan, BaseException | None]] = []
        self.guarded = integration_spans.FirstFailureGuard("lightning")

    # -- classification -------------------------------------------------------------------------

    def _classify(self, action: str) -> _Action:
        meaning = _Action()
        if action == "save_checkpoint":
            meaning.span_name = phases.CHECKPOINT
            return meaning
        if action.endswith("]." + _FETCH):
            meaning.group, meaning.opens_step = phases.DATA_FETCH, True
            return meaning
        if action == "optimizer_step":  # manual optimization reports the optimizer step bare
            meaning.group = phases.OPTIMIZER
            return meaning
        match = _ACTION_RE.match(action)
        if match is None:
            return meaning
        owner, key, hook = match["owner"], match["key"], match["hook"]
        if owner == "Strategy" and hook not in ("batch_to_device", "training_step", "backward"):
            meaning.closes_eval = hook in _EVAL_END_HOOKS  # the strategy's hook runs last
            return meaning
        meaning.group = _GROUP_OF_HOOK.get(hook)
        meaning.opens_step = hook == "on_train_batch_start"
        meaning.closes_step = owner == "LightningModule" and hook == _STEP_END_HOOK  # the module's runs last
        meaning.opens_eval = hook in _EVAL_START_HOOKS
        if owner == "Callback" and self._trace_hooks and key != self._own_key:
            callback = self._callbacks.get(key)
            if callback is None or _overrides(callback, hook):
                match_name = _CLASS_NAME_RE.match(key)
                name = type(callback).__name__ if callback is not None else (match_name[0] if match_name else key)
                meaning.span_name = HOOK_SPAN
                meaning.span_attrs = {"callback": name, "hook": hook}
        return meaning

    # -- profiler events ----------------------------------------------------------------------

    def start(self, action: str) -> None:
        meaning = self._actions.get(action)
        if meaning is None:
            meaning = self._actions[action] = self._classify(action)
        if meaning.opens_eval and self._eval is None:
            self.close_all(None)
            self._eval = HeldSpan(phases.EVAL, {"stage": _stage(self._trainer)})
        if self._eval is None and self._trainer.training:
            if meaning.opens_step and self._step is None:
                self._open_step(fetching=meaning.group == phases.DATA_FETCH)
            if meaning.group is not None and self._step is not None and not self._action_spans:
                self._switch_group(meaning.group)
        if meaning.span_name is not None:
            self._action_spans.append((action, HeldSpan(meaning.span_name, meaning.span_attrs), sys.exc_info()[1]))

    def stop(self, action: str) -> None:
        meaning = self._actions.get(action)
        if meaning is None:
            return
        if meaning.span_name is not None and self._action_spans and self._action_spans[-1][0] == action:
            # Lightning stops actions in ``finally`` blocks: a propagating exception is visible here.
            _, span, handled = self._action_spans.pop()
            exc = sys.exc_info()[1]
            span.end(None if exc is handled else exc)
        if meaning.closes_step and self._step is not None:
            self.close_step(None)
        if meaning.closes_eval and self._eval is not None and not self._action_spans:
            self._eval.end()
            self._eval = None

    # -- span bookkeeping ---------------------------------------------------------------------

    def _open_step(self, fetching: bool) -> None:
        trainer = self._trainer
        loop = trainer.fit_loop.epoch_loop
        # At the fetch the batch is not counted yet; at on_train_batch_start it is.
        iteration = loop.batch_progress.current.ready - (0 if fetching else 1)
        self._step = HeldSpan.step(trainer.global_step, epoch=trainer.current_epoch, iteration=iteration)

    def _switch_group(self, name: str) -> None:
        if name == self._group_name:
            return
        if self._group is not None:
            self._group.end()
        self._group, self._group_name = HeldSpan(name), name

    def close_step(self, exc: BaseException | None) -> None:
        """End the open group phase and step span (with ``exc`` as their error, if any)."""
        while self._action_spans:  # normally already ended by their own stop()
            self._action_spans.pop()[1].end(exc)
        if self._group is not None:
            self._group.end(exc)
            self._group, self._group_name = None, None
        if self._step is not None:
            self._step.end(exc)
            self._step = None

    def close_all(self, exc: BaseException | None) -> None:
        """End every span this tracer holds open, innermost first."""
        self.close_step(exc)
        if self._eval is not None:
            self._eval.end(exc)
            self._eval = None


class _TraceProfiler:
    """Stands in for ``trainer.profiler``: forwards every call to the user's profiler and every
    ``start``/``stop`` to the tracer too (ours outermost, so both see strictly nested actions)."""

    def __init__(self, inner: Any, tracer: _ActionTracer) -> None:
        self.inner = inner
        self.tracer = tracer

    def start(self, action_name: str) -> None:
        self.tracer.guarded(self.tracer.start, action_name)
        self.inner.start(action_name)

    def stop(self, action_name: str) -> None:
        self.inner.stop(action_name)
        self.tracer.guarded(self.tracer.stop, action_name)

    @contextlib.contextmanager
    def profile(self, action_name: str) -> Iterator[str]:
        try:
            self.start(action_name)
            yield action_name
        finally:
            self.stop(action_name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TraceCallback(pl.Callback):
    """Traces a Lightning ``Trainer``: per training batch a ``step`` span (``set_step(global_step,
    epoch=current_epoch, iteration=batch_idx)``) holding ``data_fetch``, ``batch_to_device``,
    ``hooks.before_step``, ``forward``, ``backward``, ``optimizer`` and ``hooks.after_step``;
    ``eval`` around validation/test, ``checkpoint`` around ``Trainer.save_checkpoint``; batch
    shape scalars every ``batch_stats_every`` steps; with ``trace_hooks``, a ``hooks.callback``
    span (attributes ``callback``, ``hook``) per call of a hook a callback implements.

    Does nothing while tracing is off (``ot.init`` not called or disabled)."""

    def __init__(self) -> None:
        self._tracer: _ActionTracer | None = None
        self._profiler: _TraceProfiler | None = None
        self._stats_every = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        settings = runtime.current_settings()
        if settings is None or self._profiler is not None:
            return
        self._stats_every = settings.batch_stats_every
        self._tracer = _ActionTracer(trainer, self, settings.trace_hooks)
        self._profiler = _TraceProfiler(trainer.profiler, self._tracer)
        trainer.profiler = self._profiler

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._profiler is None or self._tracer is None:
            return
        self._tracer.guarded(self._tracer.close_all, None)
        if trainer.profiler is self._profiler:
            trainer.profiler = self._profiler.inner
        self._profiler = self._tracer = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        every = self._stats_every
        if self._tracer is not None and every and trainer.global_step % every == 0:
            self._tracer.guarded(integration_spans.log_batch_stats, batch)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # An unsized loader's final fetch finds no batch: end the step it opened.
        if self._tracer is not None:
            self._tracer.guarded(self._tracer.close_step, None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning has already unwound (and stopped) its profiler actions; end our spans as errors.
        # Callback teardown hooks don't run after a failure, so give the profiler back here.
        if self._tracer is not None:
            self._tracer.guarded(self._tracer.close_all, exception)
            self.teardown(trainer, pl_module, "")


def _overrides(callback: pl.Callback, hook: str) -> bool:
    return getattr(type(callback), hook, None) is not getattr(pl.Callback, hook, None)


def _stage(trainer: pl.Trainer) -> str:
    if trainer.sanity_checking:
        return "sanity_check"
    return "test" if trainer.testing else "validate"

