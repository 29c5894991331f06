"""The rank world: one plane per worker rank, as the real design runs them.

With ``ExploreConfig.ranks = (P's TP, D's TP)`` the explorer composes one
ControlPlane per worker rank ("P0", "P1", "D0", "D1"), each with its own
lease, decode_request, heartbeat and remote_engine machines:

- a request arrives: every P rank grants its own lease ``p<i>`` (expected
  consumers ``TpMapping.consumers_per_holder_rank``) and D rank r gets
  decode_request ``d<i>`` with ``remote_ranks`` = the P ranks
  ``TpMapping.sources(r)`` names, as the connector's worker does (it runs
  one decode request per source, against engine ``P/tp<k>``, with
  ``remote_ranks=(k,)``); here the engine stays ``P`` and the batch's
  ``ranks`` say which P rank it goes to;
- D rank r heartbeats, reads and notifies only those P ranks, one each
  (holder TP <= reader TP; a D rank reading two P ranks in one request
  would need two READs, which one decode_request does not post); every
  heartbeat and completion carries the D rank as its sender (each worker
  has its own agent), so a P rank's lease binds exactly the reader ranks
  of that P rank, and a refusal (``RefuseForeignSender``,
  ``RefuseWrongCount``) is a violation (``reader_rank_refused``): every
  sender in this world is a reader rank of the lease it reaches;
- D's scheduler is one: a step (allocate, start, run, finish, abort) goes
  to every live D rank in one move, and it runs a request only once the
  recvs of all D ranks are aggregated (``RankResults``); P's scheduler
  reports ``finished_sending`` once every P rank's lease ended, aggregated
  the same way (a lease ends at its FreeBlocks; a crashed rank is
  ``rank_lost``).

Faults (``RANK_FAULTS``): one message lost or duplicated (a completion
notification is one rank's), the heartbeats one D rank sends to one P rank
at a tick lost (``TickLosing``), handshakes and READs failing or hanging,
one rank crashing (``CrashRank``: its plane's memory is gone; READs against
it fail, the D ranks reading it see the engine disconnect, the other ranks
must still end their leases and the aggregates must still complete).

Checks, besides every check of the base model (READs of unheld or expired
leases, double frees, reports, protocol violations, quiescence): the
aggregated ``finished_sending`` comes only after every live P rank's lease
ended, and once; D's aggregated recv only after every live D rank reported;
at quiescence no aggregate still waits and every one was reported.

Abstractions: no stalls, no turn 2, no push (profiles "read", "hit",
"notify"); no symmetry reduction (the ranks are not interchangeable under
a mutant that singles out rank 0, and the requests keep their names).
"""
from __future__ import annotations

from typing import Callable

import msgspec

from .. import actions as A
from .. import events as E
from ..eventlog import MemoryLog
from ..machine import Machine
from ..plane import ControlPlane
from ..rank_results import Outcome, RankResults
from ..tp_mapping import TpMapping
from . import messages as msg
from .canonical import Canonical, heartbeat_registrations, heartbeat_schedule
from .checks import HELD_LEASE, Checks, Found
from .config import ExploreConfig
from .model import Model
from .moves import STEP_AT, Abort, CrashRank, Deliver, Inject, Late, Move, Schedule, Step, Tick, TickLosing
from .world import ABORTED, ARRIVED, LOADING, NEW, RUNNING, World

# RankResults or a class with its constructor and methods (a mutant).
ResultsFactory = Callable[[int], RankResults]


