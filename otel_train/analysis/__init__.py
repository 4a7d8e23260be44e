"""Reading trace files and analysing them; never starts tracing."""
