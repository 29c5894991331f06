"""The canonical state: what the search hashes to merge equivalent worlds.

A tuple of each request's local signature (its instances on both planes,
scheduler phases and bookkeeping), the shared part (remote engines and the
heartbeat schedule, with each chain's last send), the network, the hung
transfers, budgets and the stall.  Times are relative to the plane's now
and clamped ``horizon`` back.  What the READ gate reads (remote expiry,
arrival, the chain's first and last send) enters as the exact comparisons
the gate makes (``gate_signature``).  With symmetry reduction the requests
are renamed so that their local signatures are sorted.

The functions at the top are the only places that read the heartbeat
batcher's internals or restate the READ gate: the seam to the batcher's
and the gate's own APIs.
"""
from __future__ import annotations

from typing import Iterator

from .. import read_gate
from ..plane import ControlPlane
from .config import Profile
from .messages import Message, PushRegistration
from .world import NEW, SENT, Clocks, World

# decode_request states in which the READ gate may still be evaluated.
GATE_STATES = ("NEW", "HEARTBEATING", "WAITING_FOR_REMOTE_KVS", "FULL_PREFIX_HIT", "HANDSHAKING")


# ------------------------------------------- seam: heartbeat batcher, READ gate
def heartbeat_schedule(plane: ControlPlane) -> Iterator[tuple[str, float | None, tuple, float | None]]:
    """(engine, next send, ranks, last send) per scheduled engine, by engine."""
    hb = plane.heartbeats
    for eng in sorted(hb.scheduled()):
        yield eng, hb.due(eng), hb.ranks(eng), hb.chain(eng)[1]


def heartbeat_registrations(plane: ControlPlane, engine: str, request_id: str) -> int | None:
    """How many times ``request_id`` is registered for ``engine``'s batches (None: not)."""
    return plane.heartbeats.registrations(engine, request_id)


def gate_signature(r, now: float, offset: float, plane: ControlPlane) -> tuple | None:
    """What the READ gate reads of ``r`` (read_gate.signature: equal
    signatures decide every future gate alike), or None outside the gated
    states.  ``offset``: the clock offset to r's engine."""
    if r.state not in GATE_STATES:
        return None
    since, last = plane.heartbeats.chain(r.engine_id)
    return read_gate.signature(read_gate.GateInputs(
        expiry=r.remote_expiry, renewable=r.remote_renewable, clock_offset=offset, arrived=r.arrived,
        chain_since=since, chain_last=last), plane.config, now)


