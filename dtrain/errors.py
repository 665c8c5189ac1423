"""The errors this project raises on purpose, in two families; every message names the problem.

``DtrainError`` (a ``RuntimeError``): a run cannot go on as asked; the message says why and what to do.
The CLI prints it as one line and exits 1. Its subclasses live next to what raises them:

- ``CheckpointError`` (here): a checkpoint is missing or does not match this run;
- ``dtrain.train.runs.RunError``, ``dtrain_cli.simulate_processes.SimulationError``;
- ``workers.client.CoordinatorError`` (the coordinator refused a call, or stayed unreachable past the retry
  budget), ``workers.exchange.WorkerError``.

``ValueError`` subclasses: one input refused, naming the field (or the byte) that is wrong. Whoever took the
input in decides what the refusal means:

- ``dtrain.config.sections.ConfigError``: a config file or ``--set`` override; the CLI prints it and exits 2;
- ``dtrain.data.corpus.DataError``: a data source; the CLI prints it and exits 1, like a ``DtrainError``;
- ``dtrain.schema.SchemaError``: plain data that does not fit a declared dataclass; its callers re-raise
  it as their own error (``ConfigError``, ``StateError``) with the field's path;
- ``dtrain.codec.CodecError``: a tree, vector, frame or chunk;
- ``dtrain.net.wire.WireError``: a received gRPC message or stream; ``code`` is the status to answer with;
- ``dtrain.audit.AuditError``: a run's events that cannot be audited (a merged push without its range);
- ``coordinator.records.StateError``: a request the coordinator's state machine refuses, leaving the state as
  it was; ``code`` names the gRPC status the servicer answers with.
"""


class DtrainError(RuntimeError):
    """A run cannot go on as asked; the message says why and what to do."""


class CheckpointError(DtrainError):
    """A checkpoint is missing or does not match this run."""
