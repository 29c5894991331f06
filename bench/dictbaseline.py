"""The hand-written baseline: the same bookkeeping kept the way vLLM's
NixlConnector keeps it — one dict or set per situation, a method per
scheduler/worker call, no state machine.  Written for this benchmark.

It does what the ControlPlane does for the benchmarked workloads, so the
comparison is of dispatch style, not of features:

* decode side: a record per request, ``_reqs_need_recv`` (allocated, not yet
  started), ``_recving_transfers`` (READ posted), ``_done_recving`` /
  ``_failed_recving`` (what get_finished hands the scheduler), recv
  deadlines, heartbeat registration per remote engine (ids with counts,
  ranks, next send time), and per-engine references and last activity so an
  engine is never evicted while used;
* prefill side: ``_reqs_to_send`` (request -> lease expiry, insertion
  ordered so the expiry scan stops at the first live lease, as vLLM's
  does), consumers seen per request and ``_done_sending``.

With ``heap=True`` (what the dispatch targets compare against) deadlines
are kept the way the plane keeps them: one heap of (deadline, seq, id)
with lazy deletion, pushed whenever a deadline is set or moves; with
``heap=False`` they are an insertion-ordered dict scanned from the oldest
entry, vLLM-style (cheaper, but a deadline that moves earlier, a READ's
inside its recv's, may be noticed late).

World-visible effects are appended to ``out`` as small tuples, standing in
for the action objects the plane returns.

``handle(event, now)`` is the benchmarks' entry: the same event objects the
plane gets, through one call as ``ControlPlane.handle`` is called, each
sent to its method by class (the plane routes by class too).
"""
from __future__ import annotations

import heapq
import itertools

from kvplane.statemachines import events as E
from kvplane.statemachines.config import PlaneConfig


class _Req:
    __slots__ = ("engine", "remote_rid", "remote_blocks", "ranks", "consumers", "blocks", "ntok",
                 "recv_deadline", "xfer_deadline", "phase")

    def __init__(self, engine, remote_rid, remote_blocks, ranks, consumers):
        self.engine = engine
        self.remote_rid = remote_rid
        self.remote_blocks = remote_blocks
        self.ranks = ranks
        self.consumers = consumers
        self.blocks = ()
        self.ntok = 0
        self.recv_deadline = 0.0
        self.xfer_deadline = 0.0
        self.phase = 0  # 0 queued, 1 allocated, 2 waiting for engine, 3 reading, 4 done, 5 running


class _Engine:
    __slots__ = ("connected", "last_activity", "refs", "waiting")

    def __init__(self):
        self.connected = False
        self.last_activity = 0.0
        self.refs = set()
        self.waiting = []


