"""The coordinator's data plane on an event loop: PushDelta and PullGlobal, whose waits cost no thread.

A push stream waits on its client between chunks, and a long-polling pull waits for the next version: on a
thread-per-call server each wait holds a thread, so a flood of idle streams or parked pulls starves the rounds
(issue 36). Here both are coroutines on the gRPC server's event loop (``grpc.aio``, run by :class:`LoopServer` on a
thread of its own): they *await* the client's next message and the next version (:class:`Bell`, rung from the
clock's commits through ``loop.call_soon_threadsafe``), and hand only CPU work and the lock-holding decisions to
bounded executors (:meth:`DataPlane.offload`): the work threads, one per core (the open round's short calls, a
chunk's CRC, checks and spool write, a pull's plan and its frames' pieces), and the wait threads, for a push's end,
whose decision may wait for a merge (``coordinator/handlers.py``: work_threads, wait_threads). Join, Heartbeat,
Status and grpc.health.v1's Check and List are plain functions the server runs on its control pool
(``grpc.aio.server``'s migration thread pool), never on the loop or the data plane's threads. What waits: an idle
stream or a parked pull is a coroutine and a few kB; a thread is held only while work is done for it (or, on a
sharded lead, while a push's parts on the other shards are claimed, and while a push that completed its round waits
for the clock's merge). The same :class:`DataPlane` and :class:`LoopServer` serve a range shard
(``coordinator/shard_plane.py``): whatever they serve is a :class:`Served`, its push path a :class:`PushPath`.

The stream reaper (``coordinator/streams.py``) cancels a stream from its own thread: the stream's ``cancel``
resolves a future the reading coroutine races against the client's next message, so a cancel never interrupts
work in the executor. A call its client cancels is cancelled by gRPC at its await; work already handed to the
executor is waited for before the record is closed (:meth:`DataPlane.offload`). Each push is ended once, however
it ends (``push_aborted`` if it broke, its record closed, its stream's place freed: handed to the executor
synchronously, so it runs even if its call is never resumed), and :meth:`DataPlane.drain`, which
:class:`LoopServer` runs after the server stops and before the loop does, ends every push still open.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent import futures
from typing import Any, Generic, Protocol, TypeVar

import grpc
import grpc.aio

from coordinator.handlers import header_problem
from coordinator.push import Upload, read_header
from coordinator.records import PushInfo
from coordinator.refusals import CallRefused
from coordinator.rounds_loop import Signal
from coordinator.streams import Pulls, PushStreams, Stream, peer_host
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import WireError

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_PULL_WAIT_S = 30.0  # a long poll waits at most this long, whatever wait_s it asked
PULL_BATCH = 8  # pull messages made per hop to the executor
_CANCELLED = "push stream cancelled by the coordinator (coordinator.stream_idle_s, stream_min_bytes_per_s, " \
             "stream_deadline_s)"


class Receiving(Protocol):
    """A push whose payload is being received: what the data plane reads of the record its push path's ``begin``
    returns (``coordinator.pending.PushRecord`` at the coordinator, ``coordinator.shard_plane.ShardPart`` on a range
    shard)."""

    info: PushInfo
    upload: Upload | None


R = TypeVar("R", bound=Receiving)


class PushPath(Protocol, Generic[R]):
    """A push's path, sans I/O, that the data plane drives (``coordinator.open_round.OpenRound``,
    ``coordinator.shard_plane.ShardRound``): its record from the header, each chunk, the reply, a broken upload's
    refusal, and the close that always comes."""

    def begin(self, h: pb.PushHeader, identity: str | None) -> pb.PushDeltaResponse | R: ...

    def chunk(self, rec: R, msg: object) -> None: ...

    def finish(self, rec: R) -> pb.PushDeltaResponse: ...

    def broke(self, rec: R) -> CallRefused: ...

    def close(self, rec: R) -> None: ...


class Clock(Protocol):
    """Whose signals the bell hears (``coordinator.rounds_loop.RoundsLoop``; a range shard's
    ``coordinator.shard_plane.ShardSignals``): the signal now, and the listeners told of each new one."""

    listeners: list[Callable[[Signal], None]]

    def signal(self) -> Signal: ...


class Identity(Protocol):
    """Who a call's caller is (``coordinator.edge.CallerIdentity``)."""

    def of(self, context: grpc.ServicerContext) -> str | None: ...


