"""Training: the jitted inner loop, the DiLoCo round around it, Streaming DiLoCo's fragments, in-process runs."""
