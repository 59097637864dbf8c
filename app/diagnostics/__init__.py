"""Diagnostics that drive the real window: a long soak session, and the streaming throughput
check."""