class Fragments(Protocol):
    """How many fragments a push may name (the merger's: ``outer.fragments``)."""

    @property
    def fragments(self) -> int: ...


class Served(Protocol, Generic[R]):
    """What the data plane serves PushDelta and PullGlobal of: the coordinator's service
    (``coordinator.service.CoordinatorService``) or a range shard's (``coordinator.shard_plane.ShardService``). Its
    lock guards what ``loop`` signals; the rest is what a push and a pull are checked, bounded and driven by."""

    @property
    def lock(self) -> threading.Condition: ...

    @property
    def loop(self) -> Clock: ...

    @property
    def identity(self) -> Identity: ...

    @property
    def push_streams(self) -> PushStreams: ...

    @property
    def pulls(self) -> Pulls: ...

    @property
    def tree_digest(self) -> str: ...

    @property
    def merger(self) -> Fragments: ...

    @property
    def round(self) -> PushPath[R]: ...

    def refusal(self, e: CallRefused) -> tuple[tuple[str, str], ...]: ...

    def check_pull(self, request: pb.PullRequest, identity: str | None) -> None: ...

    def pull_messages(self, request: pb.PullRequest) -> Iterator[pb.PullMessage | bytes]: ...


class Bell:
    """The clock's last :class:`coordinator.rounds_loop.Signal` as the event loop sees it, and waits on it. Rung
    from any thread (the clock's, under the service's lock: :meth:`ring`); read and waited on from the loop only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, now: Signal):
        self.loop, self.now = loop, now
        self._waiters: set[asyncio.Future[None]] = set()

    def ring(self, signal: Signal) -> None:
        """Any thread: the clock's new signal, handed to the loop (a closed loop, the server stopped: no one to
        tell)."""
        try:
            self.loop.call_soon_threadsafe(self._set, signal)
        except RuntimeError:
            pass

    def _set(self, signal: Signal) -> None:
        self.now = signal
        waiters, self._waiters = self._waiters, set()
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def wait(self, until: Callable[[Signal], bool], timeout_s: float) -> bool:
        """Waits (no thread) until ``until(signal)`` holds or ``timeout_s`` has passed; returns whether it holds."""
        deadline = self.loop.time() + timeout_s
        while not until(self.now):
            left = deadline - self.loop.time()
            if left <= 0:
                return False
            w = self.loop.create_future()
            self._waiters.add(w)
            try:
                await asyncio.wait_for(w, left)
            except TimeoutError:
                pass
            finally:
                self._waiters.discard(w)
        return True


class DataPlane(Generic[R]):
    """PushDelta and PullGlobal for ``service`` (the coordinator's, or a range shard's: :class:`Served`) on the
    running event loop, their work on ``executor`` and each push's end, which may wait for a merge, on ``waits``.
    Made (on the loop) by :class:`LoopServer`'s caller; ``close`` unhooks its bell from the clock."""

    def __init__(self, service: Served[R], executor: futures.ThreadPoolExecutor, waits: futures.ThreadPoolExecutor,
                 max_receiving: int):
        self.service, self.executor, self.waits = service, executor, waits
        self.loop = asyncio.get_running_loop()
        with service.lock:
            self.bell = Bell(self.loop, service.loop.signal())
            service.loop.listeners.append(self.bell.ring)
        # At most coordinator.max_receiving frames stream in and decode at once (coordinator/push.py): the others
        # wait here, before their first chunk is read, so their data stays with their clients.
        self.receiving = asyncio.Semaphore(max_receiving) if max_receiving > 0 else None
        # The push streams not yet ended (their record, once begun), and the ends handed to the executor: each
        # push is ended exactly once, by its own call or, for one still open when the server stops, by drain().
        self._pushes: dict[Stream, R | None] = {}
        self._ending: set[futures.Future[None]] = set()

    def close(self) -> None:
        with self.service.lock:
            if self.bell.ring in self.service.loop.listeners:
                self.service.loop.listeners.remove(self.bell.ring)

    async def offload(self, fn: Callable[..., T], *args: Any, waits: bool = False) -> T:
        """``fn(*args)`` on the work threads (``waits``: on the wait threads, for work that may wait for a merge), in
        this call's context (its CURRENT_CALL). If the call is cancelled meanwhile, the work is waited for before the
        cancellation goes on: nothing closes what it still uses."""
        pool = self.waits if waits else self.executor
        work = self.loop.run_in_executor(pool, functools.partial(contextvars.copy_context().run, fn, *args))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            await asyncio.wait([work])
            raise

    async def refuse_request(self, context: grpc.aio.ServicerContext, why: str) -> None:
        """Ends a call whose request the edge refused (``coordinator/edge.py``): INVALID_ARGUMENT, recorded as every
        refusal is."""
        await self.answer(context, CallRefused(grpc.StatusCode.INVALID_ARGUMENT, why))

    async def answer(self, context: grpc.aio.ServicerContext, e: CallRefused) -> None:
        """Ends the call with refusal ``e``, recorded and marked (``CoordinatorService.refusal``)."""
        metadata = await self.offload(self.service.refusal, e)
        if metadata:
            context.set_trailing_metadata(metadata)
        await context.abort(e.code, str(e))

    def _identity(self, context: grpc.aio.ServicerContext) -> str | None:
        return self.service.identity.of(context)  # type: ignore[arg-type]  # aio's context: the same calls

    # -- PushDelta ----------------------------------------------------------------------------------

    async def push(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> pb.PushDeltaResponse:
        """A push stream, counted for its peer host and reaped if its client stalls (``coordinator/streams.py``),
        driven through the open round's calls (``coordinator/open_round.py``)."""
        svc = self.service
        cancelled: asyncio.Future[None] = self.loop.create_future()

        def cancelling() -> None:
            if not cancelled.done():
                cancelled.set_result(None)

        def cancel() -> None:  # the reaper's thread
            self.loop.call_soon_threadsafe(cancelling)

        stream = svc.push_streams.open(peer_host(context.peer()), cancel)
        if isinstance(stream, str):
            await self.answer(context, CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, stream, busy=True))
            raise AssertionError("unreachable: abort raises")
        self._pushes[stream] = None
        rec: R | None = None
        refused: CallRefused | None = None
        broke = False
        try:
            first = await self._next(requests, stream, cancelled)
            problem = header_problem(first)
            if problem:
                raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, f"PushDelta: header.{problem}")
            try:
                h = read_header(iter([] if first is None else [first]), svc.tree_digest, svc.merger.fragments)
            except WireError as e:
                raise CallRefused(e.code, str(e)) from None
            stream.island = h.island_id  # named; counted for it once its data arrives (claim, below)
            begun = await self.offload(svc.round.begin, h, self._identity(context))
            if isinstance(begun, pb.PushDeltaResponse):
                return begun
            rec = self._pushes[stream] = begun
            await self._receive(rec, requests, stream, cancelled)
            return await self.offload(svc.round.finish, rec, waits=True)
        except _Cancelled:  # by the reaper, which recorded why
            if rec is not None:
                await self.offload(svc.round.broke, rec)  # its push_aborted event
            refused = CallRefused(grpc.StatusCode.CANCELLED, _CANCELLED, record=False)
        except asyncio.CancelledError:  # its client went away, or the server is stopping
            broke = True  # its push_aborted event, if its payload was not whole (_end)
            raise
        except CallRefused as e:
            refused = e
        finally:  # before the refusal is answered: a client told of it finds its stream's place free
            await self._ended(stream, broke)
        assert refused is not None
        await self.answer(context, refused)
        raise AssertionError("unreachable: abort raises")

    def _end(self, stream: Stream, rec: R | None, broke: bool) -> None:
        """A push's end, however it came (any thread; once per push): a broken upload's ``push_aborted`` event
        (``broke``: the call was cancelled), its record closed (``OpenRound.close``), its stream's place freed."""
        try:
            if broke and rec is not None and rec.upload is not None and not rec.upload.ended:
                self.service.round.broke(rec)
        finally:
            try:
                if rec is not None:
                    self.service.round.close(rec)
            finally:
                self.service.push_streams.close(stream)

    def _end_on_executor(self, stream: Stream, broke: bool) -> futures.Future[None] | None:
        """Hands ``stream``'s end (:meth:`_end`) to the wait threads, unless it was ended already (None); tracked
        until it is done, so that :meth:`drain` waits for it. Where the executor is shut down, or this is not the
        loop's thread running it (a call closed by the garbage collector after the loop stopped), the end runs
        here and now (None)."""
        if stream not in self._pushes:
            return None
        rec = self._pushes.pop(stream)
        try:
            running = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            running = False
        if running:
            try:
                work = self.waits.submit(contextvars.copy_context().run, self._end, stream, rec, broke)
            except RuntimeError:  # the executor is shut down
                pass
            else:
                self._ending.add(work)
                work.add_done_callback(self._ending.discard)
                return work
        self._end(stream, rec, broke)
        return None

    async def _ended(self, stream: Stream, broke: bool) -> None:
        """The push's end (:meth:`_end`) on the executor, waited for, cancelled or not. Submitted synchronously, so
        it runs even if this call never resumes; a push :meth:`drain` ended already is not ended again."""
        work = self._end_on_executor(stream, broke)
        if work is None:
            return
        waiting = asyncio.wrap_future(work, loop=self.loop)
        try:
            await asyncio.shield(waiting)
        except asyncio.CancelledError:
            await asyncio.wait([waiting])
            raise

    async def drain(self, timeout_s: float = 30.0) -> None:
        """After the server stopped (every call cancelled or done), before the loop stops: waits up to ``timeout_s``
        for the push calls to end themselves (a cancelled call ends once its work on the executor is done), ends
        any still open (``push_aborted``, record closed, spool gone) and waits for every end to be done. Without
        this, a call the loop never resumes leaves its record open and its spool on disk."""
        deadline = self.loop.time() + timeout_s
        while self._pushes and self.loop.time() < deadline:
            await asyncio.sleep(0.01)
        if self._pushes:
            log.warning("%d push call(s) still open %.0f s after the server stopped: ended now", len(self._pushes),
                        timeout_s)
            for stream in list(self._pushes):
                self._end_on_executor(stream, broke=True)
        ending = [asyncio.wrap_future(f, loop=self.loop) for f in list(self._ending)]
        if ending:
            await asyncio.wait(ending, timeout=timeout_s)

    async def _receive(self, rec: R, requests: AsyncIterator[Any], stream: Stream,
                       cancelled: asyncio.Future[None]) -> None:
        """The push's chunks, each handed to the open round on the executor; its island's stream slot taken at the
        first (RESOURCE_EXHAUSTED, busy, when its island holds its limit)."""
        assert rec.upload is not None
        if self.receiving is not None:
            await self.receiving.acquire()
        try:
            while (msg := await self._next(requests, stream, cancelled)) is not None:
                if not rec.upload.started:
                    over = self.service.push_streams.claim(stream, rec.info.island_id)
                    if over:
                        raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, over, busy=True)
                await self.offload(self.service.round.chunk, rec, msg)
        finally:
            if self.receiving is not None:
                self.receiving.release()

    async def _next(self, requests: AsyncIterator[Any], stream: Stream, cancelled: asyncio.Future[None]) -> Any:
        """The client's next message (None: it half-closed), the wait marked on ``stream`` for the reaper;
        _Cancelled if the reaper cancels the stream first."""
        streams = self.service.push_streams
        streams.waiting(stream)
        read = asyncio.ensure_future(_anext(requests))
        try:
            await asyncio.wait((read, cancelled), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            read.cancel()
            streams.arrived(stream, None, failed=True)
            raise
        if not read.done():
            read.cancel()
            streams.arrived(stream, None, failed=True)
            raise _Cancelled
        try:
            message = read.result()
        except grpc.aio.AioRpcError:  # the call broke
            streams.arrived(stream, None, failed=True)
            raise asyncio.CancelledError from None
        streams.arrived(stream, message)
        return message

    # -- PullGlobal ---------------------------------------------------------------------------------

    async def pull(self, request: pb.PullRequest,
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.PullMessage | bytes]:
        """A pull within its island's and its peer's quota; a long poll (``wait_s`` > 0 on the current version)
        waits for the next version on the bell, holding no thread."""
        svc = self.service
        try:
            if not 0 <= request.wait_s <= 3600:
                raise CallRefused(grpc.StatusCode.INVALID_ARGUMENT, f"wait_s={request.wait_s}: must be in [0, 3600]")
            await self.offload(svc.check_pull, request, self._identity(context))
            pull = svc.pulls.open(peer_host(context.peer()), request.island_id)  # long polls included
            if isinstance(pull, str):
                raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, pull, busy=True)
        except CallRefused as e:
            await self.answer(context, e)
            return
        messages: Iterator[pb.PullMessage | bytes] | None = None
        try:
            have = request.have_version
            if request.wait_s > 0 and not request.full and have == self.bell.now.version:
                await self.bell.wait(lambda s: s.version > have or s.over, min(request.wait_s, MAX_PULL_WAIT_S))
            messages = await self.offload(svc.pull_messages, request)
            while batch := await self.offload(_take, messages, PULL_BATCH):
                for m in batch:
                    yield m
        finally:
            if messages is not None and hasattr(messages, "close"):
                messages.close()  # its stream count ends (FrameStreams)
            svc.pulls.close(pull)