# --------------------------------------------------------------- canonical
class Canonical:
    def __init__(self, profiles: tuple[Profile, ...], clocks: Clocks, horizon: float):
        self.profiles = profiles
        self.n = len(profiles)
        self.clocks = clocks
        # Past times this far back compare the same against every deadline.
        self.horizon = horizon

    def key(self, w: World, symmetry: bool) -> tuple:
        n = self.n
        now = self.clocks.now
        local = [self._local(w, i) for i in range(n)]
        if symmetry and n > 1:
            order = sorted(range(n), key=lambda i: repr(local[i]))
        else:
            order = list(range(n))
        rename = {}
        for new, old in enumerate(order):
            for pre in "dpq":
                rename[f"{pre}{old}"] = f"{pre}{new}"
        shared: list[tuple] = []
        for pname in ("D", "P"):
            plane = w.planes[pname]
            t = now(w, pname)
            for key, e in sorted(plane.instances["remote_engine"].items()):
                up = e.state in ("CONNECTED", "STALE")
                shared.append((pname, key, e.state, self._rel(e.deadline, t),
                               tuple(sorted((k, rename.get(r, r)) for k, r in e.refs)),
                               tuple((k, rename.get(r, r)) for k, r in e.waiters),
                               e.attempts, None if up else self._rel(e.retry_at, t),
                               self._rel(e.last_activity, t) if up else None,
                               e.clock_offset, e.notify_only,
                               self._rel(w.activity.get((pname, key)), t) if up else None))
            for eng, next_at, ranks, last_sent in heartbeat_schedule(plane):
                # The chain's last send decides whether the next one breaks it
                # and how far it extended P's leases (the READ gate).  Its
                # first send enters only as the gate's comparisons, per request
                # (``gate_signature``): its raw age would split equivalent states.
                shared.append((pname, "hb", eng, self._rel(next_at, t), ranks, self._rel(last_sent, t)))
        net = sorted(self._message(m, rename, w) for m in w.net)
        stalled = sorted(self._message(m, rename, w) for m in w.stalled)
        stall = None if w.stall is None else (self._rel(w.stall[0], now(w, "D")),
                                              self._rel(w.stall[1], now(w, "D")))
        return (tuple(local[i] for i in order), tuple(shared), tuple(net), tuple(stalled),
                w.faults, w.aborts, w.crashed, stall)

    def _message(self, m: Message, rename: dict, w: World) -> tuple:
        if isinstance(m, PushRegistration):  # D's give-up time (D's clock), relative
            return (m.KIND, m.plane, rename.get(m.request_id, m.request_id),
                    rename.get(m.remote_request_id, m.remote_request_id),
                    self._rel(m.deadline, self.clocks.now(w, "D")))
        return (m.KIND,) + tuple(rename.get(x, x) if isinstance(x, str) else x for x in m.fields())

    def _rel(self, v, now):
        if v is None:
            return None
        r = v - now
        return r if r > -self.horizon else -self.horizon

    def _local(self, w: World, i: int) -> tuple:
        d, p, q = f"d{i}", f"p{i}", f"q{i}"
        D, P = w.planes["D"], w.planes["P"]
        nd, np_ = self.clocks.now(w, "D"), self.clocks.now(w, "P")
        prof = self.profiles[i]
        return (
            prof.name, w.phase[i], w.phase2[i],
            self._req_sig(D.instances["decode_request"].get(d), nd, "D", D, prof.num_remote_tokens > 0),
            self._lease_sig(P.instances["lease"].get(p), np_),
            self._lease_sig(D.instances["lease"].get(d), nd),
            self._req_sig(P.instances["decode_request"].get(q), np_, "P", P, True),
            self._push_sig(P.instances["push_write"].get(p), np_),
            ("D", d) in w.awaited, ("D", d) in w.reported, ("P", q) in w.awaited, ("P", q) in w.reported,
            ("P", p) in w.freed, ("D", d) in w.freed,
            self._rel(w.hold_expiry[i], nd) if w.phase2[i] == NEW else None,
            heartbeat_registrations(D, "P", p), heartbeat_registrations(P, "D", d),
            # Exported and on its way to a stalled D: the expiry D will get,
            # and how it compares with the chain D's next batches continue.
            self._exported_sig(w, i, np_, D) if w.phase[i] == SENT else None,
        )

    def _req_sig(self, r, now, pname, plane, reads: bool) -> tuple | None:
        """``reads``: the request will be allocated remote tokens (else it is
        a full prefix hit, which the READ gate does not apply to)."""
        if r is None:
            return None
        s = r.state
        gate = gate_signature(r, now, self.clocks.offset(pname, r.engine_id), plane) if reads else None
        return (s, gate, self._rel(r.deadline, now), r.engine_id,
                r.expected_consumers, r.push, r.num_remote_tokens,
                None if s in ("NEW", "HEARTBEATING", "RECV_DONE", "RECV_FAILED", "RUNNING")
                else self._rel(r.recv_deadline, now),
                self._rel(r.transfer_deadline, now) if s == "READING" else None,
                self._rel(r.push_deadline, now) if s == "AWAITING_PUSH" else None,
                r.clock_offset)

    def _exported_sig(self, w: World, i: int, np_: float, D: ControlPlane) -> tuple:
        # D's NewRequest will set arrived >= now, after every send so far.
        since, _ = D.heartbeats.chain("P")
        expiry = w.p_expiry[i]
        assert expiry is not None  # SENT: P exported it with the params
        e = expiry - self.clocks.offset("D", "P")
        return (self._rel(expiry, np_), since is None or e > since)

    def _push_sig(self, push, now) -> tuple | None:
        if push is None:
            return None
        # D's give-up time, in P's clock as the push compares it.
        until = None if push.remote_deadline is None else push.remote_deadline - self.clocks.offset("P", "D")
        return (push.state, self._rel(push.deadline, now), self._rel(until, now), bool(push.block_ids),
                push.engine_id)

    def _lease_sig(self, lease, now) -> tuple | None:
        if lease is None:
            return None
        return (lease.state, self._rel(lease.deadline, now), self._rel(lease.expiry, now), lease.expected_consumers,
                tuple(sorted(lease.consumers)), lease.renewable)
