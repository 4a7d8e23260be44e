"""``python -m otel_train.cli``: the ``otel-train`` command without the console script on PATH."""

from otel_train.cli import main

main()