class RankWorld(World):
    """A World whose planes are ranks; ``down`` the crashed ones.  ``reports``:
    each side's aggregation inputs so far (("report", rank, id, ok) or
    ("lost", rank)), replayed into a fresh aggregator on each new input, so
    that a world clones without copying one.  ``sent``: how many times P's
    scheduler reported finished_sending per request; ``recv``: whether D's
    scheduler got the aggregated recv."""

    __slots__ = ("down", "reports", "sent", "recv")
    down: frozenset[str]
    reports: dict[str, tuple]
    sent: list[int]
    recv: list[bool]

    def clone(self) -> "RankWorld":
        w = type(self).__new__(type(self))  # a subclass (EngineWorld) adds its own fields
        for name in World.__slots__:
            setattr(w, name, getattr(self, name))
        w.planes = dict(self.planes)
        w.owned = set()
        w.phase, w.phase2 = list(self.phase), list(self.phase2)
        w.activity = dict(self.activity)
        w.hold_expiry, w.p_expiry = list(self.hold_expiry), list(self.p_expiry)
        w.down = self.down
        w.reports = dict(self.reports)
        w.sent, w.recv = list(self.sent), list(self.recv)
        w.ahead = None
        return w


class RankChecks(Checks):
    def lease_problem(self, w: World, src: str, dst: str, rrid: str) -> str | None:
        if dst in getattr(w, "down", ()):
            return None  # its memory went with it; the READ fails
        return super().lease_problem(w, src, dst, rrid)

    def check_read(self, w: World, src: str, dst: str, rrid: str, what: str) -> None:
        problem = self.lease_problem(w, src, dst, rrid)
        if problem is not None:
            raise Found("read_of_unheld_lease", f"READ {what} by {src} against {dst}'s lease {rrid}, {problem}")


class RankCanonical(Canonical):
    """Each rank plane's instances, by name; no renaming (see the module doc)."""

    def __init__(self, model: "RankModel", horizon: float):
        super().__init__(model.profiles, model.clocks, horizon)
        self.model = model

    def key(self, w: World, symmetry: bool) -> tuple:
        assert isinstance(w, RankWorld)
        m = self.model
        planes = []
        for pname in m.plane_names:
            plane = w.planes[pname]
            t = self.clocks.now(w, pname)
            insts: list[tuple] = []
            for i, prof in enumerate(self.profiles):
                d, p = f"d{i}", f"p{i}"
                insts.append((
                    self._req_sig(plane.instances["decode_request"].get(d), t, pname, plane,
                                  prof.num_remote_tokens > 0),
                    self._lease_sig(plane.instances["lease"].get(p), t),
                    heartbeat_registrations(plane, "P", p),
                    (pname, d) in w.awaited, (pname, d) in w.reported, (pname, p) in w.freed,
                ))
            shared: list[tuple] = []
            for key, e in sorted(plane.instances["remote_engine"].items()):
                up = e.state in ("CONNECTED", "STALE")
                shared.append((key, e.state, self._rel(e.deadline, t), tuple(sorted(e.refs.pairs())), tuple(e.waiters),
                               e.attempts, None if up else self._rel(e.retry_at, t),
                               self._rel(e.last_activity, t) if up else None, e.clock_offset, e.notify_only,
                               self._rel(w.activity.get((pname, key)), t) if up else None))
            for eng, next_at, ranks, last_sent in heartbeat_schedule(plane):
                shared.append(("hb", eng, self._rel(next_at, t), ranks, self._rel(last_sent, t)))
            planes.append((pname, pname in w.down, tuple(insts), tuple(shared)))
        net = sorted(self._message(x, {}, w) for x in w.net)
        stalled = sorted(self._message(x, {}, w) for x in w.stalled)
        return (tuple(planes), tuple(w.phase), tuple(net), tuple(stalled), w.reports["P"], w.reports["D"],
                tuple(w.sent), tuple(w.recv), w.faults, w.aborts)

    def _lease_sig(self, lease, now) -> tuple | None:
        # Heartbeats carry senders here, so they bind: which senders a lease
        # is bound to decides what it refuses next.
        sig = super()._lease_sig(lease, now)
        return None if sig is None else sig + (tuple(sorted(lease.bound)),)


