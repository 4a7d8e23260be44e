#!/usr/bin/env bash
# Creates .venv-titan with torchtitan 0.3.0 (and this package, editable) for the tests that run
# torchtitan's real trainer and structured logger (tests/titan_env.py, tests/test_titan_*.py).
# torchtitan needs datasets < 4.8, which needs huggingface-hub < 2; the transformers 5 that .venv tests
# needs huggingface-hub >= 2.4: the two cannot share a venv, so torchtitan lives in its own
# (docs/integrations-frameworks.md, "Testing on the real trainer"). torch stays pinned to the CPU wheel.
# Two phases, so that `make test` runs the long one beside the other installs: `deps` (torch and
# torchtitan, from the network) and `package` (this package, editable: after .venv's own editable install,
# as two at once would build in the same source tree). Without an argument: both. Idempotent: a working
# install is left alone.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${TITAN_VENV:-.venv-titan}"
PYTHON="${PYTHON:-python3}"
TORCH="${TORCH:-torch==2.13.0}"
PROBE="import torchtitan.observability.structured_logger, tokenizers, otel_train.titan"

PHASE="${1:-all}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
probe() { (cd / && "$VENV/bin/python" -c "$PROBE"); }  # from /: not this checkout's otel_train by its cwd

if [ -x "$VENV/bin/python" ] && probe 2>/dev/null; then
    exit 0
fi

if [ "$PHASE" != package ]; then
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "$TORCH"
    "$VENV/bin/python" -m pip install --quiet torchtitan==0.3.0 "tokenizers>=0.15" "$TORCH"
fi
if [ "$PHASE" != deps ]; then
    "$VENV/bin/python" -m pip install --quiet -e '.[torch,titan]' "$TORCH"
    probe
    echo "torchtitan installed in $VENV ($("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torchtitan"))'))"
fi
