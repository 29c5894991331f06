"""Explicit-state model checker for a composed P/D system.

The model: a decode ControlPlane "D" and a prefill ControlPlane "P" (the
real machines, or mutated ones), an abstract network between them, and a
scheduler per side.  Each request i is, on D, decode_request ``d<i>``
reading P's lease ``p<i>``; with the "read2" profile D holds its blocks
after finishing (lease ``d<i>`` on D) and P reads them back for turn 2 as
decode_request ``q<i>``; with the "push" profile D registers its blocks
(PUSH_REG) and P's push_write ``p<i>`` WRITEs from its lease ``p<i>``.
P's clock is D's plus ``skew``.

Moves (each a BFS edge):
- scheduler: arrive (P grants the lease and D gets the request with P's
  lease expiry, renewable, as the connector exports it), allocate, start
  load, run (only after the recv was reported), finish, abort (budgeted),
  the turn-2 counterparts, and for a push P aborting its lease (budgeted
  with the aborts: P's client went away);
- network: deliver any in-flight message (so reordering is implicit):
  handshake replies, READ and WRITE executions and completions, completion
  notifs, push registrations, heartbeats, disconnect notices;
- faults (``max_faults`` in total): lose or duplicate a notif/heartbeat,
  fail or hang a handshake, fail or hang a READ or WRITE (a hung peer),
  crash P; a hung transfer may complete late (before it is cancelled); and, outside
  the default set (``STALL_FAULTS``), D stalls: for up to ``stall``
  seconds D does nothing (no timers, so no heartbeats and no deadlines;
  no scheduling; what is addressed to D waits, a request P exported
  included) while P's clock and timers run on; the fabric may execute
  D's posted READ meanwhile.  D resumes at any point P's timers or the
  bound reach, firing its due timers before it handles anything, as the
  driver does;
- tick: advance time to the next deadline of either plane and fire timers.
  Time only advances when no message is in flight (delivery is faster than
  any timer), except for hung READs.

Abstractions, chosen so that the real machines pass: block ids are the
same for every request (they are opaque to the machines), so requests of
one profile are interchangeable; a cancelled READ does not execute; a
crashed P stays down (its memory went with it, so its leases are no longer
checked).  Push mode is modeled as far as P's side needs: D's blocks are
not checked (D cannot see or stop a one-sided WRITE; see the README).

State hashing: a canonical tuple of each plane's instances (kind, state,
relevant fields, times relative to the plane's now) + live timers (the
instances' deadlines and the heartbeat schedule, with each chain's last
send) + network + scheduler and bookkeeping + the stall; what the READ
gate reads (remote expiry, arrival, the chain's first and last send)
enters as the exact comparisons the gate makes (``_gate_sig``); with
symmetry reduction the requests are renamed so that their request-local
signatures are sorted.

Checks after every move (safety): no READ posted or executed against a
lease that is not held, or whose expiry (in the reader's clock) is <= now
(P's: reading freed blocks; D's: a turn-2 read of expired D-held blocks);
a READ the fabric executed against such a lease while D was stalled is
no violation by itself, but D accepting its completion is (the READ
deadline must refuse it); no WRITE posted or executed from a lease that is
not held (the push outliving its lease); FreeBlocks at most once per lease; ReportRecv only
for an awaited recv, at most once; no request holds an engine_ref to an
engine that is gone (evicted under it); no engine STALE within engine_ttl
of observed activity; no protocol violation.  Liveness: from every
explored state a deterministic, fault-free drain (deliver, schedule, tick)
must reach quiescence with nothing held, no request alive and every
awaited recv reported; drains are memoized on canonical states.

On a violation the shortest move sequence (BFS) is returned, with both
planes' event logs (replayable JSONL, see ``replay``).
"""
from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

import attrs

from . import events as E
from .config import PlaneConfig
from .eventlog import MemoryLog
from .machines import MACHINES
from .plane import ControlPlane
from .machine import Machine

# Small durations keep the interesting interleavings within a few ticks.
EXPLORER_PLANE_CONFIG = PlaneConfig(
    kv_lease_duration=6.0, decoder_kv_blocks_ttl=8.0, expiry_safety_margin=5.0, engine_ttl=3.0,
    handshake_timeout=2.0, handshake_backoff=1.0, handshake_max_attempts=2, transfer_timeout=4.0,
    recv_timeout=10.0, push_registration_timeout=4.0,
)


@attrs.frozen
class Profile:
    name: str
    num_remote_tokens: int
    awaiting: bool
    turn2: bool = False
    push: bool = False


PROFILES = {
    "read": Profile("read", 4, True),
    "hit": Profile("hit", 0, True),  # full prefix hit, awaited: notify P, report done
    "notify": Profile("notify", 0, False),  # full prefix hit nobody awaits
    "read2": Profile("read2", 4, True, turn2=True),  # read, hold blocks, P reads them back
    "push": Profile("push", 4, True, push=True),  # D registers, P WRITEs from its lease
}

FAULTS = frozenset({"lose", "dup", "hs_fail", "hs_hang", "read_fail", "read_hang", "write_fail", "write_hang",
                    "crash"})
# D stalls (SIGSTOP, overload): for up to ``ExploreConfig.stall`` seconds D's
# loop does nothing while P's clock and timers run on.  Not in the default
# fault set (it multiplies the state space); ``kvplane explore --stall``.
STALL_FAULTS = FAULTS | {"stall"}


