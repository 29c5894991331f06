"""The composed system's rules: which moves a world offers and what each does.

The planes' actions are executed by class (``_ACTION_HANDLERS``); every
action class the machines may emit is handled here, declared ignored
(``IGNORED_ACTIONS``), or internal (the plane carries it out itself).
"""
from __future__ import annotations

from typing import Any, Callable

import attrs

from .. import actions as A
from .. import events as E
from ..eventlog import MemoryLog
from ..machines import MACHINES
from ..plane import ControlPlane
from ..machine import Machine
from . import messages as msg
from .canonical import Canonical
from .checks import Checks, Found
from .config import PROFILES, ExploreConfig
from .moves import (STEP_AT, Abort, AbortLease, Crash, Restart, Deliver, Inject, Late, Move, Resume, Schedule, Stall, Step,
                    Tick)
from .world import ABORTED, ARRIVED, DEAD, FINISHED, LOADING, NEW, RUNNING, SENT, Clocks, World

# Counterexample steps in words (``Model.describe``).
STEP_WORDS = {
    "arrive": "request {r} ({profile}) arrives: P grants lease p{r}, D gets the request",
    "alloc": "D allocates blocks for request {r} ({profile})",
    "start": "D starts loading request {r} ({profile})",
    "run": "D runs request {r} ({profile})",
    "finish": "D finishes request {r} ({profile})",
    "arrive2": "turn 2 of request {r} ({profile}) arrives at P",
    "alloc2": "P allocates blocks for turn 2 of request {r} ({profile})",
    "start2": "P starts loading turn 2 of request {r} ({profile})",
    "run2": "P runs turn 2 of request {r} ({profile})",
    "finish2": "P finishes turn 2 of request {r} ({profile})",
}
FAULT_WORDS = {
    "lose": "lose", "dup": "duplicate", "hs_fail": "fail", "hs_hang": "hang (never answer)",
    "read_fail": "fail", "read_hang": "hang (the peer stops answering)", "write_fail": "fail",
    "write_hang": "hang (the peer stops answering)",
}


def message_words(m: msg.Message) -> str:
    """What is in flight, in words (a noun phrase)."""
    if isinstance(m, msg.Handshake):
        return f"reply to {m.plane}'s handshake with {m.engine}"
    if isinstance(m, msg.Read):
        return (f"READ {m.plane} posted of {m.engine}'s lease {m.remote_request_id} for {m.request_id} "
                f"({m.consumers} consumer{'s' if m.consumers != 1 else ''})")
    if isinstance(m, msg.ReadDone):
        late = ", executed after the lease was gone" if m.stale else ""
        return f"completion of {m.plane}'s READ for {m.request_id}{late}"
    if isinstance(m, msg.ReadFailed):
        return f"failure of {m.plane}'s READ for {m.request_id}"
    if isinstance(m, msg.Notif):
        return f"completion notification from {m.sender} to {m.plane} for lease {m.remote_request_id}"
    if isinstance(m, msg.PushRegistration):
        until = "" if m.deadline is None else f" until t={m.deadline:g} (D's clock)"
        return f"push registration to {m.plane}: D's blocks for {m.remote_request_id} await {m.request_id}'s WRITE{until}"
    if isinstance(m, msg.Write):
        return f"WRITE {m.plane} posted for {m.request_id} into {m.engine}'s blocks for {m.remote_request_id}"
    if isinstance(m, msg.WriteDone):
        return f"completion of {m.plane}'s WRITE for {m.request_id}"
    if isinstance(m, msg.WriteFailed):
        return f"failure of {m.plane}'s WRITE for {m.request_id}"
    if isinstance(m, msg.Pushed):
        return f"WRITE notification to {m.plane} for {m.request_id}"
    if isinstance(m, msg.Params):
        return f"params P exported for {m.request_id}, waiting for {m.plane}"
    if isinstance(m, msg.Disconnect):
        return f"notice to {m.plane} that {m.engine} went away"
    return str(m)


# Actions the world of the model has nothing to do for.
IGNORED_ACTIONS: frozenset[type] = frozenset({
    A.RemoveRemoteAgent,  # the abstract network has no NIXL agents to forget
    A.RefuseForeignSender, A.RefuseWrongCount,  # refusals are for the embedder's log
})


