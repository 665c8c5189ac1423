"""The worker's composition root: every part of an island built in one place, and closed in one place.

:func:`build_worker` builds the island's parts, each from the two or three collaborators it uses and its own config
section, and the training loop (:class:`workers.island.Worker`) from them, by keyword. What it opens (the run log,
the coordinator client, the sharded coordinator's clients, the checkpointer, the telemetry) goes on an
:class:`contextlib.ExitStack`, so it is closed in reverse order whatever happens, also when the start-up fails half
way. "One coordinator or a sharded one" is decided here, once (:func:`coordinator_link`): the loop and the run's
end see one interface (:mod:`workers.links`). :func:`run_worker` is the entry point the command line calls.

The island's progress lines go to the logger :data:`PROGRESS_LOGGER` (``dtrain.worker``, the channel the command
line shows: :class:`dtrain.runlog.RunLog`); this module's own diagnostics (what it closes) to
``logging.getLogger(__name__)``, at DEBUG.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax

from dtrain import codec
from dtrain.checkpoint import Checkpointer
from dtrain.config.sections import ROUND_AUTO, Config
from dtrain.health.faults import DeviceFault
from dtrain.models.hf import spec_of
from dtrain.net.proto import dtrain_pb2 as pb
from dtrain.net.wire import max_frame_bytes
from dtrain.runlog import ELAPSED_S, WORKER_CHANNEL, RunLog, process_dir
from dtrain.steps.outer import feedback_decay
from dtrain.telemetry import require_exporter
from dtrain.train import fragments
from dtrain.train.prepare import prepare
from workers.chip_health import ChipHealth
from workers.client import CoordinatorClient
from workers.compiling import precompile
from workers.ending import RunEnd
from workers.exchange import Downlink, EventLog, Puller, Uplink, WorkerError
from workers.heartbeat import Clock, Evaluator, Heartbeat, IslandStatus, Mailbox
from workers.hosts import HostGroup
from workers.island import TrainLog, Worker
from workers.links import CoordinatorLink, OneCoordinator, ShardedCoordinator
from workers.membership import IslandTelemetry, Membership, RetryLines, report_run_over, run_over_already
from workers.pacing import Pacer, Slowdown
from workers.push_faults import Injection
from workers.recovery import Guard, Rewinder
from workers.shard_links import ShardedPuller, ShardedUplink, ShardLinks
from workers.startup import Startup, enable_compile_cache

PROGRESS_LOGGER = WORKER_CHANNEL  # the island's progress lines (RunLog's channel; the command line shows it)
log = logging.getLogger(__name__)


def coordinator_link(cfg: Config, client: CoordinatorClient, n: int, ranges: Sequence[fragments.Range],
                     shard_ranges: Sequence[fragments.Range], inject: Sequence[Injection], events: EventLog,
                     make_client: Callable[[str], CoordinatorClient] | None = None) -> CoordinatorLink:
    """The island's link to its coordinator, the one place that decides between one coordinator and a sharded
    one: ``shard_ranges`` (``coordinator.shards`` > 1: θ's ranges, :func:`dtrain.train.fragments.plan_spec`) make
    a :class:`~workers.links.ShardedCoordinator` (a :class:`~workers.shard_links.ShardedPuller` and
    :class:`~workers.shard_links.ShardedUplink`, whose range-shard clients ``make_client(address)`` makes at
    Join); () a :class:`~workers.links.OneCoordinator`. ``ranges``: the fragments' plan (outer.fragments);
    ``inject``: push faults (testing; not with shards: a :class:`WorkerError`)."""
    def max_frame(m: int) -> int:
        return max_frame_bytes(m, cfg.codec.block)

    decay = feedback_decay(cfg)
    if len(shard_ranges) > 1:
        links = ShardLinks(cfg, client, shard_ranges, make_client)
        return ShardedCoordinator(links, ShardedPuller(links, n, max_frame, events),
                                  ShardedUplink(cfg.codec, links, events, decay, inject))
    return OneCoordinator(client, Puller(client, n, max_frame(n), events, ranges),
                          Uplink(cfg.codec, n, inject, client, events, decay, ranges))


def _on_exit(stack: contextlib.ExitStack, what: str, close: Callable[[], object]) -> None:
    """``close()`` when ``stack`` unwinds (a DEBUG line names it first)."""
    def run() -> None:
        log.debug("closing the %s", what)
        close()

    stack.callback(run)


def build_worker(stack: contextlib.ExitStack, cfg: Config, address: str, name: str, run_dir: str | Path, *,
                 quiet: bool = False, inject: Sequence[Injection] = (), device_fault: DeviceFault | None = None,
                 hosts: HostGroup | None = None, slowdown: float = 1.0, startup: Startup | None = None) -> Worker:
    """Builds one island's parts and its training loop; what it opens goes on ``stack`` (closed in reverse order
    when the stack unwinds, also if this raises half way).

    Args: ``cfg``, the run's config; ``address``, the coordinator's HOST:PORT; ``name``, the island's name;
    ``run_dir``, its folder (events, summary, checkpoints); ``quiet``, no progress lines; ``inject``, push faults
    and ``device_fault``, a faulty device inside the island (testing only: :mod:`workers.push_faults`,
    :mod:`dtrain.health.faults`); ``hosts``, the island's processes when it spans several (:mod:`workers.hosts`):
    process 0 talks to the coordinator; ``slowdown``, emulated slower hardware (:class:`workers.pacing.Slowdown`);
    ``startup``, the start timed by phase so far (:mod:`workers.startup`). Raises :class:`WorkerError` for what an
    island cannot run."""
    hosts = hosts or HostGroup.single()
    run_dir = Path(run_dir)
    # Push faults need nothing of the other processes: process 0 alone sends the island's pushes.
    if not hosts.alone and (cfg.health.enabled or device_fault is not None):
        raise WorkerError(f"an island of {hosts.count} processes cannot run chip health ([health] enabled) "
                          f"or device faults yet: run it as one process per island, or set [health] enabled = "
                          f"false")
    slow = Slowdown(slowdown)  # testing: emulated slower hardware
    require_exporter(cfg.telemetry)  # a missing extra, before anything slow
    startup = startup or Startup(None, imports=False)
    # Process 0 writes the island's events and summary; another process its own, under process-I, quietly.
    runlog = RunLog(process_dir(run_dir, hosts.index), quiet=quiet or not hosts.leader, logger=PROGRESS_LOGGER)
    _on_exit(stack, "run log", runlog.close)
    mailbox = Mailbox()

    def make_client(at: str) -> CoordinatorClient:
        return CoordinatorClient(at, cfg, on_retry=RetryLines(name, cfg, runlog), give_up=mailbox.stopping)

    client = make_client(address)
    _on_exit(stack, "coordinator client", client.close)
    telemetry = IslandTelemetry(cfg.telemetry, name, client, runlog)  # started at the first Join

    # Chip health ([health] enabled) runs the per-device step, whose metrics are the statistics probe; so does an
    # injected device fault (the fault lives in that step), detected or not.
    setup = prepare(cfg, cfg.outer.islands, per_device=cfg.health.enabled or device_fault is not None,
                    fault=device_fault)
    startup.mark("data")
    client.corpus_digest = setup.corpus.digest  # Join's fingerprint names the data: an island on other data is refused
    health = ChipHealth(cfg.health, setup.loop.model.apply, setup.loop.mesh, fault=device_fault) \
        if cfg.health.enabled else None
    guard = Guard(cfg, setup, health, device_fault, runlog, name)
    spec = spec_of(setup.built.abstract_params)  # from the shapes: θ comes from the coordinator
    n = codec.spec_size(spec)
    ranges = fragments.plan_spec(spec, cfg.outer.fragments)  # outer.fragments: one per push, in turn
    shards = cfg.coordinator.shards  # > 1: θ's ranges, each pushed to and pulled from its coordinator shard
    shard_ranges = fragments.plan_spec(spec, shards, "[coordinator] shards") if shards > 1 else ()
    link = coordinator_link(cfg, client, n, ranges, shard_ranges, inject, runlog.event, make_client)
    _on_exit(stack, "coordinator link", link.close)

    def joined(reply: pb.JoinResponse) -> None:  # each Join: the range shards' clients, then the telemetry
        link.joined(reply)
        telemetry.joined(reply)

    membership = Membership(cfg, name, client, hosts, mailbox, runlog, setup, (n, codec.spec_digest(spec)), joined)
    downlink = Downlink(link.puller, hosts, n, lambda: mailbox.island_id)
    clock = Clock()
    evaluator = Evaluator(setup, spec, downlink, mailbox, clock, runlog)

    def retime(stretched: Config) -> None:  # auto rounds: the lr schedule stretched, for what trains from it
        guard.cfg = stretched
        setup.loop.retime(stretched)

    pacer = Pacer(cfg, hosts, client.status, mailbox, retime, runlog, name)
    rewinder = Rewinder(cfg, setup, spec, guard, hosts, runlog, name, downlink.pull,
                        lambda: precompile(setup, pacer.schedule))
    train_log = TrainLog(every=cfg.run.log_every, tokens_per_step=cfg.train.batch_size * cfg.model.seq_len,
                         shard_sequences=cfg.train.shard_sequences,
                         report_rate=cfg.worker.round_seconds != ROUND_AUTO, name=name, log=runlog, clock=clock,
                         mailbox=mailbox)
    run_end = RunEnd(name=name, hosts=hosts, client=client, traffic=link, mailbox=mailbox, membership=membership,
                     downlink=downlink, evaluator=evaluator, guard=guard, uplink=link.uplink, clock=clock,
                     setup=setup, log=runlog, patience_s=cfg.coordinator.grace_s + 2 * cfg.coordinator.lease_s,
                     overlap=cfg.worker.overlap, fingerprint=cfg.fingerprint())

    def heartbeat(status: IslandStatus) -> Heartbeat:  # started by the loop once the island has joined
        return Heartbeat(client, status, mailbox, cfg.worker.heartbeat_s, runlog.event, rejoin=membership.join,
                         utilization=clock.utilization)

    ckpt = Checkpointer(run_dir / "checkpoints", keep=1)

    def close_checkpointer() -> None:  # its async writer thread would otherwise keep a failed process alive
        try:
            ckpt.close()
        except Exception as e:  # noqa: BLE001 - already failing, or done: the original outcome is what matters
            with contextlib.suppress(ValueError):  # the run's end closed the log already
                runlog.event("checkpoint_close_failed", error=str(e))

    _on_exit(stack, "checkpointer", close_checkpointer)
    _on_exit(stack, "telemetry", telemetry.shutdown)  # flushes (idempotent: a finished run's was shut down)
    _on_exit(stack, "heartbeats", mailbox.stopping.set)  # first: the island's threads stop
    return Worker(name=name, hosts=hosts, startup=startup, log=runlog, mailbox=mailbox, clock=clock, setup=setup,
                  spec=spec, ranges=ranges, link=link, downlink=downlink, membership=membership, guard=guard,
                  pacer=pacer, evaluator=evaluator, rewinder=rewinder, train_log=train_log, run_end=run_end,
                  telemetry=telemetry, slowdown=slow, ckpt=ckpt, heartbeat=heartbeat,
                  batch_size=cfg.train.batch_size, coordinator=address)


@contextlib.contextmanager
def open_worker(cfg: Config, address: str, name: str, run_dir: str | Path, **options: Any) -> Iterator[Worker]:
    """:func:`build_worker` (``options``: its keyword arguments) on a stack of its own: the island's parts are
    closed when the ``with`` block ends, whatever happens."""
    with contextlib.ExitStack() as stack:
        yield build_worker(stack, cfg, address, name, run_dir, **options)


def run_worker(cfg: Config, address: str, name: str, run_dir: str | Path, quiet: bool = False,
               inject: Sequence[Injection] = (), device_fault: DeviceFault | None = None,
               hosts: HostGroup | None = None, slowdown: float = 1.0) -> dict[str, Any]:
    """Runs one island to the end of the run (its parts closed whatever happens).

    Args: ``cfg``, the run's config; ``address``, the coordinator's HOST:PORT; ``name``, the island's name;
    ``run_dir``, its folder; ``quiet``, no progress lines; ``inject``, push faults, and ``device_fault``, a faulty
    device in the island (testing only: :mod:`workers.push_faults`); ``hosts``, this process's place in an island of
    several processes (:mod:`workers.hosts`); ``slowdown``: every chunk takes this many times its measured
    compute time (testing: emulated slower hardware, :class:`workers.pacing.Slowdown`).

    Returns the island's summary (:meth:`Worker.run`), or ``{"island", "run_over"}`` (exit 0, no training) when
    the run is over already: checked first, before the island builds or compiles anything. Raises what ended
    the island otherwise (a :class:`WorkerError`, a :class:`~workers.client.CoordinatorError`, ...)."""
    hosts = hosts or HostGroup.single()
    t0 = time.time()
    startup = Startup(enable_compile_cache(cfg, Path(run_dir)))  # before anything compiles
    jax.devices()  # JAX's backend, once: its start is a phase of its own
    startup.mark("devices")
    progress = logging.getLogger(PROGRESS_LOGGER)
    client = CoordinatorClient(address, cfg)
    try:
        def say(line: str) -> None:  # before the island's RunLog exists
            if not quiet and hosts.leader:
                progress.info(f"{name}: {line}", extra={ELAPSED_S: time.time() - t0})

        over = hosts.lead(lambda: run_over_already(client, cfg, Path(run_dir), say))  # process 0 asks
    finally:
        client.close()
    startup.mark("check")
    if over:
        return report_run_over(RunLog(process_dir(Path(run_dir), hosts.index), quiet=quiet or not hosts.leader,
                                      logger=PROGRESS_LOGGER),
                               name, over)
    with open_worker(cfg, address, name, run_dir, quiet=quiet, inject=inject, device_fault=device_fault,
                     hosts=hosts, slowdown=slowdown, startup=startup) as worker:
        return worker.run()
