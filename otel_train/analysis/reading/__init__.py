"""Trace files to validated records, one room per job (the bottom layer of the analysis side).

- :mod:`.discovery`: where a run's files are, grouped by process, opened without blocking;
- :mod:`.types`: the typed, range-checked record structs (docs/schema.md);
- :mod:`.lines`: the one bad-line rule and the one decoder of buffers of whole lines;
- :mod:`.digests`: a process's digest and the raw scan for spans that ended after it;
- :mod:`.whole`: files at rest, read whole, by their first lines, or by their last bytes;
- :mod:`.tails`: growing files, followed as they are written.

This package imports nothing from ``otel_train`` but :mod:`otel_train.schema` and
:mod:`otel_train.sketch` (tests/test_architecture.py); :mod:`otel_train.analysis.records` re-exports
its public names.
"""
