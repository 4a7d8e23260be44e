"""Export a run for trace viewers and OTLP backends: ``export(path, fmt, ...)`` (being moved here)."""
