"""Stable, low-cardinality phase (span) names used by the integrations (docs/integrations-torch.md,
docs/integrations-frameworks.md)."""

STEP = "step"
DATA_FETCH = "data_fetch"
BATCH_TO_DEVICE = "batch_to_device"
FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"
HOOKS_BEFORE_STEP = "hooks.before_step"
HOOKS_AFTER_STEP = "hooks.after_step"
CHECKPOINT = "checkpoint"
EVAL = "eval"
HOOK_SPAN = "hooks.callback"  # one per callback hook invocation, with trace_hooks (attributes callback, hook)

STEP_PHASES = (DATA_FETCH, HOOKS_BEFORE_STEP, BATCH_TO_DEVICE, FORWARD, BACKWARD, OPTIMIZER, HOOKS_AFTER_STEP)
