"""Sinks for otel-train spans (installed as ``otel_train.exporters``)."""