class DictDecodeSide:
    """Decode side: what on_new_request ... request_finished keep, per step."""

    def __init__(self, config: PlaneConfig | None = None, *, index_heartbeats: bool = True, heap: bool = False):
        cfg = config or PlaneConfig()
        self.heap = heap
        self._timers: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self.recv_timeout = cfg.recv_timeout
        self.transfer_timeout = cfg.transfer_timeout
        self.hb_interval = cfg.heartbeat_interval
        self.engine_ttl = cfg.engine_ttl
        # With False the heartbeat builder finds an engine's ids by scanning
        # every request (no per-engine index), as code that only keeps
        # per-request dicts would.
        self.index_heartbeats = index_heartbeats
        self._reqs: dict[str, _Req] = {}
        self._reqs_need_recv: dict[str, tuple] = {}
        self._recving_transfers: dict[str, tuple] = {}
        self._recv_deadlines: dict[str, float] = {}
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._hb_ids: dict[str, dict[str, int]] = {}
        self._hb_ranks: dict[str, set] = {}
        self._hb_next: dict[str, float] = {}
        self._engines: dict[str, _Engine] = {}
        self.out: list[tuple] = []

    # ---- engines (the handshake itself is the transport's business)
    def _engine(self, engine_id: str) -> _Engine:
        e = self._engines.get(engine_id)
        if e is None:
            e = self._engines[engine_id] = _Engine()
            self.out.append(("handshake", engine_id))
        return e

    def handshake_ok(self, engine_id: str, now: float) -> None:
        e = self._engine(engine_id)
        e.connected = True
        e.last_activity = now
        waiting, e.waiting = e.waiting, []
        for rid in waiting:
            self._post_read(rid, self._reqs[rid], now)

    def handle(self, ev, now):
        """One event, called as ``ControlPlane.handle`` is (see the module's doc)."""
        cls = ev.__class__
        if cls is E.NewRequest:
            self.new_request(ev.request_id, ev.engine_id, ev.remote_request_id, ev.remote_block_ids, ev.remote_ranks,
                             ev.expected_consumers, now)
        elif cls is E.BlocksAllocated:
            self.blocks_allocated(ev.request_id, ev.block_ids, ev.num_remote_tokens, now)
        elif cls is E.StartLoad:
            self.start_load(ev.request_id, now)
        elif cls is E.ReadDone:
            self.read_done(ev.request_id, now)
        elif cls is E.RequestRunning:
            self.request_running(ev.request_id, now)
        elif cls is E.RequestFinished:
            self.request_finished(ev.request_id, now)
        elif cls is E.HandshakeOk:
            self.handshake_ok(ev.engine_id, now)
        else:
            raise TypeError(f"the dict baseline has no handler for {cls.__name__}")

    # ---- scheduler calls
    def new_request(self, rid, engine_id, remote_rid, remote_blocks, ranks, consumers, now):
        if rid in self._reqs:
            return
        self._reqs[rid] = _Req(engine_id, remote_rid, remote_blocks, ranks, consumers)
        # Heartbeats start at arrival: register the id for its engine.
        ids = self._hb_ids.get(engine_id)
        if ids is None:
            ids = self._hb_ids[engine_id] = {}
            self._hb_ranks[engine_id] = set()
        ids[remote_rid] = ids.get(remote_rid, 0) + 1
        self._hb_ranks[engine_id].update(ranks)
        if engine_id not in self._hb_next:
            self._hb_next[engine_id] = now + self.hb_interval
            self._engine(engine_id).refs.add(("heartbeat", engine_id))

    def blocks_allocated(self, rid, block_ids, num_remote_tokens, now):
        r = self._reqs[rid]
        r.blocks = block_ids
        r.ntok = num_remote_tokens
        r.recv_deadline = now + self.recv_timeout
        r.phase = 1
        self._set_deadline(rid, r.recv_deadline)
        self._reqs_need_recv[rid] = block_ids

    def _set_deadline(self, rid, at):
        self._recv_deadlines[rid] = at
        if self.heap:
            heapq.heappush(self._timers, (at, next(self._seq), rid))

    def start_load(self, rid, now):
        if self._reqs_need_recv.pop(rid, None) is None:
            return
        r = self._reqs[rid]
        e = self._engine(r.engine)
        e.refs.add(("decode_request", rid))
        if e.connected:
            self._post_read(rid, r, now)
        else:
            r.phase = 2
            e.waiting.append(rid)

    def _post_read(self, rid, r, now):
        r.phase = 3
        r.xfer_deadline = now + self.transfer_timeout
        self._set_deadline(rid, min(r.recv_deadline, r.xfer_deadline))
        self._recving_transfers[rid] = (r.engine, r.remote_rid)
        self.out.append(("read", rid, r.engine, r.remote_rid, r.blocks, r.remote_blocks, r.consumers))

    def read_done(self, rid, now):
        if self._recving_transfers.pop(rid, None) is None:
            return  # late completion of a released transfer
        r = self._reqs[rid]
        r.phase = 4
        del self._recv_deadlines[rid]
        self.out.append(("release_xfer", rid))
        e = self._engines[r.engine]
        e.last_activity = now
        e.refs.discard(("decode_request", rid))
        self._stop_heartbeat(r)
        self._done_recving.add(rid)

    def _stop_heartbeat(self, r):
        ids = self._hb_ids.get(r.engine)
        if ids and r.remote_rid in ids:
            ids[r.remote_rid] -= 1
            if ids[r.remote_rid] <= 0:
                del ids[r.remote_rid]

    def request_running(self, rid, now):
        r = self._reqs[rid]
        if r.phase == 4:
            r.phase = 5

    def request_finished(self, rid, now):
        r = self._reqs.pop(rid, None)
        if r is not None:
            self._done_recving.discard(rid)
            self._failed_recving.discard(rid)

    def get_finished(self):
        done, self._done_recving = self._done_recving, set()
        failed, self._failed_recving = self._failed_recving, set()
        return done, failed

    # ---- per step: deadlines and heartbeats
    def step(self, now):
        if self.heap:
            timers = self._timers
            while timers and timers[0][0] <= now:
                at, _, rid = heapq.heappop(timers)
                if self._recv_deadlines.get(rid) == at:  # else superseded or done
                    self._recv_failed(rid)
        # Recv deadlines, oldest first, stopping at the first live one (as
        # vLLM's expiry loop does; a READ's shorter deadline may be noticed late).
        while not self.heap and self._recv_deadlines:
            rid, at = next(iter(self._recv_deadlines.items()))
            if now < at:
                break
            self._recv_failed(rid)
        for engine_id, at in self._hb_next.items():
            if at <= now:
                self._send_heartbeat(engine_id, now)

    def _recv_failed(self, rid):
        del self._recv_deadlines[rid]
        r = self._reqs[rid]
        if self._recving_transfers.pop(rid, None) is not None:
            self.out.append(("release_xfer", rid, "cancel"))
        self._reqs_need_recv.pop(rid, None)
        e = self._engines.get(r.engine)
        if e is not None:
            e.refs.discard(("decode_request", rid))
        self._stop_heartbeat(r)
        r.phase = 4
        self._failed_recving.add(rid)

    def _send_heartbeat(self, engine_id, now):
        if self.index_heartbeats:
            ids = tuple(self._hb_ids.get(engine_id, ()))
        else:
            ids = tuple(r.remote_rid for r in self._reqs.values() if r.engine == engine_id and r.phase < 4)
        if ids:
            self.out.append(("hb", engine_id, tuple(sorted(self._hb_ranks[engine_id])), ids))
        self._hb_next[engine_id] = now + self.hb_interval