# --------------------------------------------- seam: heartbeat batcher internals
def _scheduled_heartbeat_times(plane: ControlPlane):
    """The next send time of every engine whose batch has ids to send."""
    hb = plane.heartbeats
    return (hb.due(eng) for eng in hb.engines())


class Model:
    """The composed system's rules; one per exploration."""

    def __init__(self, cfg: ExploreConfig, machines: dict[str, Machine] | None = None):
        self.cfg = cfg
        self.machines = dict(machines or MACHINES)
        self.profiles = tuple(PROFILES[p] for p in cfg.requests)
        self.n = len(self.profiles)
        self.clocks = Clocks(cfg.skew)
        self.skew = self.clocks.skew
        self.ttl = cfg.plane.stale_after  # silence until STALE, what the check bounds
        self.names = {f"{pre}{i}": (pre, i) for i in range(self.n) for pre in "dpq"}
        self.holds = {k: {s.name: s.holds for s in m.spec.states} for k, m in self.machines.items()}
        self.checks = Checks(self.clocks, self.holds, self.ttl)
        horizon = 4 * max(attrs.asdict(cfg.plane, filter=lambda a, v: isinstance(v, float)).values())
        self.canonical = Canonical(self.profiles, self.clocks, horizon)

    # ------------------------------------------------------------- setup
    def initial(self, record: bool = False) -> World:
        w = World()
        w.t = 0.0
        w.planes = {n: ControlPlane(self.cfg.plane, machines=self.machines) for n in ("D", "P")}
        w.owned = {"D", "P"}
        if record:
            for p in w.planes.values():
                p.recorder = MemoryLog(config=p.config)
        w.net = ()  # messages in flight, in send order
        w.stalled = ()  # hung transfers, which may still complete late
        w.phase = [NEW] * self.n  # turn 1 (D's scheduler)
        w.phase2 = [NEW] * self.n  # turn 2 (P's scheduler)
        w.faults = w.aborts = 0
        w.crashed = False
        w.restarted = None
        w.awaited = w.reported = w.freed = frozenset()  # (plane, request id)
        w.activity = {}  # (plane, engine) -> last activity the plane observed
        w.hold_expiry = [None] * self.n  # D's exported hold deadline (D's clock)
        w.stall = None  # (start, end) while D is stalled
        w.p_expiry = [None] * self.n  # P's lease expiry (P's clock) as exported to D
        w.ahead = None
        w.canon_parts = w.canon_net = None
        return w

    def now(self, w: World, plane: str) -> float:
        return self.clocks.now(w, plane)

    @staticmethod
    def incarnation(w: World, plane: str) -> str:
        """The token ``plane``'s process names in its handshakes and params:
        D's changes when it restarts (P never restarts here: a crash is for good)."""
        return f"{plane}#{1 if plane == 'D' and w.restarted is not None else 0}"
    def canon(self, w: World, symmetry: bool) -> tuple:
        return self.canonical.key(w, symmetry)

    def quiescent_problems(self, w: World) -> list[str]:
        return self.checks.quiescent_problems(w)

    # ------------------------------------------------------------- moves
    def _enabled_step(self, w: World, i: int, turn: int) -> Step | None:
        """The scheduler step of request ``i``'s ``turn`` its phase enables."""
        if turn == 1:
            phase, reader, rid = w.phase[i], "D", f"d{i}"
        elif w.phase[i] == FINISHED and self.profiles[i].turn2:
            phase, reader, rid = w.phase2[i], "P", f"q{i}"
        else:
            return None
        step = STEP_AT.get((turn, phase))
        if step is None or (step.needs_prefill and w.crashed):
            return None
        if step.needs_report and (reader, rid) not in w.reported:
            return None
        return step

    def moves(self, w: World) -> list[Move]:
        out: list[Move] = []
        cfg = self.cfg
        # Messages in flight are delivered before the scheduler's next step
        # (the network is faster than a scheduler iteration); an abort may
        # still race them, which is how a completion arrives after an abort.
        # While D is stalled, what D itself must handle waits (``_parked``),
        # and only P and the network move.
        stalled = w.stall is not None
        urgent = any(self._blocks_time(w, m) for m in w.net) if stalled else bool(w.net)
        for i, prof in enumerate(self.profiles):
            ph = w.phase[i]
            if (ARRIVED <= ph <= RUNNING and w.aborts < cfg.max_aborts and not (ph == LOADING and not prof.awaiting)
                    and not stalled):
                out.append(Abort(i))
            if prof.push and w.aborts < cfg.max_aborts and f"p{i}" in w.planes["P"].instances["lease"]:
                out.append(AbortLease(i))
            if urgent:
                continue
            step = self._enabled_step(w, i, 1)
            # A stalled D's scheduler is stalled too; a request may still arrive at P.
            if step is not None and (step.arrival or not stalled):
                out.append(Schedule(step, i))
            step = self._enabled_step(w, i, 2)
            if step is not None:
                out.append(Schedule(step, i))
        seen = set()
        faults_left = w.faults < cfg.max_faults
        allowed = cfg.faults
        for j, m in enumerate(w.net):
            if m in seen or (stalled and self._parked(m)):
                continue  # identical messages: one representative; D's wait for D
            seen.add(m)
            out.append(Deliver(j))
            if faults_left:
                out.extend(Inject(f, j) for f in m.FAULTS if f in allowed)
        for j in range(len(w.stalled)):
            out.append(Late(j))
        if faults_left and not w.crashed and "crash" in allowed:
            out.append(Crash())
        if faults_left and w.restarted is None and w.stall is None and "restart" in allowed:
            out.append(Restart())
        if w.stall is not None:  # stalled
            if not urgent:
                out.append(Tick())  # P's next deadline, or the end of the stall
            if w.t > w.stall[0]:
                out.append(Resume())
        else:
            if faults_left and "stall" in allowed:
                out.append(Stall())
            if not w.net and self._next_time(w) is not None:
                out.append(Tick())
                if faults_left and "lose" in allowed and self._hb_due(w):
                    out.append(Tick(lose_heartbeats=True))
        return out

    @staticmethod
    def _parked(m: msg.Message) -> bool:
        """A message D's own loop must handle (a reply, completion, notif,
        disconnect or new request addressed to D): it waits while D stalls."""
        return m.plane == "D" and m.NEEDS_LOOP

    def _blocks_time(self, w: World, m: msg.Message) -> bool:
        """Whether time may not pass while ``m`` is in flight.  During a stall
        D's own messages wait, and so may D's posted READs (no progress
        calls), though the fabric may also execute one meanwhile."""
        if w.stall is None:
            return True
        return not (self._parked(m) or (isinstance(m, msg.Read) and m.plane == "D"))

    def drain_move(self, w: World) -> Move | None:
        """The fault-free, deterministic continuation: deliver, schedule, tick."""
        if w.stall is not None:
            return Resume()
        if w.net:
            return Deliver(0)
        for i in range(self.n):
            for turn in (1, 2):
                step = self._enabled_step(w, i, turn)
                if step is not None and not step.arrival:
                    return Schedule(step, i)
        if self._next_time(w) is not None:
            return Tick()
        return None

    def describe(self, w: World, move: Move) -> str:
        """A counterexample step in words, as read before ``move`` is applied to ``w``."""
        at = f"(t={w.t:g})"
        if isinstance(move, Deliver):
            return f"deliver the {message_words(w.net[move.index])} {at}"
        if isinstance(move, Inject):
            return f"{FAULT_WORDS.get(move.fault, move.fault)} the {message_words(w.net[move.index])} {at}"
        if isinstance(move, Late):
            return f"late completion of the hung {message_words(w.stalled[move.index])} {at}"
        if isinstance(move, Tick):
            lost = ", losing the heartbeats it sends" if move.lose_heartbeats else ""
            return f"tick to t={self._next_time(w):g}: due timers fire{lost}"
        if isinstance(move, Crash):
            return f"crash P {at}"
        if isinstance(move, Restart):
            return f"D restarts (a new incarnation, the same engine id) {at}"
        if isinstance(move, Stall):
            return f"D stalls for at most {self.cfg.stall:g} s {at}"
        if isinstance(move, Resume):
            return f"D resumes {at}"
        if isinstance(move, AbortLease):
            return f"P aborts lease p{move.request} (its client went away) {at}"
        if not isinstance(move, (Abort, Schedule)):  # the rank world's moves (ranks.RankModel words them)
            return f"{move} {at}"
        profile = self.profiles[move.request].name
        if isinstance(move, Abort):
            return f"D's scheduler aborts request {move.request} ({profile}) {at}"
        words = STEP_WORDS.get(move.step.name, move.step.name + " request {r} ({profile})")
        return f"{words.format(r=move.request, profile=profile)} {at}"

    def _hb_due(self, w: World) -> bool:
        t = self._next_time(w)
        return any(at - self.skew[name] <= t for name, p in w.planes.items()
                   for at in _scheduled_heartbeat_times(p))

    def _next_time(self, w: World) -> float | None:
        best = None if w.stall is None else w.stall[1]
        for name, p in w.planes.items():
            if (name == "P" and w.crashed) or (name == "D" and w.stall is not None):
                continue
            nd = p.next_deadline()
            if nd is not None:
                nd -= self.skew[name]
                if best is None or nd < best:
                    best = nd
        return best

    # ------------------------------------------------------------- apply
    def apply(self, w: World, move: Move) -> None:
        """Mutate ``w`` by ``move``; raises Found on a safety violation."""
        self._APPLY[type(move)](self, w, move)
        self.checks.check_invariants(w)

    def _tick(self, w: World, move: Tick) -> None:
        if move.lose_heartbeats:
            w.faults += 1
        t = self._next_time(w)
        assert t is not None  # Tick is offered only when something is due
        w.t = t
        for pname in ("D", "P"):
            if (pname == "P" and w.crashed) or (pname == "D" and w.stall is not None):
                continue
            nd = w.planes[pname].next_deadline()
            if nd is None or nd > self.now(w, pname):
                continue
            # The fault loses the batches D sends at this tick.
            self._emit(w, pname, w.plane(pname).fire_due(self.now(w, pname)),
                       lose_heartbeats=move.lose_heartbeats and pname == "D")
        if w.stall is not None and w.t >= w.stall[1]:
            self._resume(w)

    def _stall(self, w: World, move: Stall) -> None:
        w.faults += 1
        w.stall = (w.t, w.t + self.cfg.stall)

    def _resume_move(self, w: World, move: Resume) -> None:
        self._resume(w)

    def _deliver_move(self, w: World, move: Deliver) -> None:
        m = w.net[move.index]
        w.net = w.net[: move.index] + w.net[move.index + 1:]
        self._deliver(w, m)

    def _inject(self, w: World, move: Inject) -> None:
        w.faults += 1
        j, fault = move.index, move.fault
        m: Any = w.net[j]  # a message whose FAULTS name ``fault``: its fields follow from it
        w.net = w.net[:j] + w.net[j + 1:]
        if fault == "dup":
            self._deliver(w, m)
            w.net = w.net + (m,)
        elif fault == "hs_fail":
            self._feed(w, m.plane, E.HandshakeFailed(engine_id=m.engine, reason="injected"))
        elif fault == "read_fail":
            w.net = w.net + (msg.ReadFailed(m.plane, m.request_id),)
        elif fault == "write_fail":
            w.net = w.net + (msg.WriteFailed(m.plane, m.request_id),)
        elif fault in ("read_hang", "write_hang"):
            w.stalled = w.stalled + (m,)
        # lose / hs_hang: the message is gone

    def _late(self, w: World, move: Late) -> None:
        j = move.index
        m = w.stalled[j]
        w.stalled = w.stalled[:j] + w.stalled[j + 1:]
        self._deliver(w, m)

    def _crash_move(self, w: World, move: Crash) -> None:
        self._crash(w)

    def _restart_move(self, w: World, move: Restart) -> None:
        self._restart(w)

    def _abort_lease(self, w: World, move: AbortLease) -> None:
        w.aborts += 1
        self._feed(w, "P", E.LeaseAbort(request_id=f"p{move.request}"))

    def _abort(self, w: World, move: Abort) -> None:
        w.aborts += 1
        self._feed(w, "D", E.Abort(request_id=f"d{move.request}"))
        w.phase[move.request] = ABORTED

    def _schedule(self, w: World, move: Schedule) -> None:
        step, i = move.step, move.request
        (w.phase if step.turn == 1 else w.phase2)[i] = step.then
        self._STEP_EFFECTS[step.name](self, w, i)

    _APPLY: dict[type, Callable] = {
        Tick: _tick, Stall: _stall, Resume: _resume_move, Deliver: _deliver_move, Inject: _inject, Late: _late,
        Crash: _crash_move, Restart: _restart_move, AbortLease: _abort_lease, Abort: _abort, Schedule: _schedule,
    }

    def _resume(self, w: World) -> None:
        """D's loop runs again: like the driver, it fires every due timer
        (late) before it polls anything, so a READ deadline that passed
        during the stall cancels the READ before its completion is seen."""
        w.stall = None
        nd = w.planes["D"].next_deadline()
        if nd is not None and nd <= self.now(w, "D"):
            self._emit(w, "D", w.plane("D").fire_due(self.now(w, "D")))

    # ---------------------------------------------------- scheduler steps
    def _new_request(self, w: World, i: int) -> None:
        # The params as the connector exports them (connector.py _params):
        # P's lease expiry in P's clock, renewable by heartbeats.
        self._feed(w, "D", E.NewRequest(request_id=f"d{i}", engine_id="P", remote_request_id=f"p{i}",
                                        remote_block_ids=(2,), remote_expiry=w.p_expiry[i], remote_renewable=True,
                                        push=self.profiles[i].push, remote_incarnation=self.incarnation(w, "P")))
        w.phase[i] = ARRIVED

    def _arrive(self, w: World, i: int) -> None:
        p = f"p{i}"
        self._feed(w, "P", E.LeaseGranted(request_id=p, block_ids=(2,), expected_consumers=1))
        w.p_expiry[i] = w.planes["P"].instances["lease"][p].expiry
        if self.profiles[i].push:  # as the connector does: the push may start once D registers
            self._feed(w, "P", E.PushReady(request_id=p, block_ids=(2,)))
        if w.stall is None:
            self._new_request(w, i)
        else:  # the params wait for D's loop
            w.net = w.net + (msg.Params("D", f"d{i}"),)
            w.phase[i] = SENT

    def _alloc(self, w: World, i: int) -> None:
        prof, d = self.profiles[i], f"d{i}"
        if prof.awaiting:
            w.awaited = w.awaited | {("D", d)}
        self._feed(w, "D", E.BlocksAllocated(request_id=d, block_ids=(1,), num_remote_tokens=prof.num_remote_tokens,
                                             awaiting=prof.awaiting))

    def _start(self, w: World, i: int) -> None:
        self._feed(w, "D", E.StartLoad(request_id=f"d{i}"))

    def _run(self, w: World, i: int) -> None:
        self._feed(w, "D", E.RequestRunning(request_id=f"d{i}"))

    def _finish(self, w: World, i: int) -> None:
        d = f"d{i}"
        self._feed(w, "D", E.RequestFinished(request_id=d, block_ids=(1,), hold_for_next_turn=self.profiles[i].turn2))
        lease = w.planes["D"].instances["lease"].get(d)
        # The exported deadline, in D's clock, as the turn-2 reader will get it.
        w.hold_expiry[i] = lease.expiry if lease is not None else None

    def _arrive2(self, w: World, i: int) -> None:
        # D's hold params name the incarnation holding the blocks: the one
        # up now (a restart kills every hold, and their turn 2s, before
        # they arrive).
        self._feed(w, "P", E.NewRequest(request_id=f"q{i}", engine_id="D", remote_request_id=f"d{i}",
                                        remote_block_ids=(1,), remote_expiry=w.hold_expiry[i],
                                        remote_incarnation=self.incarnation(w, "D")))

    def _alloc2(self, w: World, i: int) -> None:
        q = f"q{i}"
        w.awaited = w.awaited | {("P", q)}
        self._feed(w, "P", E.BlocksAllocated(request_id=q, block_ids=(3,), num_remote_tokens=4, awaiting=True))

    def _start2(self, w: World, i: int) -> None:
        self._feed(w, "P", E.StartLoad(request_id=f"q{i}"))

    def _run2(self, w: World, i: int) -> None:
        self._feed(w, "P", E.RequestRunning(request_id=f"q{i}"))

    def _finish2(self, w: World, i: int) -> None:
        self._feed(w, "P", E.RequestFinished(request_id=f"q{i}", block_ids=(3,)))

    _STEP_EFFECTS: dict[str, Callable] = {
        "arrive": _arrive, "alloc": _alloc, "start": _start, "run": _run, "finish": _finish,
        "arrive2": _arrive2, "alloc2": _alloc2, "start2": _start2, "run2": _run2, "finish2": _finish2,
    }

    def _crash(self, w: World) -> None:
        w.faults += 1
        w.crashed = True
        # The process is gone, and its memory with it: nothing it held leaks.
        w.planes["P"] = ControlPlane(self.cfg.plane, machines=self.machines)
        w.owned.add("P")
        net: list[msg.Message] = []
        for m in w.net + w.stalled:
            if isinstance(m, msg.Read) and m.engine == "P":
                net.append(msg.ReadFailed(m.plane, m.request_id))  # the transport sees the peer die
            elif m.plane != "P":  # what P's loop would have handled died with it
                net.append(m)
        net.append(msg.Disconnect("D", "P"))
        w.net = tuple(net)
        w.stalled = ()
        w.phase2 = [DEAD if ph not in (NEW,) else ph for ph in w.phase2]
        # P's scheduler died with it: nothing there awaits a report any more.
        w.awaited = frozenset(k for k in w.awaited if k[0] != "P")
        w.reported = frozenset(k for k in w.reported if k[0] != "P")

    def _restart(self, w: World) -> None:
        """D dies and starts again with the same engine id: a fresh plane.
        Its requests and holds die with it (the proxy sends them nowhere
        else: their turn 1 and turn 2 are over); what it sent is still on
        the network; what was addressed to its loop is gone; a READ P made
        of its holds fails (the peer is gone).  P is told the peer
        disconnected.  Requests not yet arrived go to the new incarnation.
        P must reclaim every lease it granted for the old one (liveness),
        and the new one must never complete any of them (``_send_notif``)."""
        w.faults += 1
        old = [i for i, ph in enumerate(w.phase) if ph != NEW]
        w.restarted = frozenset(f"p{i}" for i in old)
        w.planes["D"] = ControlPlane(self.cfg.plane, machines=self.machines)
        w.owned.add("D")
        net: list[msg.Message] = []
        for m in w.net + w.stalled:
            if isinstance(m, msg.Read) and m.engine == "D":
                net.append(msg.ReadFailed(m.plane, m.request_id))
            elif m.plane != "D":
                net.append(m)
        net.append(msg.Disconnect("P", "D"))
        w.net = tuple(net)
        w.stalled = ()
        for i in old:
            if w.phase[i] != FINISHED:  # a finished turn 1 stays (its turn 2 may be under way at P)
                w.phase[i] = DEAD
            if w.phase2[i] == NEW:
                w.phase2[i] = DEAD  # its hold died: no turn 2
        w.awaited = frozenset(k for k in w.awaited if k[0] != "D")
        w.reported = frozenset(k for k in w.reported if k[0] != "D")
        w.hold_expiry = [None if i in old else e for i, e in enumerate(w.hold_expiry)]

    # ------------------------------------------------------------ network
    def _deliver(self, w: World, m: msg.Message) -> None:
        self._DELIVER[type(m)](self, w, m)

    def _deliver_handshake(self, w: World, m: msg.Handshake) -> None:
        src, dst = m.plane, m.engine
        if dst == "P" and w.crashed:
            self._feed(w, src, E.HandshakeFailed(engine_id=dst, reason="peer down"))
            return
        w.activity[(src, dst)] = self.now(w, src)
        self._feed(w, src, E.HandshakeOk(engine_id=dst, samples=((self.clocks.offset(src, dst), 0.001),),
                                         incarnation=self.incarnation(w, dst)))

    def _deliver_read(self, w: World, m: msg.Read) -> None:
        src, dst, rrid = m.plane, m.engine, m.remote_request_id
        if src == "D" and w.stall is not None:
            # The fabric executes a READ of a stalled D (which cannot
            # cancel it): possibly into blocks P reclaimed.  Not a
            # violation yet; accepting its completion would be.
            stale = self.checks.lease_problem(w, src, dst, rrid) is not None
        else:
            self.checks.check_read(w, src, dst, rrid, "executed")
            stale = False
        w.net = w.net + (msg.ReadDone(src, m.request_id, dst, stale), msg.Notif(dst, rrid, src, m.consumers))

    def _deliver_params(self, w: World, m: msg.Params) -> None:
        self._new_request(w, self.names[m.request_id][1])

    def _deliver_push_registration(self, w: World, m: msg.PushRegistration) -> None:
        self._feed(w, m.plane, E.PushRegistered(request_id=m.request_id, engine_id="D",
                                                remote_request_id=m.remote_request_id, remote_block_ids=(1,),
                                                remote_deadline=m.deadline))

    def _deliver_write(self, w: World, m: msg.Write) -> None:
        self.checks.check_write(w, m.plane, m.request_id, "executed")
        # NIXL delivers the WRITE's notification with it.
        w.net = w.net + (msg.WriteDone(m.plane, m.request_id), msg.Pushed(m.engine, m.remote_request_id))

    def _deliver_write_done(self, w: World, m: msg.WriteDone) -> None:
        self._feed(w, m.plane, E.WriteDone(request_id=m.request_id))

    def _deliver_write_failed(self, w: World, m: msg.WriteFailed) -> None:
        self._feed(w, m.plane, E.WriteFailed(request_id=m.request_id, reason="peer error"))

    def _deliver_pushed(self, w: World, m: msg.Pushed) -> None:
        self._feed(w, m.plane, E.PushDone(request_id=m.request_id))

    def _deliver_read_done(self, w: World, m: msg.ReadDone) -> None:
        src, req = m.plane, m.request_id
        inst = w.planes[src].instances["decode_request"].get(req)
        if m.stale and inst is not None and inst.state == "READING":
            raise Found("read_of_unheld_lease",
                        f"{src} accepts the completion of READ {req}, which executed while {src} was stalled, "
                        f"after P's lease {inst.remote_request_id} was gone: its READ deadline did not refuse it")
        if inst is not None and inst.state == "READING":
            w.activity[(src, m.engine)] = self.now(w, src)
        self._feed(w, src, E.ReadDone(request_id=req))

    def _deliver_read_failed(self, w: World, m: msg.ReadFailed) -> None:
        self._feed(w, m.plane, E.ReadFailed(request_id=m.request_id, reason="peer error"))

    def _deliver_notif(self, w: World, m: msg.Notif) -> None:
        self._feed(w, m.plane, E.ConsumerDone(request_id=m.remote_request_id, consumer=m.sender,
                                              expected_consumers=m.consumers))

    def _deliver_disconnect(self, w: World, m: msg.Disconnect) -> None:
        self._feed(w, m.plane, E.PeerDisconnected(engine_id=m.engine, reason="crashed"))

    _DELIVER: dict[type, Callable] = {
        msg.Handshake: _deliver_handshake, msg.Read: _deliver_read, msg.ReadDone: _deliver_read_done,
        msg.ReadFailed: _deliver_read_failed, msg.Notif: _deliver_notif,
        msg.PushRegistration: _deliver_push_registration, msg.Write: _deliver_write,
        msg.WriteDone: _deliver_write_done, msg.WriteFailed: _deliver_write_failed, msg.Pushed: _deliver_pushed,
        msg.Params: _deliver_params, msg.Disconnect: _deliver_disconnect,
    }

    # ------------------------------------------------------------ actions
    def _feed(self, w: World, pname: str, event) -> None:
        assert not (pname == "D" and w.stall is not None), f"model bug: {event} fed to a stalled D"
        plane = w.plane(pname)
        self._emit(w, pname, plane.handle(event, self.now(w, pname)))

    def _emit(self, w: World, pname: str, actions, lose_heartbeats: bool = False) -> None:
        """Execute what plane ``pname`` emitted."""
        for a in actions:
            handler = self._ACTION_HANDLERS.get(type(a))
            if handler is not None:
                handler(self, w, pname, a, lose_heartbeats)
            elif type(a) not in IGNORED_ACTIONS:
                raise TypeError(f"model bug: no handler for action {type(a).__name__}")

    def _post_read(self, w: World, pname: str, a: A.PostRead, lose_heartbeats: bool) -> None:
        self.checks.check_read(w, pname, a.engine_id, a.remote_request_id, "posted")
        w.net = w.net + (msg.Read(pname, a.request_id, a.engine_id, a.remote_request_id, a.expected_consumers),)

    def _post_write(self, w: World, pname: str, a: A.PostWrite, lose_heartbeats: bool) -> None:
        self.checks.check_write(w, pname, a.request_id, "posted")
        w.net = w.net + (msg.Write(pname, a.request_id, a.engine_id, a.remote_request_id),)

    def _send_push_registration(self, w: World, pname: str, a: A.SendPushRegistration, lose_heartbeats: bool) -> None:
        w.net = w.net + (msg.PushRegistration(a.engine_id, a.remote_request_id, a.request_id, a.deadline),)

    def _release_xfer(self, w: World, pname: str, a: A.ReleaseXfer, lose_heartbeats: bool) -> None:
        if a.cancel:
            # A cancelled transfer never executes; its completion may not come.
            def keep(m) -> bool:
                return not (isinstance(m, (msg.Read, msg.Write)) and m.plane == pname and m.request_id == a.request_id)

            w.net = tuple(m for m in w.net if keep(m))
            w.stalled = tuple(m for m in w.stalled if keep(m))

    def _send_notif(self, w: World, pname: str, a: A.SendNotif, lose_heartbeats: bool) -> None:
        if pname == "D" and w.restarted is not None and a.remote_request_id in w.restarted:
            raise Found("old_incarnation_lease_consumed", f"D's new incarnation completes {a.remote_request_id}, "
                        f"a lease P granted for its old one")
        w.net = w.net + (msg.Notif(a.engine_id, a.remote_request_id, pname, a.expected_consumers),)

    def _send_heartbeat(self, w: World, pname: str, a: A.SendHeartbeat, lose_heartbeats: bool) -> None:
        # Delivered at once (a heartbeat commutes with everything but
        # the lease it renews); losing one is the Tick(lose_heartbeats) fault.
        if (pname == "P" and w.crashed) or (a.engine_id == "P" and w.crashed) or lose_heartbeats:
            return
        if a.engine_id == "D" and w.stall is not None:
            # P's turn-2 heartbeats to a stalled D: D's hold is a
            # fixed TTL they do not renew, so dropping them changes nothing.
            return
        for rid in sorted(a.request_ids):
            self._feed(w, a.engine_id, E.LeaseHeartbeat(request_id=rid))

    def _start_handshake(self, w: World, pname: str, a: A.StartHandshake, lose_heartbeats: bool) -> None:
        w.net = w.net + (msg.Handshake(pname, a.engine_id),)

    def _report_recv(self, w: World, pname: str, a: A.ReportRecv, lose_heartbeats: bool) -> None:
        k = (pname, a.request_id)
        if k not in w.awaited:
            raise Found("report_not_awaited", f"{pname} reported recv {a.request_id}, which was not awaited")
        if k in w.reported:
            raise Found("report_twice", f"{pname} reported recv {a.request_id} twice")
        w.reported = w.reported | {k}

    def _free_blocks(self, w: World, pname: str, a: A.FreeBlocks, lose_heartbeats: bool) -> None:
        k = (pname, a.request_id)
        if k in w.freed:
            raise Found("double_free", f"{pname} freed the blocks of lease {a.request_id} twice")
        w.freed = w.freed | {k}

    _ACTION_HANDLERS: dict[type, Callable] = {
        A.PostRead: _post_read, A.PostWrite: _post_write, A.SendPushRegistration: _send_push_registration,
        A.ReleaseXfer: _release_xfer, A.SendNotif: _send_notif, A.SendHeartbeat: _send_heartbeat,
        A.StartHandshake: _start_handshake, A.ReportRecv: _report_recv, A.FreeBlocks: _free_blocks,
    }


def unhandled_actions() -> list[str]:
    """Action classes the machines may emit that the model neither executes
    nor declares ignored; internal ones never leave the plane."""
    return [name for name, cls in A.ALL_ACTIONS.items()
            if cls not in Model._ACTION_HANDLERS and cls not in IGNORED_ACTIONS and not cls.internal]


_missing = unhandled_actions()
if _missing:  # a new action class needs a decision here, or the explorer goes quiet on it
    raise TypeError(f"explorer: no handler for actions {_missing}: execute them in Model._emit or list them in "
                    f"IGNORED_ACTIONS")
