"""An engine as a serving engine runs it: one scheduler-side connector and
one worker-side connector per TP rank, over the loopback transport, on a
hand-driven clock.  Everything between the sides crosses as pickled bytes
(the records of ``connector.records``), as between processes."""
from __future__ import annotations

import contextlib
import pickle

import torch
import zmq

from kvplane.connector.rank_factory import RankSetup, build_rank
from kvplane.connector.scheduler import ConnectorScheduler
from kvplane.connector.worker import ConnectorWorker
from kvplane.statemachines.config import PlaneConfig
from kvplane.transport.loopback import LoopbackEndpoint, LoopbackFabric

BLOCKS = 16
HEADS, HEAD_ELEMS = 4, 32  # every block holds HEADS heads of HEAD_ELEMS floats, sharded over the ranks


def shutdown_all(workers) -> None:
    """Shut every worker down, whatever one of them raises (a test's teardown)."""
    for w in workers:
        try:
            w.shutdown()
        except Exception:
            pass


def through_the_wire(record):
    """What the other process gets: a copy, sharing nothing."""
    return pickle.loads(pickle.dumps(record))


def block_value(tag: int, block: int) -> torch.Tensor:
    """The whole (unsharded) block ``block`` of engine ``tag``: [HEADS * HEAD_ELEMS]."""
    return torch.arange(HEADS * HEAD_ELEMS, dtype=torch.float32) + 1000.0 * tag + 10.0 * block + 1


def rank_slice(tp: int, rank: int) -> slice:
    per = HEADS * HEAD_ELEMS // tp
    return slice(rank * per, (rank + 1) * per)


class SplitEngine:
    def __init__(self, fabric: LoopbackFabric, name: str, clock, cfg_fields: dict, tp: int, keypair, peers: dict,
                 replicated: bool = False):
        """``replicated``: every rank holds whole blocks (MLA's latent), not a head shard."""
        self.name, self.tp, self.replicated = name, tp, replicated
        self.sched = ConnectorScheduler(name, tp_size=tp, config=PlaneConfig(**cfg_fields), clock=clock,
                                        replicated_kv=replicated)
        self.workers: list[ConnectorWorker] = []
        self.kv: list[torch.Tensor] = []
        for r in range(tp):
            # The rank factory the main job and vLLM's worker use, over the loopback transport.
            worker = build_rank(RankSetup(engine_id=name, rank=r, tp_size=tp, replicated_kv=replicated),
                                endpoint_factory=lambda rank_id: LoopbackEndpoint(fabric, rank_id),
                                config=PlaneConfig(**cfg_fields), clock=clock, curve_keypair=keypair,
                                trusted_peers=peers).worker
            kv = torch.zeros(BLOCKS, HEADS * HEAD_ELEMS // (1 if replicated else tp))
            worker.register_kv_caches(kv)
            self.sched.add_rank(through_the_wire(worker.rank_info()))
            self.workers.append(worker)
            self.kv.append(kv)
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.failed: set[str] = set()
        self.reasons: dict[str, str] = {}  # why each failed recv failed
        self.dead: set[int] = set()
        self.late_meta: list[bytes] | None = None  # a list: metadata waits there until delivered

    def fill(self, tag: int, blocks, per_rank_tags: bool = False) -> None:
        """``per_rank_tags`` (replicated): rank ``r`` holds engine ``tag + r``'s
        blocks, so a reader shows which rank it read."""
        for b in blocks:
            for r in range(self.tp):
                if self.replicated:
                    self.kv[r][b] = block_value(tag + r if per_rank_tags else tag, b)
                else:
                    self.kv[r][b] = block_value(tag, b)[rank_slice(self.tp, r)]

    def whole_block(self, b: int) -> torch.Tensor:
        return torch.cat([self.kv[r][b] for r in range(self.tp)])

    def step(self) -> None:
        metas = [pickle.dumps(self.sched.build_connector_meta())]
        if self.late_meta is not None:
            self.late_meta += metas
            metas = []
        for r, w in enumerate(self.workers):
            if r in self.dead:
                continue
            for wire in metas:
                w.bind(pickle.loads(wire))
            w.step()
            self.sched.update_from_worker(through_the_wire(w.report()))
        report = self.sched.get_finished()
        self.sending |= set(report.finished_sending)
        self.recving |= set(report.finished_recving)
        self.failed |= set(report.failed_ids)
        self.reasons.update((f.request_id, f.reason) for f in report.failed_recving)

    def deliver_late_meta(self) -> None:
        metas, self.late_meta = self.late_meta or [], None
        for w in self.workers:
            for wire in metas:
                w.bind(pickle.loads(wire))

    def kill(self, rank: int) -> None:
        """The rank's process dies: its agent and memory are gone."""
        self.dead.add(rank)
        w = self.workers[rank]
        w.driver.endpoint.fabric.kill(w.driver.engine_id)
        self.sched.rank_lost(rank)

    def held(self) -> list:
        """Per live rank: what its plane still holds (engine connections aside)."""
        return [h for r, w in enumerate(self.workers) if r not in self.dead
                for h in w.driver.plane.held() if h[0] not in ("remote_engine", "heartbeat")]

    def close(self) -> None:
        shutdown_all(self.workers)


def engine_pair(p_tp: int, d_tp: int, clock, replicated: bool = False, **cfg_fields):
    fabric = LoopbackFabric()
    pk, dk = zmq.curve_keypair(), zmq.curve_keypair()
    p = SplitEngine(fabric, "P", clock, cfg_fields, p_tp, pk, {"D": dk[0]}, replicated)
    d = SplitEngine(fabric, "D", clock, cfg_fields, d_tp, dk, {"P": pk[0]}, replicated)
    return fabric, p, d


@contextlib.contextmanager
def engine_pairs(clock, *, replicated: bool = False, **cfg_fields):
    """``make(p_tp, d_tp)`` -> (fabric, P, D) on ``clock``; every engine made
    is closed on exit (a test fixture's body)."""
    made: list[SplitEngine] = []

    def make(p_tp: int, d_tp: int):
        fabric, p, d = engine_pair(p_tp, d_tp, clock, replicated, **cfg_fields)
        made.extend((p, d))
        return fabric, p, d

    try:
        yield make
    finally:
        for engine in made:
            engine.close()
