"""Chip health inside an island: the probes, the per-device step they watch, and injected device faults."""
