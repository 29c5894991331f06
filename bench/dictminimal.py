"""The hand-written minimum: one request's transitions as plain code.

What ``Machine.handle`` is compared against: a record per request, a
method per event that checks the state, updates the record, sets the new
deadline on it and appends what the world must do (small tuples, standing
in for actions) to ``out``.  No routing, no timer heap, no engine or
heartbeat bookkeeping (``Machine.handle`` has none either: it returns the
timer and internal actions for the plane to carry out).  Written for this
benchmark; it covers the benchmarked paths only, the way a hand-written
connector would before its error paths are added.

``handle(record, event, now)`` is the benchmarks' entry: the same event
objects ``Machine.handle(inst, event, config, now)`` gets, through one call,
each sent to its method by class (the machine looks its row up by class).
"""
from __future__ import annotations

from kvplane.statemachines import events as E
from kvplane.statemachines.config import PlaneConfig


class MinDecodeRequest:
    __slots__ = ("key", "state", "deadline", "engine", "remote_rid", "remote_blocks", "ranks", "consumers",
                 "blocks", "ntok", "recv_deadline", "xfer_deadline")

    def __init__(self, key):
        self.key = key
        self.state = "NEW"
        self.deadline = None


class MinDecode:
    """Decode pull lifecycle: new, allocated, start load, engine ready, read done, running, finished."""

    def __init__(self, config: PlaneConfig | None = None):
        cfg = config or PlaneConfig()
        self.recv_timeout = cfg.recv_timeout
        self.transfer_timeout = cfg.transfer_timeout
        self.out: list[tuple] = []

    def handle(self, r: MinDecodeRequest, ev, now):
        """One event, called as ``Machine.handle`` is (see the module's doc)."""
        cls = ev.__class__
        if cls is E.NewRequest:
            self.new_request(r, ev.engine_id, ev.remote_request_id, ev.remote_block_ids, ev.remote_ranks,
                             ev.expected_consumers, now)
        elif cls is E.BlocksAllocated:
            self.blocks_allocated(r, ev.block_ids, ev.num_remote_tokens, now)
        elif cls is E.StartLoad:
            self.start_load(r, now)
        elif cls is E.EngineReady:
            self.engine_ready(r, now)
        elif cls is E.ReadDone:
            self.read_done(r, now)
        elif cls is E.RequestRunning:
            self.request_running(r, now)
        elif cls is E.RequestFinished:
            self.request_finished(r, now)
        else:
            raise TypeError(f"the dict minimum has no handler for {cls.__name__}")

    def new_request(self, r: MinDecodeRequest, engine, remote_rid, remote_blocks, ranks, consumers, now):
        if r.state != "NEW":
            return
        r.engine, r.remote_rid, r.remote_blocks, r.ranks, r.consumers = engine, remote_rid, remote_blocks, ranks, consumers
        r.state = "HEARTBEATING"
        self.out.append(("start_heartbeat", engine, remote_rid, ranks))

    def blocks_allocated(self, r: MinDecodeRequest, block_ids, num_remote_tokens, now):
        if r.state != "HEARTBEATING":
            raise ValueError("blocks allocated twice")
        r.blocks, r.ntok = block_ids, num_remote_tokens
        r.recv_deadline = r.deadline = now + self.recv_timeout
        r.state = "WAITING_FOR_REMOTE_KVS" if num_remote_tokens > 0 else "FULL_PREFIX_HIT"

    def start_load(self, r: MinDecodeRequest, now):
        if r.state not in ("WAITING_FOR_REMOTE_KVS", "FULL_PREFIX_HIT"):
            return
        r.state = "HANDSHAKING"
        self.out.append(("acquire_engine", r.engine, r.key))

    def engine_ready(self, r: MinDecodeRequest, now):
        if r.state != "HANDSHAKING":
            return
        r.xfer_deadline = now + self.transfer_timeout
        r.deadline = min(r.recv_deadline, r.xfer_deadline)
        r.state = "READING"
        self.out.append(("read", r.key, r.engine, r.remote_rid, r.blocks, r.remote_blocks, r.consumers))

    def read_done(self, r: MinDecodeRequest, now):
        if r.state != "READING":
            return
        r.state = "RECV_DONE"
        r.deadline = None
        out = self.out
        out.append(("release_xfer", r.key))
        out.append(("activity", r.engine))
        out.append(("stop_heartbeat", r.engine, r.remote_rid))
        out.append(("release_engine", r.engine, r.key))
        out.append(("report", r.key, True))

    def request_running(self, r: MinDecodeRequest, now):
        if r.state in ("RECV_DONE", "RECV_FAILED"):
            r.state = "RUNNING"

    def request_finished(self, r: MinDecodeRequest, now):
        if r.state in ("RECV_DONE", "RECV_FAILED", "RUNNING"):
            r.state = "RELEASED"


class MinLease:
    __slots__ = ("key", "state", "deadline", "blocks", "expected", "consumers", "bound")

    def __init__(self, key):
        self.key = key
        self.state = "PREFILLING"
        self.deadline = None


class MinPrefill:
    """Lease lifecycle: grant, heartbeats (extend), consumer done."""

    def __init__(self, config: PlaneConfig | None = None):
        cfg = config or PlaneConfig()
        self.lease = cfg.kv_lease_duration
        self.extension = cfg.lease_extension
        self.out: list[tuple] = []

    def handle(self, r: MinLease, ev, now):
        """One event, called as ``Machine.handle`` is (see the module's doc)."""
        cls = ev.__class__
        if cls is E.LeaseHeartbeat:
            self.heartbeat(r, now)
        elif cls is E.LeaseGranted:
            self.lease_granted(r, ev.block_ids, ev.expected_consumers, now)
        elif cls is E.ConsumerDone:
            self.consumer_done(r, ev.consumer, ev.expected_consumers, now)
        else:
            raise TypeError(f"the dict minimum has no handler for {cls.__name__}")

    def lease_granted(self, r: MinLease, block_ids, consumers, now):
        if r.state != "PREFILLING":
            return
        r.blocks, r.expected, r.consumers, r.bound = block_ids, consumers, frozenset(), frozenset()
        r.deadline = now + self.lease
        r.state = "LEASED"

    def heartbeat(self, r: MinLease, now):
        if r.state not in ("LEASED", "PARTIALLY_READ"):
            return
        new = now + self.extension
        if new > r.deadline:
            r.deadline = new

    def consumer_done(self, r: MinLease, consumer, expected, now):
        if r.state not in ("LEASED", "PARTIALLY_READ"):
            return
        if expected != r.expected or consumer in r.consumers:
            return
        r.consumers = r.consumers | {consumer}
        if len(r.consumers) >= r.expected:
            r.state = "RELEASED"
            r.deadline = None
            self.out.append(("free", r.key, r.blocks, "consumed"))
        else:
            r.state = "PARTIALLY_READ"
