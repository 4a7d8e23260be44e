"""OTLP export through the OTel SDK's own exporters, batched off the training thread, with bounded shutdown."""
