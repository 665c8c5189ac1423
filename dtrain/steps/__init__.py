"""The pure math of one step: an island's inner AdamW step and its mesh, and the coordinator's outer update."""