class DictPrefillSide:
    """Prefill side: leases as vLLM's ``_reqs_to_send`` with heartbeat extension."""

    def __init__(self, config: PlaneConfig | None = None, *, heap: bool = False):
        cfg = config or PlaneConfig()
        self.heap = heap
        self._timers: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self.lease = cfg.kv_lease_duration
        self.extension = cfg.lease_extension
        self._reqs_to_send: dict[str, float] = {}
        self._blocks: dict[str, tuple] = {}
        self._expected: dict[str, int] = {}
        self._consumers: dict[str, set] = {}
        self._done_sending: set[str] = set()
        self.out: list[tuple] = []

    def handle(self, ev, now):
        """One event, called as ``ControlPlane.handle`` is (see the module's doc)."""
        cls = ev.__class__
        if cls is E.LeaseHeartbeat:
            self.heartbeat(ev.request_id, now)
        elif cls is E.LeaseGranted:
            self.lease_granted(ev.request_id, ev.block_ids, ev.expected_consumers, now)
        elif cls is E.ConsumerDone:
            self.consumer_done(ev.request_id, ev.consumer, ev.expected_consumers, now)
        else:
            raise TypeError(f"the dict baseline has no handler for {cls.__name__}")

    def lease_granted(self, rid, block_ids, consumers, now):
        self._reqs_to_send[rid] = at = now + self.lease
        if self.heap:
            heapq.heappush(self._timers, (at, next(self._seq), rid))
        self._blocks[rid] = block_ids
        self._expected[rid] = consumers

    def heartbeat(self, rid, now):
        old = self._reqs_to_send.get(rid)
        if old is None:
            return
        new = now + self.extension
        if new > old:
            if self.heap:
                self._reqs_to_send[rid] = new
                heapq.heappush(self._timers, (new, next(self._seq), rid))
                return
            # Move to the end so the early-exit expiry scan stays (nearly) ordered.
            del self._reqs_to_send[rid]
            self._reqs_to_send[rid] = new

    def consumer_done(self, rid, consumer, expected, now):
        if rid not in self._reqs_to_send:
            return
        seen = self._consumers.get(rid)
        if seen is None:
            seen = self._consumers[rid] = set()
        if consumer in seen:
            return
        seen.add(consumer)
        if len(seen) >= self._expected[rid] or expected != self._expected[rid]:
            self._free(rid, "consumed")

    def _free(self, rid, reason):
        del self._reqs_to_send[rid]
        self._consumers.pop(rid, None)
        del self._expected[rid]
        self.out.append(("free", rid, self._blocks.pop(rid), reason))
        self._done_sending.add(rid)

    def step(self, now):
        if self.heap:
            timers = self._timers
            while timers and timers[0][0] <= now:
                at, _, rid = heapq.heappop(timers)
                if self._reqs_to_send.get(rid) == at:  # else extended or freed
                    self._free(rid, "expired")
            return
        # vLLM-style: oldest first, stop at the first lease still live.
        while self._reqs_to_send:
            rid, expires = next(iter(self._reqs_to_send.items()))
            if now < expires:
                break
            self._free(rid, "expired")
