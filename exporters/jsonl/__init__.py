"""Crash-safe rotating JSONL sink: a SpanProcessor writing one line at span start and one at span end."""
