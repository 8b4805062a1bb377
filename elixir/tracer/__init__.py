"""tracer."""