@attrs.frozen
class ExploreConfig:
    requests: tuple = ("read", "hit")
    max_faults: int = 1
    max_aborts: int = 1
    faults: frozenset = FAULTS
    skew: float = 0.0  # P's clock minus D's
    stall: float = 6.0  # longest D stall (the "stall" fault), seconds
    max_depth: int = 10
    max_states: int = 300_000
    symmetry: bool = True
    liveness: bool = True
    stop_at_first: bool = True
    drain_limit: int = 400
    plane: PlaneConfig = EXPLORER_PLANE_CONFIG


@attrs.define
class Violation:
    kind: str
    message: str
    moves: list
    logs: dict = attrs.Factory(dict)  # plane name -> JSONL lines

    def write(self, prefix: str) -> list[str]:
        """Write ``<prefix>.<plane>.jsonl`` per plane; returns the paths."""
        paths = []
        for name, lines in self.logs.items():
            path = f"{prefix}.{name}.jsonl"
            with open(path, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
            paths.append(path)
        return paths

    def __str__(self) -> str:
        steps = "\n".join(f"  {n:3d}. {m}" for n, m in enumerate(self.moves, 1))
        return f"{self.kind}: {self.message}\n{steps}"


@attrs.define
class ExploreResult:
    config: ExploreConfig
    states: int = 0
    transitions: int = 0
    max_depth_reached: int = 0
    frontier_cut: int = 0  # states at max_depth whose successors were not explored
    drained: int = 0
    elapsed: float = 0.0
    violations: list = attrs.Factory(list)
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def states_per_second(self) -> float:
        return self.states / self.elapsed if self.elapsed > 0 else float("inf")


class _Found(Exception):
    def __init__(self, kind: str, message: str):
        self.kind, self.message = kind, message


# ------------------------------------------------------------------ cloning
def clone_plane(p: ControlPlane) -> ControlPlane:
    """A copy of a plane's semantic state (see ControlPlane.clone)."""
    return p.clone()


# -------------------------------------------------------------------- world
NEW, ARRIVED, ALLOCATED, LOADING, RUNNING, FINISHED, ABORTED, DEAD, SENT = range(9)
# SENT: P granted the lease and the params are on their way to D, which is
# stalled; D's NewRequest is the ("new", "D", d<i>) message.
HELD_LEASE = ("LEASED", "PARTIALLY_READ")
# decode_request states in which the READ gate may still be evaluated.
GATE_STATES = ("NEW", "HEARTBEATING", "WAITING_FOR_REMOTE_KVS", "FULL_PREFIX_HIT", "HANDSHAKING")


class World:
    __slots__ = ("t", "planes", "owned", "net", "stalled", "phase", "phase2", "faults", "aborts", "crashed",
                 "awaited", "reported", "freed", "activity", "hold_expiry", "stall", "p_expiry")

    def clone(self) -> "World":
        w = World.__new__(World)
        w.t = self.t
        # Copy-on-write: a move usually touches one plane, often none.
        w.planes = dict(self.planes)
        w.owned = set()
        w.net = self.net
        w.stalled = self.stalled
        w.phase = list(self.phase)
        w.phase2 = list(self.phase2)
        w.faults, w.aborts, w.crashed = self.faults, self.aborts, self.crashed
        w.awaited, w.reported, w.freed = self.awaited, self.reported, self.freed
        w.activity = dict(self.activity)
        w.hold_expiry = list(self.hold_expiry)
        w.stall = self.stall
        w.p_expiry = list(self.p_expiry)
        return w


class Model:
    """The composed system's rules; one per exploration."""

    def __init__(self, cfg: ExploreConfig, machines: dict[str, Machine] | None = None):
        self.cfg = cfg
        self.machines = dict(machines or MACHINES)
        self.profiles = tuple(PROFILES[p] for p in cfg.requests)
        self.n = len(self.profiles)
        self.skew = {"D": 0.0, "P": float(cfg.skew)}
        self.ttl = cfg.plane.engine_ttl
        names = {}
        for i in range(self.n):
            for pre in "dpq":
                names[f"{pre}{i}"] = (pre, i)
        self.names = names
        self.holds = {k: {s.name: s.holds for s in m.spec.states} for k, m in self.machines.items()}
        self._lose_hb = False
        self.horizon = 4 * max(attrs.asdict(cfg.plane, filter=lambda a, v: isinstance(v, float)).values())

    @staticmethod
    def plane(w: World, name: str) -> ControlPlane:
        """The plane, copied first if this world still shares it."""
        if name not in w.owned:
            w.planes[name] = clone_plane(w.planes[name])
            w.owned.add(name)
        return w.planes[name]

    # ------------------------------------------------------------- setup
    def initial(self, record: bool = False) -> World:
        w = World()
        w.t = 0.0
        w.planes = {n: ControlPlane(self.cfg.plane, machines=self.machines) for n in ("D", "P")}
        w.owned = {"D", "P"}
        if record:
            for p in w.planes.values():
                p.recorder = MemoryLog(config=p.config)
        w.net = ()
        w.stalled = ()
        w.phase = [NEW] * self.n
        w.phase2 = [NEW] * self.n
        w.faults = w.aborts = 0
        w.crashed = False
        w.awaited = w.reported = w.freed = frozenset()
        w.activity = {}
        w.hold_expiry = [None] * self.n
        w.stall = None  # (start, end) while D is stalled
        w.p_expiry = [None] * self.n  # P's lease expiry (P's clock) as exported to D
        return w

    def now(self, w: World, plane: str) -> float:
        return w.t + self.skew[plane]

    # ------------------------------------------------------------- moves
    def moves(self, w: World) -> list:
        out = []
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
                out.append(("abort", i))
            if prof.push and w.aborts < cfg.max_aborts and f"p{i}" in w.planes["P"].instances["lease"]:
                out.append(("p_abort", i))
            if urgent:
                continue
            if ph == NEW and not w.crashed:
                out.append(("arrive", i))
            elif stalled:
                pass  # D's scheduler is stalled too; P's turn-2 moves below go on
            elif ph == ARRIVED:
                out.append(("alloc", i))
            elif ph == ALLOCATED:
                out.append(("start", i))
            elif ph == LOADING and ("D", f"d{i}") in w.reported:
                out.append(("run", i))
            elif ph == RUNNING:
                out.append(("finish", i))
            ph2 = w.phase2[i]
            if ph == FINISHED and prof.turn2 and not w.crashed:
                if ph2 == NEW:
                    out.append(("arrive2", i))
                elif ph2 == ARRIVED:
                    out.append(("alloc2", i))
                elif ph2 == ALLOCATED:
                    out.append(("start2", i))
                elif ph2 == LOADING and ("P", f"q{i}") in w.reported:
                    out.append(("run2", i))
                elif ph2 == RUNNING:
                    out.append(("finish2", i))
        seen = set()
        faults_left = w.faults < cfg.max_faults
        allowed = cfg.faults
        for j, m in enumerate(w.net):
            if m in seen or (stalled and self._parked(m)):
                continue  # identical messages: one representative; D's wait for D
            seen.add(m)
            out.append(("deliver", j))
            if not faults_left:
                continue
            k = m[0]
            if k == "notif":
                if "lose" in allowed:
                    out.append(("lose", j))
                if "dup" in allowed:
                    out.append(("dup", j))
            elif k == "hs":
                if "hs_fail" in allowed:
                    out.append(("hs_fail", j))
                if "hs_hang" in allowed:
                    out.append(("hs_hang", j))
            elif k == "read":
                if "read_fail" in allowed:
                    out.append(("read_fail", j))
                if "read_hang" in allowed:
                    out.append(("read_hang", j))
            elif k == "write":
                if "write_fail" in allowed:
                    out.append(("write_fail", j))
                if "write_hang" in allowed:
                    out.append(("write_hang", j))
        for j in range(len(w.stalled)):
            out.append(("late", j))
        if faults_left and not w.crashed and "crash" in allowed:
            out.append(("crash",))
        if stalled:
            if not urgent:
                out.append(("tick",))  # P's next deadline, or the end of the stall
            if w.t > w.stall[0]:
                out.append(("resume",))
        else:
            if faults_left and "stall" in allowed:
                out.append(("stall",))
            if not w.net and self._next_time(w) is not None:
                out.append(("tick",))
                if faults_left and "lose" in allowed and self._hb_due(w):
                    out.append(("tick_lose_hb",))
        return out

    @staticmethod
    def _parked(m: tuple) -> bool:
        """A message D's own loop must handle (a reply, completion, notif,
        disconnect or new request addressed to D): it waits while D stalls."""
        return m[1] == "D" and m[0] in ("hs", "rdone", "rfail", "notif", "disc", "new", "pushed")

    def _blocks_time(self, w: World, m: tuple) -> bool:
        """Whether time may not pass while ``m`` is in flight.  During a stall
        D's own messages wait, and so may D's posted READs (no progress
        calls), though the fabric may also execute one meanwhile."""
        if w.stall is None:
            return True
        return not (self._parked(m) or (m[0] == "read" and m[1] == "D"))

    def drain_move(self, w: World):
        """The fault-free, deterministic continuation: deliver, schedule, tick."""
        if w.stall is not None:
            return ("resume",)
        if w.net:
            return ("deliver", 0)
        for i, prof in enumerate(self.profiles):
            ph = w.phase[i]
            if ph == ARRIVED:
                return ("alloc", i)
            if ph == ALLOCATED:
                return ("start", i)
            if ph == LOADING and ("D", f"d{i}") in w.reported:
                return ("run", i)
            if ph == RUNNING:
                return ("finish", i)
            ph2 = w.phase2[i]
            if ph == FINISHED and not w.crashed:
                if ph2 == ARRIVED:
                    return ("alloc2", i)
                if ph2 == ALLOCATED:
                    return ("start2", i)
                if ph2 == LOADING and ("P", f"q{i}") in w.reported:
                    return ("run2", i)
                if ph2 == RUNNING:
                    return ("finish2", i)
        if self._next_time(w) is not None:
            return ("tick",)
        return None

    def describe(self, w: World, move: tuple) -> str:
        name = move[0]
        if name in ("deliver", "lose", "dup", "hs_fail", "hs_hang", "read_fail", "read_hang", "write_fail",
                    "write_hang"):
            return f"{name} {w.net[move[1]]} @t={w.t:g}"
        if name == "late":
            return f"late completion of hung {w.stalled[move[1]]} @t={w.t:g}"
        if name == "tick":
            return f"tick to t={self._next_time(w):g}"
        if name == "tick_lose_hb":
            return f"tick to t={self._next_time(w):g}, losing the heartbeats it sends"
        if name == "crash":
            return f"crash P @t={w.t:g}"
        if name == "stall":
            return f"D stalls @t={w.t:g} (for at most {self.cfg.stall:g} s)"
        if name == "resume":
            return f"D resumes @t={w.t:g}"
        if name == "p_abort":
            return f"P aborts lease p{move[1]} @t={w.t:g}"
        return f"{name} request {move[1]} ({self.profiles[move[1]].name}) @t={w.t:g}"

    def _hb_due(self, w: World) -> bool:
        t = self._next_time(w)
        for name, p in w.planes.items():
            hb = p.heartbeats
            for eng, at in hb._next_at.items():
                if at - self.skew[name] <= t and hb._ids.get(eng):
                    return True
        return False

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
    def apply(self, w: World, move: tuple) -> None:
        """Mutate ``w`` by ``move``; raises _Found on a safety violation."""
        name = move[0]
        if name in ("tick", "tick_lose_hb"):
            if name == "tick_lose_hb":
                w.faults += 1
                self._lose_hb = True
            w.t = self._next_time(w)
            for pname in ("D", "P"):
                if (pname == "P" and w.crashed) or (pname == "D" and w.stall is not None):
                    continue
                try:
                    plane = w.planes[pname]
                    nd = plane.next_deadline()
                    if nd is None or nd > self.now(w, pname):
                        continue
                    self._emit(w, pname, self.plane(w, pname).fire_due(self.now(w, pname)))
                finally:
                    self._lose_hb = False
            if w.stall is not None and w.t >= w.stall[1]:
                self._resume(w)
        elif name == "stall":
            w.faults += 1
            w.stall = (w.t, w.t + self.cfg.stall)
        elif name == "resume":
            self._resume(w)
        elif name == "deliver":
            m = w.net[move[1]]
            w.net = w.net[: move[1]] + w.net[move[1] + 1:]
            self._deliver(w, m)
        elif name in ("lose", "dup", "hs_fail", "hs_hang", "read_fail", "read_hang", "write_fail", "write_hang"):
            w.faults += 1
            j = move[1]
            m = w.net[j]
            w.net = w.net[:j] + w.net[j + 1:]
            if name == "dup":
                self._deliver(w, m)
                w.net = w.net + (m,)
            elif name == "hs_fail":
                self._feed(w, m[1], E.HandshakeFailed(engine_id=m[2], reason="injected"))
            elif name == "read_fail":
                w.net = w.net + (("rfail", m[1], m[2]),)
            elif name == "write_fail":
                w.net = w.net + (("wfail", m[1], m[2]),)
            elif name in ("read_hang", "write_hang"):
                w.stalled = w.stalled + (m,)
            # lose / hs_hang: the message is gone
        elif name == "late":
            j = move[1]
            m = w.stalled[j]
            w.stalled = w.stalled[:j] + w.stalled[j + 1:]
            self._deliver(w, m)
        elif name == "crash":
            self._crash(w)
        elif name == "p_abort":
            w.aborts += 1
            self._feed(w, "P", E.LeaseAbort(request_id=f"p{move[1]}"))
        else:
            self._schedule(w, name, move[1])
        self._check(w)

    def _resume(self, w: World) -> None:
        """D's loop runs again: like the driver, it fires every due timer
        (late) before it polls anything, so a READ deadline that passed
        during the stall cancels the READ before its completion is seen."""
        w.stall = None
        plane = w.planes["D"]
        nd = plane.next_deadline()
        if nd is not None and nd <= self.now(w, "D"):
            self._emit(w, "D", self.plane(w, "D").fire_due(self.now(w, "D")))

    def _new_request(self, w: World, i: int) -> None:
        # The params as the connector exports them (connector.py _params):
        # P's lease expiry in P's clock, renewable by heartbeats.
        self._feed(w, "D", E.NewRequest(request_id=f"d{i}", engine_id="P", remote_request_id=f"p{i}",
                                        remote_block_ids=(2,), remote_expiry=w.p_expiry[i], remote_renewable=True,
                                        push=self.profiles[i].push))
        w.phase[i] = ARRIVED

    def _schedule(self, w: World, name: str, i: int) -> None:
        prof = self.profiles[i]
        d, p, q = f"d{i}", f"p{i}", f"q{i}"
        if name == "arrive":
            self._feed(w, "P", E.LeaseGranted(request_id=p, block_ids=(2,), expected_consumers=1))
            w.p_expiry[i] = w.planes["P"].instances["lease"][p].expiry
            if prof.push:  # as the connector does: the push may start once D registers
                self._feed(w, "P", E.PushReady(request_id=p, block_ids=(2,)))
            if w.stall is None:
                self._new_request(w, i)
            else:  # the params wait for D's loop
                w.net = w.net + (("new", "D", d),)
                w.phase[i] = SENT
        elif name == "alloc":
            if prof.awaiting:
                w.awaited = w.awaited | {("D", d)}
            self._feed(w, "D", E.BlocksAllocated(request_id=d, block_ids=(1,), num_remote_tokens=prof.num_remote_tokens,
                                                 awaiting=prof.awaiting))
            w.phase[i] = ALLOCATED
        elif name == "start":
            self._feed(w, "D", E.StartLoad(request_id=d))
            w.phase[i] = LOADING
        elif name == "run":
            self._feed(w, "D", E.RequestRunning(request_id=d))
            w.phase[i] = RUNNING
        elif name == "finish":
            self._feed(w, "D", E.RequestFinished(request_id=d, block_ids=(1,), hold_for_next_turn=prof.turn2))
            lease = w.planes["D"].instances["lease"].get(d)
            # The exported deadline, in D's clock, as the turn-2 reader will get it.
            w.hold_expiry[i] = lease.expiry if lease is not None else None
            w.phase[i] = FINISHED
        elif name == "abort":
            w.aborts += 1
            self._feed(w, "D", E.Abort(request_id=d))
            w.phase[i] = ABORTED
        elif name == "arrive2":
            self._feed(w, "P", E.NewRequest(request_id=q, engine_id="D", remote_request_id=d, remote_block_ids=(1,),
                                            remote_expiry=w.hold_expiry[i]))
            w.phase2[i] = ARRIVED
        elif name == "alloc2":
            w.awaited = w.awaited | {("P", q)}
            self._feed(w, "P", E.BlocksAllocated(request_id=q, block_ids=(3,), num_remote_tokens=4, awaiting=True))
            w.phase2[i] = ALLOCATED
        elif name == "start2":
            self._feed(w, "P", E.StartLoad(request_id=q))
            w.phase2[i] = LOADING
        elif name == "run2":
            self._feed(w, "P", E.RequestRunning(request_id=q))
            w.phase2[i] = RUNNING
        elif name == "finish2":
            self._feed(w, "P", E.RequestFinished(request_id=q, block_ids=(3,)))
            w.phase2[i] = FINISHED
        else:  # pragma: no cover
            raise ValueError(name)

    def _crash(self, w: World) -> None:
        w.faults += 1
        w.crashed = True
        # The process is gone, and its memory with it: nothing it held leaks.
        w.planes["P"] = ControlPlane(self.cfg.plane, machines=self.machines)
        w.owned.add("P")
        net = []
        for m in w.net + w.stalled:
            if m[0] == "read" and m[3] == "P":
                net.append(("rfail", m[1], m[2]))  # the transport sees the peer die
            elif m[0] in ("notif", "hb", "preg") and m[1] == "P":
                continue
            elif m[0] in ("hs", "read", "rdone", "rfail", "disc", "write", "wdone", "wfail") and m[1] == "P":
                continue
            else:
                net.append(m)
        net.append(("disc", "D", "P"))
        w.net = tuple(net)
        w.stalled = ()
        w.phase2 = [DEAD if ph not in (NEW,) else ph for ph in w.phase2]
        # P's scheduler died with it: nothing there awaits a report any more.
        w.awaited = frozenset(k for k in w.awaited if k[0] != "P")
        w.reported = frozenset(k for k in w.reported if k[0] != "P")

    def _deliver(self, w: World, m: tuple) -> None:
        k = m[0]
        if k == "hs":
            _, src, dst = m
            if dst == "P" and w.crashed:
                self._feed(w, src, E.HandshakeFailed(engine_id=dst, reason="peer down"))
                return
            offset = self.skew[dst] - self.skew[src]
            w.activity[(src, dst)] = self.now(w, src)
            self._feed(w, src, E.HandshakeOk(engine_id=dst, samples=((offset, 0.001),)))
        elif k == "read":
            _, src, req, dst, rrid, n = m
            if src == "D" and w.stall is not None:
                # The fabric executes a READ of a stalled D (which cannot
                # cancel it): possibly into blocks P reclaimed.  Not a
                # violation yet; accepting its completion would be.
                stale = self._lease_problem(w, src, dst, rrid) is not None
            else:
                self._check_lease(w, src, dst, rrid, "executed")
                stale = False
            w.net = w.net + (("rdone", src, req, dst, stale), ("notif", dst, rrid, src, n))
        elif k == "new":
            self._new_request(w, self.names[m[2]][1])
        elif k == "preg":
            _, dst, prid, drid, deadline = m
            self._feed(w, dst, E.PushRegistered(request_id=prid, engine_id="D", remote_request_id=drid,
                                                remote_block_ids=(1,), remote_deadline=deadline))
        elif k == "write":
            _, src, req, dst, drid = m
            self._check_write(w, src, req, "executed")
            # NIXL delivers the WRITE's notification with it.
            w.net = w.net + (("wdone", src, req), ("pushed", dst, drid))
        elif k == "wdone":
            self._feed(w, m[1], E.WriteDone(request_id=m[2]))
        elif k == "wfail":
            self._feed(w, m[1], E.WriteFailed(request_id=m[2], reason="peer error"))
        elif k == "pushed":
            self._feed(w, m[1], E.PushDone(request_id=m[2]))
        elif k == "rdone":
            _, src, req, dst, stale = m
            inst = w.planes[src].instances["decode_request"].get(req)
            if stale and inst is not None and inst.state == "READING":
                raise _Found("read_of_unheld_lease",
                             f"{src} accepts the completion of READ {req}, which executed while {src} was stalled, "
                             f"after P's lease {inst.remote_request_id} was gone: its READ deadline did not refuse it")
            if inst is not None and inst.state == "READING":
                w.activity[(src, dst)] = self.now(w, src)
            self._feed(w, src, E.ReadDone(request_id=req))
        elif k == "rfail":
            self._feed(w, m[1], E.ReadFailed(request_id=m[2], reason="peer error"))
        elif k == "notif":
            _, dst, rrid, src, n = m
            self._feed(w, dst, E.ConsumerDone(request_id=rrid, consumer=src, expected_consumers=n))
        elif k == "hb":
            for rid in m[2]:
                self._feed(w, m[1], E.LeaseHeartbeat(request_id=rid))
        elif k == "disc":
            self._feed(w, m[1], E.PeerDisconnected(engine_id=m[2], reason="crashed"))
        else:  # pragma: no cover
            raise ValueError(m)

    def _feed(self, w: World, pname: str, event) -> None:
        assert not (pname == "D" and w.stall is not None), f"model bug: {event} fed to a stalled D"
        plane = self.plane(w, pname)
        self._emit(w, pname, plane.handle(event, self.now(w, pname)))

    def _lease_problem(self, w: World, src: str, dst: str, rrid: str) -> str | None:
        """Why ``src`` may not read ``dst``'s lease ``rrid`` now, or None."""
        if dst == "P" and w.crashed:
            return None
        lease = w.planes[dst].instances["lease"].get(rrid)
        if lease is None or lease.state not in HELD_LEASE:
            return "which is " + (lease.state if lease is not None else "gone (released or expired)")
        # Held, but its expiry (in the reader's clock) has come: the owner
        # reclaims the blocks as soon as its timer runs.
        expiry = lease.expiry - self.skew[dst] + self.skew[src]
        if expiry <= self.now(w, src):
            return f"whose expiry t={expiry:g} ({src}'s clock) is <= now t={self.now(w, src):g}"
        return None

    def _check_lease(self, w: World, src: str, dst: str, rrid: str, what: str) -> None:
        problem = self._lease_problem(w, src, dst, rrid)
        if problem is not None:
            if dst == "D":
                raise _Found("turn2_read_of_expired_blocks", f"turn-2 READ {what} against D's held blocks {rrid}, "
                             f"{problem}")
            raise _Found("read_of_unheld_lease", f"READ {what} against P lease {rrid}, {problem}")

    def _check_write(self, w: World, src: str, req: str, what: str) -> None:
        """A WRITE reads the writer's own lease of the same request: it must
        be held (P's clock and timers decide; no offset is involved)."""
        if src == "P" and w.crashed:
            return
        lease = w.planes[src].instances["lease"].get(req)
        if lease is None or lease.state not in HELD_LEASE:
            state = lease.state if lease is not None else "gone (released, expired or aborted)"
            raise _Found("write_from_unheld_lease", f"WRITE {what} from {src} lease {req}, which is {state}: "
                         f"the push outlived the blocks it writes from")

    def _emit(self, w: World, pname: str, actions) -> None:
        for a in actions:
            cname = type(a).__name__
            if cname == "PostRead":
                self._check_lease(w, pname, a.engine_id, a.remote_request_id, "posted")
                w.net = w.net + (("read", pname, a.request_id, a.engine_id, a.remote_request_id,
                                  a.expected_consumers),)
            elif cname == "PostWrite":
                self._check_write(w, pname, a.request_id, "posted")
                w.net = w.net + (("write", pname, a.request_id, a.engine_id, a.remote_request_id),)
            elif cname == "SendPushRegistration":
                w.net = w.net + (("preg", a.engine_id, a.remote_request_id, a.request_id, a.deadline),)
            elif cname == "ReleaseXfer":
                if a.cancel:
                    # A cancelled transfer never executes; its completion may not come.
                    keep = lambda m: not (m[0] in ("read", "write") and m[1] == pname  # noqa: E731
                                          and m[2] == a.request_id)
                    w.net = tuple(m for m in w.net if keep(m))
                    w.stalled = tuple(m for m in w.stalled if keep(m))
            elif cname == "SendNotif":
                w.net = w.net + (("notif", a.engine_id, a.remote_request_id, pname, a.expected_consumers),)
            elif cname == "SendHeartbeat":
                # Delivered at once (a heartbeat commutes with everything but
                # the lease it renews); losing one is the tick_lose_hb fault.
                if not (pname == "P" and w.crashed) and not (a.engine_id == "P" and w.crashed):
                    if self._lose_hb:
                        continue
                    if a.engine_id == "D" and w.stall is not None:
                        # P's turn-2 heartbeats to a stalled D: D's hold is a
                        # fixed TTL they do not renew, so dropping them changes nothing.
                        continue
                    for rid in sorted(a.request_ids):
                        self._feed(w, a.engine_id, E.LeaseHeartbeat(request_id=rid))
            elif cname == "StartHandshake":
                w.net = w.net + (("hs", pname, a.engine_id),)
            elif cname == "ReportRecv":
                k = (pname, a.request_id)
                if k not in w.awaited:
                    raise _Found("report_not_awaited", f"{pname} reported recv {a.request_id}, which was not awaited")
                if k in w.reported:
                    raise _Found("report_twice", f"{pname} reported recv {a.request_id} twice")
                w.reported = w.reported | {k}
            elif cname == "FreeBlocks":
                k = (pname, a.request_id)
                if k in w.freed:
                    raise _Found("double_free", f"{pname} freed the blocks of lease {a.request_id} twice")
                w.freed = w.freed | {k}

    def _check(self, w: World) -> None:
        ttl = self.ttl
        for pname, plane in w.planes.items():
            if plane.anomalies:
                for what, kind, key, ev, detail in plane.anomalies:
                    if what == "protocol_violation":
                        raise _Found("protocol_violation", f"{pname} {kind}:{key} {ev}: {detail}")
                plane.anomalies.clear()
            engines = plane.instances["remote_engine"]
            for kind in ("decode_request", "push_write"):
                holds = self.holds[kind]
                for key, inst in plane.instances[kind].items():
                    if "engine_ref" in holds[inst.state]:
                        e = engines.get(inst.engine_id)
                        # Gone, or evicted and since re-created without this reference.
                        if e is None or (kind, key) not in e.refs:
                            raise _Found("evicted_while_referenced",
                                         f"{pname} {kind}:{key} in {inst.state} holds a reference to engine "
                                         f"{inst.engine_id}, which was evicted under it")
            now = self.now(w, pname)
            for key, e in engines.items():
                if e.state == "STALE":
                    seen = w.activity.get((pname, key))
                    if seen is not None and seen + ttl > now:
                        raise _Found("stale_despite_activity",
                                     f"{pname} marked engine {key} STALE at t={now:g}, but saw activity at "
                                     f"t={seen:g} (engine_ttl {ttl:g})")

    def quiescent_problems(self, w: World) -> list[str]:
        problems = []
        for pname, plane in w.planes.items():
            for kind, key, state, res in plane.held():
                problems.append(f"{pname} {kind}:{key} still holds {list(res)} in {state}")
            for kind in ("decode_request", "lease", "push_write"):
                for key, inst in plane.instances[kind].items():
                    if not self.holds[kind][inst.state]:
                        problems.append(f"{pname} {kind}:{key} never finished (stuck in {inst.state})")
        for pname, key in sorted(w.awaited - w.reported):
            problems.append(f"{pname} recv {key} awaited by the scheduler was never reported")
        return problems

    # ------------------------------------------------------------- canon
    def canon(self, w: World, symmetry: bool) -> tuple:
        n = self.n
        local = [self._local(w, i) for i in range(n)]
        if symmetry and n > 1:
            order = sorted(range(n), key=lambda i: repr(local[i]))
        else:
            order = list(range(n))
        rename = {}
        for new, old in enumerate(order):
            for pre in "dpq":
                rename[f"{pre}{old}"] = f"{pre}{new}"
        shared = []
        for pname in ("D", "P"):
            plane = w.planes[pname]
            now = self.now(w, pname)
            for key, e in sorted(plane.instances["remote_engine"].items()):
                up = e.state in ("CONNECTED", "STALE")
                shared.append((pname, key, e.state, self._rel(e.deadline, now),
                               tuple(sorted((k, rename.get(r, r)) for k, r in e.refs)),
                               tuple((k, rename.get(r, r)) for k, r in e.waiters),
                               e.attempts, None if up else self._rel(e.retry_at, now),
                               self._rel(e.last_activity, now) if up else None,
                               e.clock_offset, e.notify_only,
                               self._rel(w.activity.get((pname, key)), now) if up else None))
            hb = plane.heartbeats
            for eng in sorted(hb._next_at):
                # The chain's last send decides whether the next one breaks it
                # and how far it extended P's leases (the READ gate).  Its
                # first send enters only as the gate's comparisons, per request
                # (``_gate_sig``): its raw age would split equivalent states.
                shared.append((pname, "hb", eng, self._rel(hb._next_at[eng], now),
                               tuple(sorted(hb._ranks.get(eng, ()))), self._rel(hb._last_sent.get(eng), now)))
        net = []
        for m in w.net:
            if m[0] == "hb":
                net.append(("hb", m[1], tuple(sorted(rename.get(r, r) for r in m[2]))))
            elif m[0] == "preg":  # D's give-up time (D's clock), relative
                net.append(("preg", m[1], rename.get(m[2], m[2]), rename.get(m[3], m[3]),
                            self._rel(m[4], self.now(w, "D"))))
            else:
                net.append(tuple(rename.get(x, x) if isinstance(x, str) else x for x in m))
        net.sort()
        stalled = sorted(tuple(rename.get(x, x) if isinstance(x, str) else x for x in m) for m in w.stalled)
        stall = None if w.stall is None else (self._rel(w.stall[0], self.now(w, "D")),
                                              self._rel(w.stall[1], self.now(w, "D")))
        return (tuple(local[i] for i in order), tuple(shared), tuple(net), tuple(stalled),
                w.faults, w.aborts, w.crashed, stall)

    def _rel(self, v, now):
        if v is None:
            return None
        r = v - now
        # Past times this far back compare the same against every deadline.
        return r if r > -self.horizon else -self.horizon

    def _local(self, w: World, i: int) -> tuple:
        d, p, q = f"d{i}", f"p{i}", f"q{i}"
        D, P = w.planes["D"], w.planes["P"]
        nd, np_ = self.now(w, "D"), self.now(w, "P")
        hbd = D.heartbeats._ids.get("P", {}).get(p)
        hbp = P.heartbeats._ids.get("D", {}).get(d)
        return (
            self.profiles[i].name, w.phase[i], w.phase2[i],
            self._req_sig(D.instances["decode_request"].get(d), nd, "D", D, self.profiles[i].num_remote_tokens > 0),
            self._lease_sig(P.instances["lease"].get(p), np_),
            self._lease_sig(D.instances["lease"].get(d), nd),
            self._req_sig(P.instances["decode_request"].get(q), np_, "P", P, True),
            self._push_sig(P.instances["push_write"].get(p), np_),
            ("D", d) in w.awaited, ("D", d) in w.reported, ("P", q) in w.awaited, ("P", q) in w.reported,
            ("P", p) in w.freed, ("D", d) in w.freed,
            self._rel(w.hold_expiry[i], nd) if w.phase2[i] == NEW else None,
            hbd, hbp,
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
        return (s, self._gate_sig(r, now, pname, plane) if reads else None, self._rel(r.deadline, now), r.engine_id,
                r.expected_consumers, r.push, r.num_remote_tokens,
                None if s in ("NEW", "HEARTBEATING", "RECV_DONE", "RECV_FAILED", "RUNNING")
                else self._rel(r.recv_deadline, now),
                self._rel(r.transfer_deadline, now) if s == "READING" else None,
                self._rel(r.push_deadline, now) if s == "AWAITING_PUSH" else None,
                r.clock_offset)

    def _offset(self, pname: str, engine: str) -> float:
        """The clock offset a handshake with ``engine`` measures (remote - local)."""
        return self.skew[engine] - self.skew[pname]

    def _gate_sig(self, r, now, pname, plane) -> tuple | None:
        """What the READ gate on a renewable lease reads besides times already
        in the state.  ``remote_valid_until`` extends the expiry E (our clock)
        by the last send L iff L > arrived A and E > max(A + interval, first
        send S of the chain).  L is in the shared signature (relative);
        A and S enter only through these comparisons: a later L (> now > A)
        always passes the first, the second is fixed, and a later S (>= now)
        compares with E's relative value, which is in the signature.  So two
        states with equal signatures decide every future gate alike, however
        long ago A and S were."""
        if r.remote_expiry is None or r.state not in GATE_STATES:
            return None
        e = r.remote_expiry - self._offset(pname, r.engine_id)
        # An expiry already past only ever loses a comparison (the gate's
        # margin is >= 0, later first sends are >= now): all alike.
        rel_e = max(e - now, 0.0)
        if not r.remote_renewable:
            return (rel_e,)
        since, last = plane.heartbeats.chain(r.engine_id)
        sent = last is not None and last > r.arrived
        fixed = e > r.arrived + plane.config.heartbeat_interval
        chained = since is None or e > since
        if sent and fixed and chained and e <= last + plane.heartbeats.max_gap:
            # The chain dominates E for good: while it lasts the gate reads
            # last' + extension > E, and a send that breaks it comes more
            # than max_gap after ``last``, past E, so E no longer counts and
            # is already <= now when the gate next reads it: declined.
            return ("chained",)
        return (rel_e, sent, fixed, chained)

    def _exported_sig(self, w: World, i: int, np_: float, D: ControlPlane) -> tuple:
        # D's NewRequest will set arrived >= now, after every send so far.
        since, _ = D.heartbeats.chain("P")
        e = w.p_expiry[i] - self._offset("D", "P")
        return (self._rel(w.p_expiry[i], np_), since is None or e > since)

    def _push_sig(self, push, now) -> tuple | None:
        if push is None:
            return None
        # D's give-up time, in P's clock as the push compares it.
        until = None if push.remote_deadline is None else push.remote_deadline - self._offset("P", "D")
        return (push.state, self._rel(push.deadline, now), self._rel(until, now), bool(push.block_ids),
                push.engine_id)

    def _lease_sig(self, lease, now) -> tuple | None:
        if lease is None:
            return None
        return (lease.state, self._rel(lease.deadline, now), self._rel(lease.expiry, now), lease.expected_consumers,
                tuple(sorted(lease.consumers)), lease.renewable)


# ------------------------------------------------------------------ search
def explore(config: ExploreConfig | None = None, *, machines: dict[str, Machine] | None = None,
            **overrides: Any) -> ExploreResult:
    """Breadth-first exploration of every interleaving up to ``max_depth``.

    ``overrides`` are ExploreConfig fields (``explore(requests=("read",))``).
    Violations carry the shortest move sequence and replayable logs.
    """
    cfg = attrs.evolve(config or ExploreConfig(), **overrides)
    model = Model(cfg, machines)
    res = ExploreResult(cfg)
    start = time.perf_counter()
    sym = cfg.symmetry
    w0 = model.initial()
    k0 = model.canon(w0, sym)
    parent: dict = {k0: None}
    depth = {k0: 0}
    frontier = deque([(w0, k0)])
    drain_ok: set = set()
    found_kinds: set = set()

    def trace(k) -> list:
        moves = []
        while parent[k] is not None:
            k, m = parent[k]
            moves.append(m)
        return moves[::-1]

    def report(kind, message, moves) -> bool:
        if kind in found_kinds:
            return False
        found_kinds.add(kind)
        res.violations.append(_counterexample(model, kind, message, moves))
        return cfg.stop_at_first

    stop = False
    while frontier and not stop:
        w, k = frontier.popleft()
        dk = depth[k]
        if cfg.liveness and k not in drain_ok:
            bad = _drain(model, w, k, drain_ok, sym)
            res.drained += 1
            if bad is not None:
                kind, message, extra = bad
                if report(kind, message, trace(k) + extra):
                    break
        if dk >= cfg.max_depth:
            res.frontier_cut += 1
            continue
        for m in model.moves(w):
            w2 = w.clone()
            res.transitions += 1
            try:
                model.apply(w2, m)
            except _Found as f:
                if report(f.kind, f.message, trace(k) + [m]):
                    stop = True
                    break
                continue
            k2 = model.canon(w2, sym)
            if k2 in parent:
                continue
            parent[k2] = (k, m)
            depth[k2] = dk + 1
            res.max_depth_reached = max(res.max_depth_reached, dk + 1)
            frontier.append((w2, k2))
            if len(parent) >= cfg.max_states:
                res.truncated = True
                stop = True
                break
    res.states = len(parent)
    res.elapsed = time.perf_counter() - start
    return res


def _drain(model: Model, w: World, k, drain_ok: set, sym: bool):
    """Run the fault-free continuation; None when it ends clean."""
    w = w.clone()
    path_keys = [k]
    moves: list = []
    for _ in range(model.cfg.drain_limit):
        m = model.drain_move(w)
        if m is None:
            problems = model.quiescent_problems(w)
            if problems:
                return "liveness", "; ".join(problems), moves
            drain_ok.update(path_keys)
            return None
        moves.append(m)
        try:
            model.apply(w, m)
        except _Found as f:
            return f.kind, f.message + " (during the fault-free drain)", moves
        k2 = model.canon(w, sym)
        if k2 in drain_ok:
            drain_ok.update(path_keys)
            return None
        path_keys.append(k2)
    return "liveness", f"no quiescence within {model.cfg.drain_limit} fault-free steps", moves


def _counterexample(model: Model, kind: str, message: str, moves: list) -> Violation:
    """Re-execute the moves on fresh planes with recorders: readable steps and logs."""
    w = model.initial(record=True)
    recorders = {n: p.recorder for n, p in w.planes.items()}
    labels = []
    for m in moves:
        labels.append(model.describe(w, m))
        try:
            model.apply(w, m)
        except _Found:
            break
    logs = {n: r.lines() for n, r in recorders.items()}
    return Violation(kind, message, labels, logs)


def write_counterexamples(result: ExploreResult, directory: str) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths = []
    for n, v in enumerate(result.violations, 1):
        paths += v.write(os.path.join(directory, f"{n:02d}-{v.kind}"))
    return paths
