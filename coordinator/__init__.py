"""The coordinator service (merges islands' pseudo-gradients); see docs/architecture.md."""
