"""The coordinator service (merges islands' pseudo-gradients); see README."""
