"""Compiling ahead of training, so that no program the training loop calls compiles mid-round.

:func:`precompile` compiles every chunk length a :class:`~workers.rounds.Schedule` uses, the eval and the fold-in,
for an island's inner loop (at the start, and after a remesh). At the start it is done in two parts: what the
island's first chunk runs (:func:`precompile_first`), then the rest (:func:`precompile_rest`) on a thread of its
own (:class:`Deferred`) while the first chunk trains. Used by the training loop (:mod:`workers.island`) and by
recovery's remesh (:mod:`workers.recovery`, through :mod:`workers.app`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import jax

from dtrain.train.diloco import fold_in
from dtrain.train.prepare import Setup
from workers.rounds import Schedule


def precompile(setup: Setup, schedule: Schedule) -> None:
    """Compiles every chunk length the schedule uses, the eval and the fold-in, for ``setup``'s inner loop. Done
    after a remesh, and at the start in two parts (:func:`precompile_first`, then :func:`precompile_rest`): a
    first call that compiles mid-run would stall this island's round and, in sync mode, every other island."""
    precompile_first(setup, schedule)
    precompile_rest(setup, schedule)


def precompile_first(setup: Setup, schedule: Schedule) -> None:
    """Compiles what the island's first chunk runs: the state init and the scan of the schedule's first length."""
    first = schedule.first_length()
    setup.loop.precompile({first} if first else set())


def precompile_rest(setup: Setup, schedule: Schedule) -> None:
    """Compiles the scans of the schedule's other chunk lengths, the eval and the fold-in (what
    :func:`precompile_first` left)."""
    loop = setup.loop
    # the state init again too (compiled already: found in JAX's caches)
    loop.precompile(schedule.chunk_lengths() - {schedule.first_length()}, len(setup.eval_batches))
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            loop.model.abstract_params, loop.params_sharding)
    fold_in.lower(abstract, abstract, abstract).compile()


class Deferred:
    """Compiling that can wait (:func:`precompile_rest`), on a thread of its own started (:meth:`start`) once the
    island's first chunk is dispatched: the join, the pull of θ and the first chunk's dispatch, the start's
    critical path, share neither the interpreter's lock nor a core with it, and its work overlaps the first
    chunk's device time. :meth:`wait` (which starts it if nothing did) is called before anything else runs, so
    no program the loop calls compiles mid-round; were one called earlier all the same, JAX would compile it on
    the loop's thread too (jit is thread-safe): slower, never wrong. The training loop's object; the thread
    writes only ``error`` and ``seconds``."""

    def __init__(self, name: str, work: Callable[[], None]):
        self.error: BaseException | None = None
        self.seconds = 0.0

        def run() -> None:
            t0 = time.perf_counter()
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - re-raised on the loop's thread by wait()
                self.error = e
            self.seconds = time.perf_counter() - t0

        self.thread: threading.Thread | None = threading.Thread(target=run, daemon=True, name=f"{name}-compile")
        self.started = False

    def start(self) -> None:
        """Starts the thread (once)."""
        if not self.started and self.thread is not None:
            self.started = True
            self.thread.start()

    def wait(self) -> float:
        """Waits for the thread (once); returns the seconds waited, raising what the compile raised."""
        if self.thread is None:
            return 0.0
        t0 = time.perf_counter()
        self.start()
        self.thread.join()
        self.thread = None
        if self.error is not None:
            raise self.error
        return time.perf_counter() - t0
