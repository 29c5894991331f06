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


# gate_signature's memo: at most this many entries (then it starts over), and
# what a miss returns (None is a signature: the gate never declines).
_GATE_MEMO_MAX = 200_000
_UNSEEN: tuple = ("unseen",)


def gate_signature(r, now: float, offset: float, plane: ControlPlane,
                   memo: dict[tuple, tuple | None] | None = None) -> tuple | None:
    """What the READ gate reads of ``r`` (read_gate.signature: equal
    signatures decide every future gate alike), or None outside the gated
    states.  ``offset``: the clock offset to r's engine.  ``memo``: earlier
    signatures by their inputs, for planes of one config (the gate is a pure
    function of them; worlds repeat them far more often than they differ)."""
    if r.state not in GATE_STATES:
        return None
    since, last = plane.heartbeats.chain(r.engine_id)
    inputs = (r.remote_expiry, r.remote_renewable, offset, r.arrived, since, last, now)
    if memo is not None:
        sig = memo.get(inputs, _UNSEEN)
        if sig is not _UNSEEN:
            return sig
    sig = read_gate.signature(read_gate.GateInputs(
        expiry=r.remote_expiry, renewable=r.remote_renewable, clock_offset=offset, arrived=r.arrived,
        chain_since=since, chain_last=last), plane.config, now)
    if memo is not None:
        if len(memo) >= _GATE_MEMO_MAX:
            memo.clear()  # bounded: a long run's early times rarely come back
        memo[inputs] = sig
    return sig


# --------------------------------------------------------------- canonical
class PlaneParts:
    """What one plane contributes to the canonical state at its ``now``.

    Worlds share the planes a move did not touch (copy-on-write), so the
    parts of a plane are computed once and taken over by the worlds cloned
    from the one that computed them (``World.canon_parts``), until the plane
    is copied or the time moves."""

    __slots__ = ("name", "plane", "now", "requests", "engines", "any_up", "schedule", "chain_since", "renamed")

    def __init__(self, name: str, plane: ControlPlane, now: float, requests: tuple, engines: tuple, schedule: tuple,
                 chain_since: float | None):
        self.name = name  # the plane's name in the world ("D", "P")
        self.plane = plane
        self.now = now
        self.requests = requests  # per request index, the plane's signatures of it
        # (key, head, refs, waiters, tail, up) per remote engine, by key;
        # references are renamed per request order (``renamed``).
        self.engines = engines
        self.any_up = any(up for *_, up in engines)  # whether the world's observed activity enters
        self.schedule = schedule  # the heartbeat schedule's entries
        self.chain_since = chain_since  # the first send of the heartbeat chain to the other plane
        # request order -> the engines' entries, those that are up as _Awaiting
        self.renamed: dict[tuple, tuple] = {}


class _Awaiting:
    """An up engine's entry in ``PlaneParts.renamed``: all but the activity
    the world observed (``World.activity[activity_key]``), which goes last."""

    __slots__ = ("head", "activity_key")

    def __init__(self, head: tuple, activity_key: tuple[str, str]):
        self.head = head
        self.activity_key = activity_key


