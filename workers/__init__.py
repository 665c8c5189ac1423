"""The island worker (trains one replica, exchanges with the coordinator); see docs/architecture.md."""
