"""``worker.round_seconds = auto``, the coordinator's side: each round's length, paced so the run merges its tokens.

The islands decide round 1's length themselves (``workers.pacing``: from the rates they measured in training,
the time in which they together train the tokens of a step round) and the coordinator adopts the first length
an island reports. That length alone does not make the run train the tokens it was planned for: round 1 lasts
until the slowest island has timed a chunk (several rounds' worth of tokens from the fast islands), and the rates
measured in round 1 are not the rates of the rest of the run (islands speed up once every island trains and
nothing compiles). So from version 1 on the coordinator gives the length of the round that starts from each
version it commits (``PullHeader.round_seconds``: every island pulls the same version, so every island takes
the same length, and a round's deadline stays one moment for all):

- the run's budget is ``total_versions`` x the tokens of a step round (``outer.islands`` x H / ``outer.fragments``
  steps of ``train.base_batch`` sequences): what the same run in step rounds trains;
- the rate is the tokens merged over the last :data:`WINDOW` versions per second between their commits (for the
  first version committed, the islands' reported rates together);
- the lag is the time between two commits beyond the round length the islands were given (the push, the merge
  and the pull): the islands train through it, so it carries tokens too;
- the next round lasts (budget - tokens merged) / (versions left x rate) - lag, within [1/4, 4] x round 1's
  length (a lost island's tokens are made up by the others' longer rounds, up to 4x).

So round 1's surplus is taken off the rounds after it, and a rate that changes is followed within a few
rounds: the run ends at its ``total_versions`` having merged its budget to within what the last round's rate
predicts. Sync rounds only: in async mode every push is a version and islands do not share round boundaries,
so each keeps round 1's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WINDOW = 3  # versions the measured rate and lag are taken over
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0  # a paced round stays within these multiples of round 1's length


@dataclass
class Pace:
    """The pacing of one run (one coordinator process: a restarted coordinator starts a new one from the first
    heartbeat that reports the run's length; the islands' rates and the merged tokens it reads are the run's)."""

    base_s: float  # round 1's length, the first an island reported (StatusResponse.round_seconds)
    version_tokens: int  # tokens a version is to bring in: the budget is total_versions x this
    total_versions: int
    plan_rate: float  # tokens/s: the live islands' reported rates together when base_s was adopted (0: unknown)
    # version -> (when it was committed, tokens merged through it, the length given to the round it starts)
    commits: dict[int, tuple[float, int, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.base_s > 0:
            raise ValueError(f"pace: round 1's length must be > 0 seconds, got {self.base_s!r}")
        if self.version_tokens < 1 or self.total_versions < 1:
            raise ValueError(f"pace: needs tokens per version ({self.version_tokens}) and versions "
                             f"({self.total_versions}) >= 1")

    @property
    def budget(self) -> int:
        """Tokens the run is to merge."""
        return self.version_tokens * self.total_versions

    def committed(self, version: int, now: float, tokens_merged: int) -> float:
        """``version`` was committed at ``now`` with ``tokens_merged`` merged through it (the run's, all versions):
        the length of the round that starts from it (0 once the run is over). Recorded: :meth:`seconds_at`."""
        left = self.total_versions - version
        if left <= 0:
            seconds = 0.0
        else:
            rate, lag = self._measured(version, now, tokens_merged)
            if rate <= 0:
                seconds = self.base_s
            else:
                want = (self.budget - tokens_merged) / (left * rate) - lag
                seconds = min(max(want, MIN_FACTOR * self.base_s), MAX_FACTOR * self.base_s)
        self.commits[version] = (float(now), int(tokens_merged), seconds)
        for old in [v for v in self.commits if v < version - WINDOW]:
            del self.commits[old]
        return seconds

    def seconds_at(self, version: int) -> float:
        """The length given to the round that starts from ``version`` (0: none given: round 1's stands)."""
        got = self.commits.get(version)
        return got[2] if got else 0.0

    def _measured(self, version: int, now: float, tokens_merged: int) -> tuple[float, float]:
        """(tokens per second, seconds of lag per round) over the last :data:`WINDOW` versions committed before
        ``version``; with none, the islands' reported rates and no lag."""
        window = [v for v in self.commits if version - WINDOW <= v < version]
        if not window:
            return self.plan_rate, 0.0
        oldest = min(window)
        t0, n0, _ = self.commits[oldest]
        span = now - t0
        if span <= 0:
            return self.plan_rate, 0.0
        given = sum(self.commits[v][2] if v in self.commits else self.base_s for v in range(oldest, version))
        return (tokens_merged - n0) / span, max(span - given, 0.0) / (version - oldest)
