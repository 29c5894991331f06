"""One worker rank, assembled: what the main job's rank process
(``app/ranks/worker.py``) and vLLM's worker (``connector/vllm_worker.py``)
both build.

A rank is the engine seen as ``"<engine>/tp<r>"`` by its peers: its own
NIXL agent (wrapped by ``DropNotifications`` when a fault rate is set), a
``PlaneDriver`` over it, the plane's event log when a path is given (the
plane's recorder, observing first), the caller's other observers, and the
``ConnectorWorker`` that applies the scheduler's records.  What differs
between the two embeddings (the side channel's keys and port, the clock,
the machines, the KV tensors, the step loop) stays with the caller and
reaches the driver as its keyword arguments.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, TextIO

import attrs

from kvplane.statemachines.eventlog import EventLogWriter, record_to_path
from kvplane.statemachines.observe import Observer
from kvplane.transport.faults import DropNotifications

from .driver import PlaneDriver
from .ranks import rank_engine_id
from .worker import ConnectorWorker


@attrs.frozen(kw_only=True)
class RankSetup:
    """What every rank is built from, whichever engine embeds it."""

    engine_id: str  # the engine's; the rank's own is rank_engine_id(engine_id, rank)
    rank: int = 0  # with PP: stage * tp_size + tp rank
    tp_size: int = 1
    pp_size: int = 1  # pipeline stages (each a slice of the layers; such a rank serves reads only)
    drop_notifications: float = 0.0  # injected loss of received notifications (0: none)
    fault_seed: int = 0
    log_path: str | None = None  # the plane's event log (JSONL); None: none
    log_flush_every: int = 4096  # records between the writer's own flushes
    nixl_backends: tuple[str, ...] = ("UCX",)  # the NIXL agent's backends
    nixl_num_threads: int = 0  # their worker threads (the agent itself is polled)
    replicated_kv: bool = False  # every rank holds the whole KV (MLA): TpMapping.replicated


@attrs.define(kw_only=True)
class Rank:
    """A built rank's parts.  ``endpoint``: its NIXL agent (progress, timings);
    ``faults``: the fault wrapper the driver talks through, or None."""

    rank_id: str
    endpoint: Any
    faults: DropNotifications | None
    driver: PlaneDriver
    worker: ConnectorWorker
    log_writer: EventLogWriter | None
    log_stream: TextIO | None

    def close_log(self) -> None:
        """Flush and close the event log (first at shutdown: the process may
        be killed soon after it is asked to stop)."""
        if self.log_writer is not None:
            self.log_writer.close()
        if self.log_stream is not None:
            self.log_stream.close()


def nixl_endpoint(name: str, setup: RankSetup) -> Any:
    """The real agent (imported here: NIXL loads UCX), with ``setup``'s
    backends and threads."""
    from kvplane.transport.nixl_agent import NixlEndpoint

    return NixlEndpoint(name, backends=setup.nixl_backends, num_threads=setup.nixl_num_threads)


def build_rank(setup: RankSetup, *, observers: Sequence[Observer] = (),
               endpoint_factory: Callable[[str], Any] | None = None, **driver_options: Any) -> Rank:
    """Build the rank ``setup`` names.  ``driver_options``: PlaneDriver's
    keyword arguments (config, clock, host, port, curve_keypair,
    trusted_peers, insecure, deployment_keys, compat_hash, machines);
    ``observers`` observe its plane after the event log.  A rank that fails
    half-way closes what it opened."""
    rank_id = rank_engine_id(setup.engine_id, setup.rank)
    # None: the real agent with the setup's backends (a test passes a fake).
    endpoint = nixl_endpoint(rank_id, setup) if endpoint_factory is None else endpoint_factory(rank_id)
    faults = (DropNotifications(endpoint, rate=setup.drop_notifications, seed=setup.fault_seed)
              if setup.drop_notifications else None)
    stream: TextIO | None = None
    driver: PlaneDriver | None = None
    try:
        driver = PlaneDriver(engine_id=rank_id, endpoint=faults or endpoint, tp_rank=setup.rank, **driver_options)
        writer = None
        if setup.log_path is not None:
            writer, stream = record_to_path(driver.plane, setup.log_path, flush_every=setup.log_flush_every)
            stream.flush()  # the header: a log that is there from the start
        for observer in observers:
            driver.plane.observe(observer)
        worker = ConnectorWorker(driver, rank=setup.rank, tp_size=setup.tp_size, replicated_kv=setup.replicated_kv,
                                 pp_size=setup.pp_size)
    except BaseException:
        if stream is not None:
            stream.close()
        if driver is not None:
            driver.close()
        endpoint.close()
        raise
    return Rank(rank_id=rank_id, endpoint=endpoint, faults=faults, driver=driver, worker=worker, log_writer=writer,
                log_stream=stream)
