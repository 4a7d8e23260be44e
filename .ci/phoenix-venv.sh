#!/usr/bin/env bash
# Creates .venv-phoenix with Arize Phoenix (an OTLP trace backend) for the integration tests in
# tests/test_phoenix.py. Phoenix pulls in a large dependency tree, so it lives in its own venv and
# never in the project's .venv. Idempotent: a working install is left alone.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${PHOENIX_VENV:-.venv-phoenix}"
PYTHON="${PYTHON:-python3}"
SPEC="${PHOENIX_SPEC:-arize-phoenix==20.26.1}"

if [ -x "$VENV/bin/phoenix" ] && "$VENV/bin/python" -c "import phoenix" 2>/dev/null; then
    exit 0
fi

"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "$SPEC"
"$VENV/bin/phoenix" --help >/dev/null
echo "Phoenix installed in $VENV ($("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("arize-phoenix"))'))"