class Canonical:
    def __init__(self, profiles: tuple[Profile, ...], clocks: Clocks, horizon: float):
        self.profiles = profiles
        self.n = n = len(profiles)
        self.clocks = clocks
        # Past times this far back compare the same against every deadline.
        self.horizon = horizon
        self._names = [(f"d{i}", f"p{i}", f"q{i}") for i in range(n)]
        self._reads = [prof.num_remote_tokens > 0 for prof in profiles]
        # Symmetry sorts the requests by the repr of their local signature,
        # which opens with the profile's name: requests of distinct profiles
        # are always in the order of their names' reprs, and only requests
        # of one profile need their signatures compared.
        name_reprs = [repr(prof.name) for prof in profiles]
        self._name_reprs = name_reprs
        self._twins = [name_reprs.count(r) > 1 for r in name_reprs]
        self._by_name = tuple(sorted(range(n), key=lambda i: name_reprs[i]))
        self._identity = tuple(range(n))
        self._renames: dict[tuple, dict] = {}
        self._gates: dict[tuple, tuple | None] = {}  # gate_signature's memo (one plane config per exploration)
        # Per request: its profile's name and its bookkeeping keys, as key() reads them.
        self._request_marks = [(prof.name, ("D", d), ("P", q), ("P", p)) for prof, (d, p, q) in zip(profiles, self._names)]

    def _rename(self, order: tuple) -> dict:
        rename = self._renames.get(order)
        if rename is None:
            rename = self._renames[order] = {f"{pre}{old}": f"{pre}{new}" for new, old in enumerate(order)
                                             for pre in "dpq" if old != new}
        return rename

    def key(self, w: World, symmetry: bool) -> tuple:
        n = self.n
        skew = self.clocks.skew
        nd, np_ = w.t + skew["D"], w.t + skew["P"]
        D, P = w.planes["D"], w.planes["P"]
        cached = w.canon_parts
        dp = cached[0] if cached is not None else None
        if dp is None or dp.plane is not D or dp.now != nd:
            dp = self._d_parts(D, nd)
        pp = cached[1] if cached is not None else None
        if pp is None or pp.plane is not P or pp.now != np_:
            pp = self._p_parts(P, np_)
        w.canon_parts = (dp, pp)
        h = self.horizon
        awaited, reported, freed = w.awaited, w.reported, w.freed
        phase, phase2, hold = w.phase, w.phase2, w.hold_expiry
        d_requests, p_requests = dp.requests, pp.requests
        local = []
        for i, (name, d_mark, q_mark, p_mark) in enumerate(self._request_marks):
            dreq, dlease, dhb = d_requests[i]
            plea, preq, ppush, phb = p_requests[i]
            held = None
            if phase2[i] == NEW:
                v = hold[i]
                if v is not None:
                    held = v - nd
                    if held <= -h:
                        held = -h
            ph = phase[i]
            local.append((
                name, ph, phase2[i], dreq, plea, dlease, preq, ppush,
                d_mark in awaited, d_mark in reported, q_mark in awaited, q_mark in reported,
                p_mark in freed, d_mark in freed, held, dhb, phb,
                # Exported and on its way to a stalled D: the expiry D will get,
                # and how it compares with the chain D's next batches continue.
                self._exported_sig(w, i, np_, dp.chain_since) if ph == SENT else None,
            ))
        if symmetry and n > 1:
            twins, name_reprs = self._twins, self._name_reprs
            if any(twins):
                order = tuple(sorted(range(n), key=lambda i: (name_reprs[i], repr(local[i]) if twins[i] else "")))
            else:
                order = self._by_name
        else:
            order = self._identity
        shared = self._shared(dp, order, w.activity) + self._shared(pp, order, w.activity)
        net = w.canon_net
        if net is None or net[0] is not w.net or net[1] is not w.stalled or net[2] != order or net[3] != nd:
            rename = self._rename(order)
            net = w.canon_net = (w.net, w.stalled, order, nd, tuple(sorted(self._message(m, rename, w) for m in w.net)),
                                 tuple(sorted(self._message(m, rename, w) for m in w.stalled)))
        stall = None if w.stall is None else (self._rel(w.stall[0], nd), self._rel(w.stall[1], nd))
        return (tuple([local[i] for i in order]), shared, net[4], net[5], w.faults, w.aborts, w.crashed, stall,
                w.restarted is not None)

    def _shared(self, parts: PlaneParts, order: tuple, activity: dict) -> tuple:
        """One plane's remote engines (references renamed by ``order``, the
        activity the world observed) and its heartbeat schedule."""
        entries = parts.renamed.get(order)
        if entries is None:
            entries = parts.renamed[order] = self._engine_entries(parts, self._rename(order))
        if not parts.any_up:
            return entries + parts.schedule  # no activity enters: the entries are whole
        h, t = self.horizon, parts.now
        out = []
        for entry in entries:
            if entry.__class__ is _Awaiting:
                act = None
                v = activity.get(entry.activity_key)
                if v is not None:
                    act = v - t
                    if act <= -h:
                        act = -h
                entry = entry.head + (act,)
            out.append(entry)
        return tuple(out) + parts.schedule

    def _engine_entries(self, parts: PlaneParts, rename: dict) -> tuple:
        """Each engine's entry with its references renamed: whole (its
        activity None) when it is not up, else the activity still to add."""
        get = rename.get
        out: list = []
        for key, head, refs, waiters, tail, up in parts.engines:
            entry = head + (tuple(sorted((k, get(r, r)) for k, r in refs)), tuple((k, get(r, r)) for k, r in waiters)) + tail
            out.append(_Awaiting(entry, (parts.name, key)) if up else entry + (None,))
        return tuple(out)

    def _engines(self, pname: str, plane: ControlPlane, t: float) -> tuple:
        rel = self._rel
        out = []
        for key, e in sorted(plane.instances["remote_engine"].items()):
            up = e.state in ("CONNECTED", "STALE")
            out.append((key, (pname, key, e.state, rel(e.deadline, t)), tuple(e.refs.pairs()), tuple(e.waiters),
                        (e.attempts, None if up else rel(e.retry_at, t), rel(e.last_activity, t) if up else None,
                         e.clock_offset, e.notify_only, e.incarnation), up))
        return tuple(out)

    def _schedule(self, pname: str, plane: ControlPlane, t: float) -> tuple:
        # The chain's last send decides whether the next one breaks it and
        # how far it extended P's leases (the READ gate).  Its first send
        # enters only as the gate's comparisons, per request
        # (``gate_signature``): its raw age would split equivalent states.
        rel = self._rel
        return tuple((pname, "hb", eng, rel(next_at, t), ranks, rel(last_sent, t))
                     for eng, next_at, ranks, last_sent in heartbeat_schedule(plane))

    def _d_parts(self, D: ControlPlane, nd: float) -> PlaneParts:
        reqs, leases = D.instances["decode_request"], D.instances["lease"]
        requests = tuple((self._req_sig(reqs.get(d), nd, "D", D, reads), self._lease_sig(leases.get(d), nd),
                          heartbeat_registrations(D, "P", p))
                         for (d, p, _), reads in zip(self._names, self._reads))
        return PlaneParts("D", D, nd, requests, self._engines("D", D, nd), self._schedule("D", D, nd),
                          D.heartbeats.chain("P")[0])

    def _p_parts(self, P: ControlPlane, np_: float) -> PlaneParts:
        reqs, leases, pushes = P.instances["decode_request"], P.instances["lease"], P.instances["push_write"]
        requests = tuple((self._lease_sig(leases.get(p), np_), self._req_sig(reqs.get(q), np_, "P", P, True),
                          self._push_sig(pushes.get(p), np_), heartbeat_registrations(P, "D", d))
                         for d, p, q in self._names)
        return PlaneParts("P", P, np_, requests, self._engines("P", P, np_), self._schedule("P", P, np_), None)

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

    def _req_sig(self, r, now, pname, plane, reads: bool) -> tuple | None:
        """``reads``: the request will be allocated remote tokens (else it is
        a full prefix hit, which the READ gate does not apply to)."""
        if r is None:
            return None
        s = r.state
        gate = gate_signature(r, now, self.clocks.offset(pname, r.engine_id), plane, self._gates) if reads else None
        return (s, gate, self._rel(r.deadline, now), r.engine_id,
                r.expected_consumers, r.push, r.num_remote_tokens,
                None if s in ("NEW", "HEARTBEATING", "RECV_DONE", "RECV_FAILED", "RUNNING")
                else self._rel(r.recv_deadline, now),
                self._rel(r.transfer_deadline, now) if s == "READING" else None,
                self._rel(r.push_deadline, now) if s == "AWAITING_PUSH" else None,
                r.clock_offset, r.remote_incarnation)

    def _exported_sig(self, w: World, i: int, np_: float, since: float | None) -> tuple:
        # D's NewRequest will set arrived >= now, after every send so far.
        # ``since``: the first send of D's heartbeat chain to P.
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
