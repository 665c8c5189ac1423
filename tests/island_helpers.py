"""A fake coordinator client and the pulled frames it answers with: what test_island and test_progress use to
drive the island's exchange (workers/exchange.py) with no network."""

from __future__ import annotations

import numpy as np

from dtrain import codec
from dtrain.codec import params_digest
from dtrain.net.proto import dtrain_pb2 as pb
from workers.client import PulledFrame

N = 64


def pull_frame(vec: np.ndarray) -> bytes:
    return codec.encode(codec.quantize(vec, 32), 1)


def full_pull(version: int, vec: np.ndarray, digest: str | None = None) -> PulledFrame:
    h = pb.PullHeader(kind=pb.PULL_KIND_FULL, version=version,
                      params_digest=params_digest(vec) if digest is None else digest)
    return PulledFrame(header=h, frame=pull_frame(vec))


def update_pull(base: int, version: int, values: np.ndarray, result: np.ndarray) -> PulledFrame:
    h = pb.PullHeader(kind=pb.PULL_KIND_UPDATE, version=version, base_version=base,
                      params_digest=params_digest(result))
    return PulledFrame(header=h, frame=pull_frame(values))


class FakeClient:
    """Answers pulls from a script; records each request; pushes are recorded and answered ``status``."""

    def __init__(self, answers: list[list[PulledFrame]], push_error: Exception | None = None):
        self.answers, self.push_error = list(answers), push_error
        self.pulls: list[tuple[str, int, float, bool]] = []
        self.pushes: list[str] = []
        self.status = pb.PUSH_STATUS_PENDING  # how every push is answered
        self.merged_version = 4  # the version a push is answered to go into

    def pull(self, island_id: str, have_version: int, wait_s: float = 0.0, full: bool = False,
             max_frame: int | None = None) -> list[PulledFrame]:
        self.pulls.append((island_id, have_version, wait_s, full))
        return self.answers.pop(0) if self.answers else []

    def push(self, header: pb.PushHeader, frame: bytes) -> pb.PushDeltaResponse:
        if self.push_error is not None:
            raise self.push_error
        self.pushes.append(header.push_id)
        return pb.PushDeltaResponse(status=self.status, reason="round open", merged_version=self.merged_version)


class Events(list):
    """An event log that keeps each ``(kind, fields)`` it is called with."""

    def __call__(self, kind: str, **fields: object) -> None:
        self.append((kind, fields))


def random_vec(seed: int) -> np.ndarray:
    """N standard-normal float32 values from ``seed``."""
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)
