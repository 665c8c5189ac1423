"""The network: the one wire protocol (proto/), deadlines, auth and chunk streams, and who an island is."""