class _Cancelled(Exception):
    """The reaper cancelled the stream."""


async def _anext(requests: AsyncIterator[Any]) -> Any:
    try:
        return await requests.__anext__()
    except StopAsyncIteration:
        return None


def _take(messages: Iterator[T], n: int) -> list[T]:
    return list(itertools.islice(messages, n))


class LoopServer:
    """A ``grpc.aio`` server on an event loop run by a thread of its own, with the calls a thread-per-call
    server's owner makes (``start``, ``stop(grace).wait()``). ``build()`` runs on the loop and returns the server
    (its handlers, interceptors, ports: an aio server belongs to the loop it is made on)."""

    def __init__(self, pools: tuple[futures.Executor, ...] = ()):
        """``pools``: the executors the server's calls use, shut down after it stops."""
        self.pools = pools
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-loop", daemon=True)
        self._thread.start()
        self.server: grpc.aio.Server | None = None
        # Run on the loop after the server stopped and before the loop does (DataPlane.drain: the calls' ends).
        self.on_stop: list[Callable[[], Awaitable[None]]] = []
        self._stopped = threading.Event()

    def run(self, work: Awaitable[T] | Callable[[], T], timeout: float | None = 60.0) -> T:
        """``work`` (a coroutine, or a plain function) on the loop; its result."""
        if not asyncio.iscoroutine(work):
            fn = work

            async def call() -> T:
                return fn()  # type: ignore[operator]
            work = call()
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def start(self) -> None:
        assert self.server is not None
        self.run(self.server.start())

    def stop(self, grace: float | None) -> threading.Event:
        """Stops the server (calls in flight get ``grace`` seconds) and the loop; the returned event is set (its
        ``wait()`` returns at once). Idempotent."""
        if not self._stopped.is_set():
            if self.server is not None:
                try:
                    self.run(self.server.stop(grace), timeout=(grace or 0.0) + 30)
                except Exception:  # noqa: BLE001 - the loop is stopped all the same
                    log.exception("stopping the gRPC server")
            for hook in self.on_stop:
                try:
                    self.run(hook(), timeout=None)
                except Exception:  # noqa: BLE001 - the loop is stopped all the same
                    log.exception("ending the calls of the stopped gRPC server")
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            if not self._thread.is_alive():
                self.loop.close()
            for pool in self.pools:
                pool.shutdown(wait=False, cancel_futures=True)
            self._stopped.set()
        return self._stopped