def _on_every_d_rank(event_type: type) -> Callable:
    """A scheduler step that sends ``event_type(request_id=d<i>)`` to every live D rank."""
    def step(self: "RankModel", w: World, i: int) -> None:
        assert isinstance(w, RankWorld)
        for dname in self.live(w, self.d_ranks):
            self._feed(w, dname, event_type(request_id=f"d{i}"))
    return step


class RankModel(Model):
    """The composed system with one plane per worker rank (``ExploreConfig.ranks``).

    ``refusals_found``: whether a lease's refusal of a sender is a violation
    (``reader_rank_refused``); False leaves refusals to their consequences
    (a lease that can only expire), as the base model does."""

    refusals_found = True

    def __init__(self, cfg: ExploreConfig, machines: dict[str, Machine] | None = None,
                 results: ResultsFactory = RankResults):
        super().__init__(cfg, machines)
        assert cfg.ranks is not None, "RankModel needs ExploreConfig.ranks"
        for prof in self.profiles:
            if prof.turn2 or prof.push:
                raise ValueError(f"the rank world models no turn 2 and no push (profile {prof.name!r})")
        self.mapping = TpMapping(*cfg.ranks)
        self.p_ranks = tuple(f"P{r}" for r in range(self.mapping.holder_tp))
        self.d_ranks = tuple(f"D{r}" for r in range(self.mapping.reader_tp))
        self.plane_names = self.p_ranks + self.d_ranks
        self.reads_from: dict[str, str] = {}  # D rank plane -> the P rank plane it reads
        for r, dname in enumerate(self.d_ranks):
            sources = self.mapping.sources(r)
            if len(sources) != 1:
                raise ValueError(f"the rank world models one holder rank per reader rank, not {cfg.ranks}")
            self.reads_from[dname] = self.p_ranks[sources[0].holder_rank]
        self.consumers = self.mapping.consumers_per_holder_rank
        self.results = results
        for name in self.plane_names:
            self.clocks.skew[name] = self.clocks.skew[name[0]]
        self.checks = RankChecks(self.clocks, self.holds, self.ttl)
        self.canonical = RankCanonical(self, self.canonical.horizon)

    # ------------------------------------------------------------- setup
    def initial(self, record: bool = False) -> RankWorld:
        w = RankWorld()
        w.t = 0.0
        w.planes = {n: ControlPlane(self.cfg.plane, machines=self.machines) for n in self.plane_names}
        w.owned = set(self.plane_names)
        if record:
            for p in w.planes.values():
                p.recorder = MemoryLog(config=p.config)
        w.net = w.stalled = ()
        w.phase, w.phase2 = [NEW] * self.n, [NEW] * self.n
        w.faults = w.aborts = 0
        w.crashed = False
        w.restarted = None  # the rank world models no engine restart
        w.awaited = w.reported = w.freed = frozenset()
        w.activity = {}
        w.hold_expiry, w.p_expiry = [None] * self.n, [None] * self.n
        w.stall = None
        w.down = frozenset()
        w.ahead = None
        w.canon_parts = w.canon_net = None
        w.reports = {"P": (), "D": ()}
        w.sent, w.recv = [0] * self.n, [False] * self.n
        return w

    def remote_ranks(self, dname: str) -> tuple[int, ...]:
        """The P ranks D rank ``dname`` heartbeats: the ones it reads."""
        return (self.p_ranks.index(self.reads_from[dname]),)

    def live(self, w: RankWorld, names: tuple[str, ...]) -> list[str]:
        return [n for n in names if n not in w.down]

    def quiescent_problems(self, w: World) -> list[str]:
        assert isinstance(w, RankWorld)
        problems = super().quiescent_problems(w)
        for side in ("P", "D"):
            agg = self._aggregator(w, side)
            for i in range(self.n):
                rid = f"{side.lower()}{i}"
                if agg.expecting(rid):
                    problems.append(f"{side}'s scheduler still waits on ranks {list(agg.waiting_on(rid))} of {rid}")
        for i in range(self.n):
            if w.phase[i] != NEW and not w.sent[i]:
                problems.append(f"P's scheduler never reported finished_sending for p{i}")
        return problems

    # ------------------------------------------------------------- moves
    def _enabled_step(self, w: World, i: int, turn: int) -> Step | None:
        assert isinstance(w, RankWorld)
        if turn != 1:
            return None
        step = STEP_AT.get((1, w.phase[i]))
        if step is None or (step.arrival and w.down):
            return None
        if step.needs_report and not w.recv[i]:
            return None
        return step

    def _network_moves(self, w: World) -> list[Move]:
        """Deliver each distinct message in flight (or inject a fault into
        it, while faults are left), and let each stalled one arrive late."""
        cfg = self.cfg
        out: list[Move] = []
        seen = set()
        faults_left = w.faults < cfg.max_faults
        for j, m in enumerate(w.net):
            if m in seen:
                continue
            seen.add(m)
            out.append(Deliver(j))
            if faults_left:
                out.extend(Inject(f, j) for f in m.FAULTS if f in cfg.faults)
        out.extend(Late(j) for j in range(len(w.stalled)))
        return out

    def _tick_moves(self, w: RankWorld) -> list[Move]:
        """Time passes to the next deadline (with a heartbeat batch lost, while
        faults are left); the caller knows when nothing else can happen first."""
        if self._next_time(w) is None:
            return []
        out: list[Move] = [Tick()]
        if w.faults < self.cfg.max_faults and "lose" in self.cfg.faults:
            out.extend(TickLosing(src, rank) for src, rank in self._hb_due_pairs(w))
        return out

    def moves(self, w: World) -> list[Move]:
        assert isinstance(w, RankWorld)
        out: list[Move] = []
        cfg = self.cfg
        urgent = bool(w.net)
        for i, prof in enumerate(self.profiles):
            ph = w.phase[i]
            if ARRIVED <= ph <= RUNNING and w.aborts < cfg.max_aborts and not (ph == LOADING and not prof.awaiting):
                out.append(Abort(i))
            if not urgent:
                step = self._enabled_step(w, i, 1)
                if step is not None:
                    out.append(Schedule(step, i))
        out.extend(self._network_moves(w))
        faults_left = w.faults < cfg.max_faults
        if faults_left and "crash" in cfg.faults and not w.down and any(ph != NEW for ph in w.phase):
            out.extend(CrashRank(n) for n in self.plane_names)
        if not w.net:
            out.extend(self._tick_moves(w))
        return out

    def _hb_due_pairs(self, w: RankWorld) -> list[tuple[str, int]]:
        """(D rank, P rank) of each heartbeat batch the next tick sends."""
        t = self._next_time(w)
        assert t is not None
        pairs: list[tuple[str, int]] = []
        for src in self.live(w, self.d_ranks):
            hb = w.planes[src].heartbeats
            for eng in hb.engines():
                due = hb.due(eng)
                if due is not None and due - self.skew[src] <= t:
                    pairs.extend((src, r) for r in hb.ranks(eng))
        return pairs

    def describe(self, w: World, move: Move) -> str:
        at = f"(t={w.t:g})"
        if isinstance(move, CrashRank):
            return f"crash rank {move.plane} {at}"
        if isinstance(move, TickLosing):
            return (f"tick to t={self._next_time(w):g}: due timers fire, losing the heartbeats {move.src} "
                    f"sends to P rank {move.rank}")
        if isinstance(move, Abort):
            prof = self.profiles[move.request].name
            return f"D's scheduler aborts request {move.request} ({prof}) on every D rank {at}"
        return super().describe(w, move)

    def _next_time(self, w: World) -> float | None:
        best = None
        for name, p in w.planes.items():
            nd = p.next_deadline()
            if nd is not None:
                nd -= self.skew[name]
                if best is None or nd < best:
                    best = nd
        return best

    # ------------------------------------------------------------- apply
    def _rank_tick(self, w: World, move: Tick | TickLosing) -> None:
        lose = None
        if isinstance(move, TickLosing):
            w.faults += 1
            lose = (move.src, move.rank)
        t = self._next_time(w)
        assert t is not None
        w.t = t
        for pname in self.plane_names:
            nd = w.planes[pname].next_deadline()
            if nd is None or nd > self.now(w, pname):
                continue
            actions = w.plane(pname).fire_due(self.now(w, pname))
            if lose is not None and lose[0] == pname:
                self._emit_losing(w, pname, actions, lose[1])
            else:
                self._emit(w, pname, actions)

    def _emit_losing(self, w: World, pname: str, actions, rank: int) -> None:
        for a in actions:
            if isinstance(a, A.SendHeartbeat):
                a = msgspec.structs.replace(a, ranks=tuple(r for r in a.ranks if r != rank))
            self._emit(w, pname, [a])

    def _abort_all(self, w: World, move: Abort) -> None:
        assert isinstance(w, RankWorld)
        w.aborts += 1
        w.phase[move.request] = ABORTED
        for dname in self.live(w, self.d_ranks):
            self._feed(w, dname, E.Abort(request_id=f"d{move.request}"))

    def _crash_rank(self, w: World, move: CrashRank) -> None:
        assert isinstance(w, RankWorld)
        w.faults += 1
        dead = move.plane
        w.down = w.down | {dead}
        w.planes[dead] = ControlPlane(self.cfg.plane, machines=self.machines)
        w.owned.add(dead)
        net: list[msg.Message] = []
        for m in w.net + w.stalled:
            if isinstance(m, msg.Read) and m.engine == dead:
                net.append(msg.ReadFailed(m.plane, m.request_id))  # the transport sees the peer die
            elif m.plane != dead:  # what its loop (or its posted READs) would have handled died with it
                net.append(m)
        if dead in self.p_ranks:
            net.extend(msg.Disconnect(d, "P") for d in self.live(w, self.d_ranks) if self.reads_from[d] == dead)
        w.net = tuple(net)
        w.stalled = ()
        w.awaited = frozenset(k for k in w.awaited if k[0] != dead)
        w.reported = frozenset(k for k in w.reported if k[0] != dead)
        w.activity = {k: v for k, v in w.activity.items() if k[0] != dead}
        side = dead[0]
        self._aggregate(w, side, ("lost", int(dead[1:])))

    _APPLY = {**Model._APPLY, Tick: _rank_tick, TickLosing: _rank_tick, Abort: _abort_all,
              CrashRank: _crash_rank}

    # ------------------------------------------------------- aggregation
    def _aggregator(self, w: RankWorld, side: str) -> RankResults:
        agg = self.results(len(self.p_ranks if side == "P" else self.d_ranks))
        for x in w.reports[side]:
            self._step_aggregator(agg, x)
        return agg

    @staticmethod
    def _step_aggregator(agg, x: tuple) -> list[Outcome]:
        if x[0] == "expect":
            agg.expect(x[1])
            return []
        if x[0] == "lost":
            return agg.rank_lost(x[1])
        done = agg.report(x[1], x[2], ok=x[3])
        return [] if done is None else [done]

    def _aggregate(self, w: RankWorld, side: str, x: tuple) -> None:
        """Feed one input to ``side``'s scheduler's aggregator; act on what completes."""
        agg = self._aggregator(w, side)
        w.reports = {**w.reports, side: w.reports[side] + (x,)}
        for out in self._step_aggregator(agg, x):
            i = int(out.request_id[1:])
            if side == "P":
                self._finished_sending(w, i)
            else:
                self._finished_recving(w, i)

    def _finished_sending(self, w: RankWorld, i: int) -> None:
        p = f"p{i}"
        w.sent[i] += 1
        if w.sent[i] > 1:
            raise Found("finished_sending_twice", f"P's scheduler reported finished_sending for {p} twice")
        for pname in self.live(w, self.p_ranks):
            lease = w.planes[pname].instances["lease"].get(p)
            if lease is not None and (lease.state in HELD_LEASE or lease.state == "PREFILLING"):
                raise Found("finished_sending_before_all_ranks",
                            f"P's scheduler reported finished_sending for {p} while {pname}'s lease {p} is still "
                            f"{lease.state}: the blocks it holds may be reused under a READ")

    def _finished_recving(self, w: RankWorld, i: int) -> None:
        d = f"d{i}"
        if w.recv[i]:
            raise Found("finished_recving_twice", f"D's scheduler got the recv of {d} twice")
        w.recv[i] = True
        for dname in self.live(w, self.d_ranks):
            if (dname, d) in w.awaited and (dname, d) not in w.reported:
                inst = w.planes[dname].instances["decode_request"].get(d)
                state = inst.state if inst is not None else "gone"
                raise Found("finished_recving_before_all_ranks",
                            f"D's scheduler got the recv of {d} while {dname} has not reported it ({state})")

    # ---------------------------------------------------- scheduler steps
    def _arrive(self, w: World, i: int) -> None:
        assert isinstance(w, RankWorld)
        p = f"p{i}"
        for pname in self.p_ranks:
            self._feed(w, pname, E.LeaseGranted(request_id=p, block_ids=(2,), expected_consumers=self.consumers))
        self._aggregate(w, "P", ("expect", p))
        # The connector exports rank 0's expiry (the ranks grant together).
        w.p_expiry[i] = w.planes[self.p_ranks[0]].instances["lease"][p].expiry
        for dname in self.d_ranks:
            self._feed(w, dname, E.NewRequest(
                request_id=f"d{i}", engine_id="P", remote_request_id=p, remote_block_ids=(2,),
                remote_ranks=self.remote_ranks(dname), expected_consumers=self.consumers,
                remote_expiry=w.p_expiry[i], remote_renewable=True))
        w.phase[i] = ARRIVED

    def _alloc(self, w: World, i: int) -> None:
        assert isinstance(w, RankWorld)
        prof, d = self.profiles[i], f"d{i}"
        live = self.live(w, self.d_ranks)
        if prof.awaiting:
            w.awaited = w.awaited | {(dname, d) for dname in live}
            self._aggregate(w, "D", ("expect", d))
            for r, dname in enumerate(self.d_ranks):  # a rank already down has nothing to report
                if dname in w.down:
                    self._aggregate(w, "D", ("lost", r))
        for dname in live:
            self._feed(w, dname, E.BlocksAllocated(request_id=d, block_ids=(1,),
                                                   num_remote_tokens=prof.num_remote_tokens, awaiting=prof.awaiting))

    def _finish(self, w: World, i: int) -> None:
        assert isinstance(w, RankWorld)
        for dname in self.live(w, self.d_ranks):
            self._feed(w, dname, E.RequestFinished(request_id=f"d{i}", block_ids=(1,)))

    _STEP_EFFECTS = {"arrive": _arrive, "alloc": _alloc, "finish": _finish,
                     "start": _on_every_d_rank(E.StartLoad), "run": _on_every_d_rank(E.RequestRunning)}

    # ------------------------------------------------------------ network
    def _deliver_handshake(self, w: World, m: msg.Handshake) -> None:
        assert isinstance(w, RankWorld)
        src = m.plane
        if self.reads_from[src] in w.down:
            self._feed(w, src, E.HandshakeFailed(engine_id=m.engine, reason="peer down"))
            return
        w.activity[(src, m.engine)] = self.now(w, src)
        self._feed(w, src, E.HandshakeOk(engine_id=m.engine, samples=((self.clocks.offset(src, m.engine), 0.001),)))

    def _deliver_read(self, w: World, m: msg.Read) -> None:
        self.checks.check_read(w, m.plane, m.engine, m.remote_request_id, "executed")
        w.net = w.net + (msg.ReadDone(m.plane, m.request_id, "P", False),
                         msg.Notif(m.engine, m.remote_request_id, m.plane, m.consumers))

    def _deliver_read_done(self, w: World, m: msg.ReadDone) -> None:
        inst = w.planes[m.plane].instances["decode_request"].get(m.request_id)
        if inst is not None and inst.state == "READING":
            w.activity[(m.plane, m.engine)] = self.now(w, m.plane)
        self._feed(w, m.plane, E.ReadDone(request_id=m.request_id))

    def _deliver(self, w: World, m: msg.Message) -> None:
        assert isinstance(w, RankWorld)
        if m.plane in w.down:  # sent before the crash was seen: nobody handles it
            return
        super()._deliver(w, m)

    _DELIVER = {**Model._DELIVER, msg.Handshake: _deliver_handshake, msg.Read: _deliver_read,
                msg.ReadDone: _deliver_read_done}

    # ------------------------------------------------------------ actions
    def _post_read(self, w: World, pname: str, a: A.PostRead, lose_heartbeats: bool) -> None:
        holder = self.reads_from[pname]
        self.checks.check_read(w, pname, holder, a.remote_request_id, "posted")
        w.net = w.net + (msg.Read(pname, a.request_id, holder, a.remote_request_id, a.expected_consumers),)

    def _send_notif(self, w: World, pname: str, a: A.SendNotif, lose_heartbeats: bool) -> None:
        holder = self.reads_from[pname]
        w.net = w.net + (msg.Notif(holder, a.remote_request_id, pname, a.expected_consumers),)

    def _send_heartbeat(self, w: World, pname: str, a: A.SendHeartbeat, lose_heartbeats: bool) -> None:
        assert isinstance(w, RankWorld)
        # Delivered at once, to each P rank the batch names that is up, from
        # this D rank (the transport names the sending agent).
        for r in a.ranks:
            if not 0 <= r < len(self.p_ranks) or self.p_ranks[r] in w.down:
                continue
            for rid in sorted(a.request_ids):
                self._feed(w, self.p_ranks[r], E.LeaseHeartbeat(request_id=rid, sender=pname))

    def _refused(self, w: World, pname: str, a: A.RefuseForeignSender | A.RefuseWrongCount,
                 lose_heartbeats: bool) -> None:
        if self.refusals_found:
            lease = w.planes[pname].instances["lease"].get(a.request_id)
            bound = sorted(lease.bound) if lease is not None else []
            raise Found("reader_rank_refused",
                        f"{pname}'s lease {a.request_id} refused {a.sender} ({a.reason}; bound to {bound}): "
                        f"every sender here is a reader rank of the lease it reaches")

    def _report_recv(self, w: World, pname: str, a: A.ReportRecv, lose_heartbeats: bool) -> None:
        assert isinstance(w, RankWorld)
        super()._report_recv(w, pname, a, lose_heartbeats)
        self._aggregate(w, "D", ("report", int(pname[1:]), a.request_id, a.ok))

    def _free_blocks(self, w: World, pname: str, a: A.FreeBlocks, lose_heartbeats: bool) -> None:
        assert isinstance(w, RankWorld)
        super()._free_blocks(w, pname, a, lose_heartbeats)
        if pname in self.p_ranks:
            self._aggregate(w, "P", ("report", int(pname[1:]), a.request_id, a.reason == "consumed"))

    _ACTION_HANDLERS = {**Model._ACTION_HANDLERS, A.PostRead: _post_read, A.SendNotif: _send_notif,
                        A.SendHeartbeat: _send_heartbeat, A.ReportRecv: _report_recv, A.FreeBlocks: _free_blocks,
                        A.RefuseForeignSender: _refused, A.RefuseWrongCount: _refused}

