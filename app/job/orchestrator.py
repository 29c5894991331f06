"""``kvplane run``: a prefill and a decode process exchanging KV over real NIXL.

The parent is the proxy and the orchestrator: it starts P and D (multiprocessing
'spawn'), sends P a synthetic request stream, forwards P's kv_transfer_params
to D (and D's held-block params back to P for a bidirectional turn 2),
injects the requested faults, waits until both sides hold no blocks, and
prints and writes a summary (report.py).  It imports neither torch nor NIXL.

Every wait has a timeout and the children are always stopped in ``finally``
(SIGCONT, then terminate, then kill), so a crashed or hung child cannot hang
the parent, and Ctrl-C cleans up.
"""
from __future__ import annotations

import heapq
import importlib.util
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable

import attrs

from .messages import (TO_PARENT, Abandon, Abandoned, Crashed, CurveKeys, Decode, Decoded, Finish, NodeOptions, Prefill,
                       Prefilled, Ready, Release, Released, Status, StatusRequest, Summary, Turn2, Turn2Done,
                       handlers)
from .netns import HostNet, NetnsUnavailable
from .options import SLACK_S, RunError, RunOptions, decode_roles, engine_id_of, is_prefill, prefill_roles
from .report import Partition, build_summary, summary_table
from .workload import Req, make_stream

# The NIXL distributions whose bindings transport/nixl_agent.py imports.
NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
# One line each; the command works from the checkout (kvplane is on no package index).
INSTALL_RUN = "pip install -e '.[run]' --extra-index-url https://download.pytorch.org/whl/cpu"
NO_NIXL = (f"kvplane run: NIXL is not installed: from the checkout, {INSTALL_RUN} "
           "(CUDA 13 hosts: '.[torch,nixl-cu13]')")
NO_TORCH = f"kvplane run: torch is not installed: from the checkout, {INSTALL_RUN}"


# What an engine process does before it reports ready (node.py); D
# handshakes with P over the side channel on its first request.
STARTING = "spawn, import torch and NIXL, NIXL agent, side channel"


class StartupFailed(RuntimeError):
    """An engine process did not come up (in time); the job stops them all."""


def torch_installed() -> bool:
    """Whether torch is importable (looked up, not imported)."""
    return importlib.util.find_spec("torch") is not None


def nixl_installed() -> bool:
    """Whether a NIXL binding is importable (looked up, not imported: the
    parent stays free of NIXL and torch)."""
    return any(importlib.util.find_spec(m) is not None for m in NIXL_MODULES)


def run_keys(roles: tuple[str, ...] = ("P", "D")) -> dict[str, CurveKeys]:
    """A CURVE keypair per node for this run; each node gets its own secret
    and the public keys of those it talks to (their server keys and its
    allow-list): a prefill engine every decoder's, a decoder every prefill engine's."""
    import zmq

    pairs = {role: zmq.curve_keypair() for role in roles}

    def peers(role: str) -> tuple[str, ...]:
        return tuple(r for r in roles if is_prefill(r) != is_prefill(role))

    return {role: CurveKeys(keypair=pairs[role], peers={engine_id_of(o): pairs[o][0] for o in peers(role)})
            for role in roles}


class _Child:
    def __init__(self, role: str, proc, conn):
        self.role, self.proc, self.conn = role, proc, conn
        self.ready: Ready | None = None
        self.summary: Summary | None = None  # its report when it finished
        self.status: Status | None = None
        self.dead = False  # exited (or killed on purpose)
        self.stopped = False
        self.killed = False  # by --kill-decode-at (its exit is no error)
        self.abandoned: Abandoned | None = None  # its answer to Abandon (what it gave up)
        self.released: Released | None = None  # its answer to Release


class Orchestrator:
    def __init__(self, opts: RunOptions, progress=None, hosts: HostNet | None = None):
        self.o = opts
        self.progress = progress
        self.hosts = hosts  # --hosts netns: the namespaces P and D run in, and the link's faults
        # --partition-at: each partition's window (monotonic start, end), in order.
        self.partitions: list[Partition] = []
        self.decoders = decode_roles(opts.decode_engines)
        self.prefills = prefill_roles(opts.prefill_engines)
        self._next_prefill = 0  # round robin
        self._node_opts: dict[str, Any] = {}  # what every node is started with (start())
        self._keys: dict[str, CurveKeys] = {}
        self._next_decoder = 0  # round robin
        self.reqs = make_stream(opts)
        self.by_lid = {r.lid: r for r in self.reqs}
        self.children: dict[str, _Child] = {}
        self.t0 = 0.0
        self.fault: dict[str, Any] = {}
        self.fault_at: float | None = None
        self.errors: list[str] = []
        self.phase = f"starting P and D ({STARTING})"
        self.startup_s: float | None = None
        self.abandoning: str | None = None  # why the run is being given up (timeout, a crash)
        self.abandoned: dict | None = None
        self._open = {r.lid for r in self.reqs}  # requests not done yet
        self._next_unsent = 0  # reqs are in arrival order
        self._held = False  # the stream's last requests were held for a restarted decoder
        self._turn2_heap: list[tuple[float, int, str]] = []  # (due, seq, lid)
        self._seq = 0
        self._progress_at = 0.0
        self._handle = handlers(TO_PARENT, {
            Ready: self.on_ready, Crashed: self.on_crashed, Status: self.on_status, Summary: self.on_summary,
            Abandoned: self.on_abandoned, Released: self.on_released, Prefilled: self.on_prefilled,
            Decoded: self.on_decoded, Turn2Done: self.on_turn2_done})

    def summary_of(self, role: str) -> Summary | None:
        """The report a side sent when it finished (None if it never did)."""
        child = self.children.get(role)
        return None if child is None else child.summary

    def decode_summaries(self) -> dict[str, Summary | None]:
        """Every decode engine's report, by role (None: it sent none)."""
        return {role: self.summary_of(role) for role in self.decoders}

    def prefill_summaries(self) -> dict[str, Summary | None]:
        """Every prefill engine's report, by role (None: it sent none)."""
        return {role: self.summary_of(role) for role in self.prefills}

    def killed_roles(self) -> list[str]:
        return [role for role, c in self.children.items() if c.killed]

    def _route(self) -> str | None:
        """The decode engine the next request goes to (round robin over the live ones)."""
        live = [r for r in self.decoders if not self.children[r].dead and not self.children[r].killed
                and self.children[r].ready is not None]
        if not live:
            return None
        self._next_decoder += 1
        return live[(self._next_decoder - 1) % len(live)]

    def _route_prefill(self) -> str:
        """The prefill engine the next request goes to (round robin)."""
        self._next_prefill += 1
        return self.prefills[(self._next_prefill - 1) % len(self.prefills)]

    # ------------------------------------------------------------ processes
    def start(self) -> None:
        o = self.o
        self._node_opts = dict(
            plane=o.plane_config(), out=os.path.abspath(o.out), clock_skew=o.clock_skew,
            drop_notifications=o.drop_notifications, seed=o.seed, num_blocks=o.num_blocks,
            block_elems=o.block_elems, overload=o.overload, tp={"P": o.prefill_tp, "D": o.decode_tp},
            # A loop gap this long may have outlived P's lease (listed as a stall; see node.py).
            stall_limit=max(0.5, o.extension - o.interval - SLACK_S),
        )
        from .node import node_main  # noqa: F401  (fail here, not in a child, if it cannot import)

        roles = (*self.prefills, *self.decoders)
        self._keys = run_keys(roles)
        for role in roles:
            self._spawn(role)
        started = time.monotonic()
        deadline = started + self.o.startup_timeout
        while any(c.ready is None for c in self.children.values()):
            self._startup_phase()
            if time.monotonic() > deadline:
                late = [r for r, c in self.children.items() if c.ready is None]
                raise StartupFailed(f"engine process {' and '.join(late)} did not start within "
                                    f"{self.o.startup_timeout:g} s (--startup-timeout)")
            self.pump(0.2)
            if self.errors or any(c.dead for c in self.children.values()):
                # The last line of a child's traceback names the error; the
                # whole traceback stays in the summary's errors.
                why = [e.strip().splitlines()[-1] if "crashed" in e else e for e in self.errors]
                raise StartupFailed("an engine process failed to start: " + "; ".join(why or ["exited"]))
        self.startup_s = time.monotonic() - started

    def _spawn(self, role: str, incarnation: int = 0) -> None:
        """Start ``role``'s engine process (``incarnation`` > 0: again, after a restart)."""
        from .node import node_main

        o = self.o
        # Each node applies its placement first thing (UCX devices, its namespace).
        where = self.hosts.placement(role) if self.hosts is not None else o.placement()
        kind = "P" if is_prefill(role) else "D"  # what the node runs as: every decoder is a D
        stem = "" if role in ("P", "D") else f"{'prefill' if kind == 'P' else 'decode'}{role[1:]}"
        if incarnation:
            stem = f"{stem or 'decode'}.incarnation{incarnation}"  # the old one's log stays as it ended
        parent, child = mp.get_context("spawn").Pipe()
        node = NodeOptions(**self._node_opts, engine_ids={kind: engine_id_of(role)},
                           curve=self._keys[role], placement=where, log_stem=stem)
        proc = mp.get_context("spawn").Process(target=node_main, args=(kind, child, node),
                                               # Not a daemon: a node spawns its worker ranks.
                                               name=f"kvplane-{role}")
        saved = os.environ.get("NIXL_LOG_LEVEL")
        os.environ["NIXL_LOG_LEVEL"] = "ERROR"
        try:
            proc.start()
        finally:
            if saved is None:
                os.environ.pop("NIXL_LOG_LEVEL", None)
            else:
                os.environ["NIXL_LOG_LEVEL"] = saved
        child.close()
        self.children[role] = _Child(role, proc, parent)

    def _startup_phase(self) -> None:
        """Say which engine processes are still starting (the progress bar's text)."""
        waiting = [r for r, c in self.children.items() if c.ready is None]
        ready = [r for r, c in self.children.items() if c.ready is not None]
        phase = f"starting {' and '.join(waiting)} ({STARTING})"
        if ready:
            phase += f"; {' and '.join(ready)} ready"
        if phase != self.phase:
            self.phase = phase
            if self.progress is not None:
                self.progress(self)

    def stop_all(self) -> None:
        for c in self.children.values():
            p = c.proc
            if p.pid is None:
                continue
            if c.stopped:
                _signal_engine(c, signal.SIGCONT)
            if p.is_alive():
                p.join(timeout=2.0 if c.summary is not None else 0.2)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
            c.conn.close()

    # ------------------------------------------------------------ messages
    def pump(self, timeout: float) -> None:
        """Handle every message ready within ``timeout`` (and notice exits)."""
        live = [c for c in self.children.values() if not c.dead and not c.stopped]
        handles = [c.conn for c in live] + [c.proc.sentinel for c in live]
        if not handles:
            time.sleep(timeout)
            return
        for h in mp_wait(handles, timeout=timeout):
            for c in live:
                if h is c.conn:
                    self._drain(c)
                elif h is c.proc.sentinel:
                    self._drain(c)
                    c.proc.join(timeout=1.0)  # reap it, so exitcode is known
                    c.dead = True
                    if not c.killed and c.summary is None:
                        self.errors.append(f"{c.role} exited unexpectedly (exit code {c.proc.exitcode})")

    def _kill(self, c: _Child) -> None:
        """SIGKILL an engine and wait for it; what it sent before it died is
        still in the pipe, so it is read before the engine counts as dead."""
        c.killed = True
        _signal_engine(c, signal.SIGKILL)
        c.proc.join(timeout=5.0)
        self._drain(c)
        c.dead = True

    def _drain(self, c: _Child) -> None:
        try:
            while c.conn.poll(0):
                msg = c.conn.recv()
                self._handle[type(msg)](c, msg)
        except (EOFError, OSError):
            c.dead = True

    def send(self, role: str, msg) -> bool:
        c = self.children[role]
        if c.dead:
            return False
        try:
            c.conn.send(msg)
            return True
        except (BrokenPipeError, OSError):
            c.dead = True
            return False

    def on_ready(self, c: _Child, msg: Ready) -> None:
        c.ready = msg

    def on_crashed(self, c: _Child, msg: Crashed) -> None:
        self.errors.append(f"{c.role} crashed:\n{msg.traceback}")

    def on_status(self, c: _Child, msg: Status) -> None:
        c.status = msg

    def on_summary(self, c: _Child, msg: Summary) -> None:
        c.summary = msg

    def on_abandoned(self, c: _Child, msg: Abandoned) -> None:
        c.abandoned = msg

    def on_released(self, c: _Child, msg: Released) -> None:
        c.released = msg

    def on_prefilled(self, c: _Child, msg: Prefilled) -> None:
        r = self.by_lid[msg.lid]
        decoder = None if self.abandoning or (self.fault_at is not None and not self._lives_on()) else self._route()
        if decoder is None:
            # The proxy routes nothing to a decoder it knows is down (P's
            # lease expires), nor after a timeout (P releases it).
            why = "not routed: decode down" if self.abandoning is None else f"not routed: {self.abandoning}"
            r.turn1, r.detail = ("failed" if self.abandoning is None else "abandoned"), why
            if r.hold:
                r.turn2 = "skipped" if self.abandoning is None else "abandoned"
            self._advance(r)
            return
        params = dict(msg.params)
        if r.push:
            params["push"] = True
        r.decoder = decoder
        self.send(decoder, Decode(lid=r.lid, request_id=f"d-{r.lid}", nblocks=r.nblocks, prefix=r.prefix,
                              await_full=r.kind == "full_awaited", hold=r.hold, params=params,
                              granted_at=msg.granted_at))

    def on_decoded(self, c: _Child, msg: Decoded) -> None:
        r = self.by_lid[msg.lid]
        r.turn1, r.detail = msg.outcome, msg.detail
        if r.hold:
            if msg.hold is None:
                r.turn2 = "skipped"
            else:
                r.hold_params, r.hold_at = msg.hold, time.monotonic()
                if self.abandoning:
                    r.turn2 = "abandoned"  # no new work after a timeout; D releases the hold
                elif self.fault_at is not None:
                    r.turn2 = "skipped"  # no new work after a fault; D's hold times out
                else:
                    # A late turn 2 arrives inside the safety margin: the gate must decline it.
                    delay = self.o.hold_ttl - self.o.expiry_margin / 2 if r.late else 0.0
                    r.turn2_due = r.hold_at + delay
                    self._seq += 1
                    heapq.heappush(self._turn2_heap, (r.turn2_due, self._seq, r.lid))
        self._advance(r)

    def on_turn2_done(self, c: _Child, msg: Turn2Done) -> None:
        r = self.by_lid[msg.lid]
        r.turn2 = msg.outcome
        self._advance(r)

    def _advance(self, r: Req | None = None) -> None:
        """After outcomes changed: keep the set of open requests (one request,
        or all of them after a bulk change) and the progress bar current."""
        if r is None:
            self._open = {x.lid for x in self.reqs if not x.done}
        elif r.done:
            self._open.discard(r.lid)
        if self.progress is not None:
            now = time.monotonic()
            if now - self._progress_at > 0.1 or not self._open:  # O(requests): not per message
                self._progress_at = now
                self.progress(self)

    # ------------------------------------------------------------ the run
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> dict:
        o = self.o
        self.start()
        self.t0 = time.monotonic()
        hard_deadline = self.t0 + o.timeout
        fault_kind = "kill" if o.kill_decode_at is not None else "hang" if o.hang_decode_at is not None else None
        fault_time = o.kill_decode_at if fault_kind == "kill" else o.hang_decode_at
        self.phase = "streaming requests (D handshakes with P on its first)"
        if self.progress is not None:
            self.progress(self)
        timed_out = False
        while True:
            now = time.monotonic()
            if now > hard_deadline:
                self.errors.append(f"timed out after {o.timeout:g} s in phase {self.phase!r}")
                timed_out = True
                break
            if fault_kind and self.fault_at is None and now - self.t0 >= fault_time:
                self._inject(fault_kind)
            self._partition_step(now)
            self._restart_step(now)
            rank_fault = self._lives_on()  # the service lives on: the run goes on as without a fault
            if self.fault_at is None or rank_fault:
                self._send_due(now)
            if self.fault_at is not None and not rank_fault and self._fault_settled():
                break
            if (self.fault_at is None or rank_fault) and not self._open and not self._partition_pending(now) \
                    and not self._restart_pending() and not self._eviction_pending(now):
                if not fault_kind or now - self.t0 >= fault_time:
                    break
            if self.errors:
                break
            self.pump(0.01)
        if self.errors:
            # A timeout, or a side that crashed: whatever still runs gives up
            # its work and frees what it holds, so no block outlives the job.
            self._abandon("timed out" if timed_out else "a side failed")
        else:
            self._drain_blocks(hard_deadline)
        self._collect_summaries()
        return build_summary(self)

    def _lives_on(self) -> bool:
        """A fault the service outlives: one rank of the decoder, or one decoder of several."""
        o = self.o
        return o.rank is not None or o.restart_decode_at is not None or \
            (o.kill_decode_at is not None and o.decode_engines > 1)

    def _partition_step(self, now: float) -> None:
        """--partition-at / --partition-for: cut the link when due, heal it when over."""
        o = self.o
        if self.hosts is None or o.partition_at is None or o.partition_for is None:
            return
        if not self.partitions and now - self.t0 >= o.partition_at:
            self.hosts.partition()
            self.partitions.append(Partition(start=now, end=None))
            self.phase = f"link down for {o.partition_for:g} s"
        elif self.partitions and self.partitions[-1].end is None and now - self.t0 >= o.partition_at + o.partition_for:
            self.hosts.heal()
            self.partitions[-1].end = now
            self.phase = "link up again: P reclaims what the partition stranded"

    def _partition_pending(self, now: float) -> bool:
        """A partition still to come or under way: the run goes on past its heal."""
        o = self.o
        if self.hosts is None or o.partition_at is None:
            return False
        return not self.partitions or self.partitions[-1].end is None

    def _send_due(self, now: float) -> None:
        """Send the prefills whose arrival time has come, and the turn 2s that
        are due (both in order, without scanning every request)."""
        while self._next_unsent < len(self.reqs):
            r = self.reqs[self._next_unsent]
            if r.sent:
                self._next_unsent += 1
                continue
            if r.arrive > now - self.t0:
                break
            if self._held_for_restart():
                self._held = True
                break
            if self._held:  # held for a restart: it arrives when let go
                r.arrive = round(now - self.t0, 3)
            r.prefiller = r.prefiller or self._route_prefill()
            r.sent = self.send(r.prefiller, Prefill(lid=r.lid, request_id=f"p-{r.lid}", nblocks=r.nblocks,
                                                    push=r.push))
            if not r.sent:
                break
            self._next_unsent += 1
        while self._turn2_heap and self._turn2_heap[0][0] <= now:
            _, _, lid = heapq.heappop(self._turn2_heap)
            r = self.by_lid[lid]
            if r.turn2_due is None or r.turn2 is not None:
                continue  # skipped meanwhile
            r.turn2_due = None
            # Turn 2 goes back to the prefill engine of turn 1 (its prefix), which reads D's hold.
            self.send(r.prefiller, Turn2(lid=r.lid, request_id=f"p2-{r.lid}", nblocks=r.nblocks, params=r.hold_params))

    def _abandon(self, why: str) -> None:
        """Give up the run in bounded time and leave nothing held: route
        nothing more, have each live side abort its work through the machines
        (queued requests dropped, recvs in flight aborted, their READs
        cancelled), then, once the other side has done so (or is dead), free
        its leases (P) or holds (D), and wait for both to report 0 blocks."""
        self.abandoning = why
        self.phase = f"{why}: abandoning"
        for c in self.children.values():
            if c.stopped and not c.dead:
                _signal_engine(c, signal.SIGCONT)
                c.stopped = False
        not_sent = set()
        for r in self.reqs:
            if not r.sent:
                r.turn1, r.sent, r.detail = "abandoned", True, f"not sent: {why}"
                not_sent.add(r.lid)
        live = [role for role, c in self.children.items() if not c.dead]
        self._round(live, Abandon(), lambda c: c.abandoned is not None)
        # Only once the reader has stopped: P's leases when D has abandoned
        # (or died), D's holds when P has.
        def stopped(role: str) -> bool:
            return self.children[role].dead or self.children[role].abandoned is not None

        safe = [role for role in live
                if all(stopped(peer) for peer in (self.decoders if is_prefill(role) else self.prefills))]
        self._round(safe, Release(), lambda c: c.released is not None)
        unresolved = {"turn1": 0, "turn2": 0}
        for r in self.reqs:
            if r.turn1 is None:
                r.turn1, r.detail = "abandoned", f"in flight: {why}"
            if r.hold and r.turn2 is None:
                r.turn2 = "abandoned"
            if r.lid not in not_sent:  # sent, then given up (here or when its outcome came)
                unresolved["turn1"] += r.turn1 == "abandoned"
                unresolved["turn2"] += r.hold and r.turn2 == "abandoned"
        self._advance()
        cfg = self.o.plane_config()
        self._drain_blocks(time.monotonic() + cfg.transfer_timeout + 2 * SLACK_S + 5.0)
        self.abandoned = {
            "reason": why, "requests_not_sent": len(not_sent), "in_flight_turn1": unresolved["turn1"],
            "in_flight_turn2": unresolved["turn2"],
            **{role: _last_counts(c) for role, c in self.children.items()},
        }

    def _round(self, roles: list[str], msg, answered: Callable[[_Child], bool], timeout: float = 15.0) -> None:
        """Send ``msg`` to ``roles`` and wait, bounded, until each one that is
        still alive has ``answered``."""
        waiting = [r for r in roles if self.send(r, msg)]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(answered(self.children[r]) or self.children[r].dead for r in waiting):
                return
            self.pump(0.05)

    def _inject(self, kind: str) -> None:
        d = self.children["D"]
        self.fault_at = time.monotonic()
        self.fault = {"kind": kind, "at_s": round(self.fault_at - self.t0, 3)}
        if self.o.rank is not None:
            self._inject_rank(kind, self.o.rank)
            return
        if len(self.decoders) > 1:
            self._kill_one_decoder(self.decoders[-1])
            return
        self.phase = f"decode {'killed' if kind == 'kill' else 'hung'}: P reclaims"
        if kind == "kill":
            self._kill(d)
            for r in self.reqs:
                if r.sent and r.turn1 is None:
                    r.turn1, r.detail = "failed", "decode killed"
        else:
            _signal_engine(d, signal.SIGSTOP)
            d.stopped = True
        for r in self.reqs:  # the proxy routes nothing more to a decoder it knows is down
            if not r.sent:
                r.turn1, r.sent = "skipped", True
            if r.hold and r.turn2 is None and r.turn2_due is not None:
                r.turn2, r.turn2_due = "skipped", None
            elif r.hold and r.turn2 is None and r.turn1 in ("failed", "skipped"):
                r.turn2 = "skipped"
        self._advance()

    def _restart_step(self, now: float) -> None:
        """--restart-decode-at: kill the last decoder, start it again (the
        same engine id, a new process and NIXL agent), route to it once ready."""
        o = self.o
        if o.restart_decode_at is None:
            return
        role = self.decoders[-1]
        if not self.fault and now - self.t0 >= o.restart_decode_at:
            self.fault_at = now
            self.fault = {"kind": "restart", "at_s": round(now - self.t0, 3)}
            in_flight = self._kill_one_decoder(role)
            self.fault["old_incarnation_in_flight"] = in_flight
            self.children[role].conn.close()
            self._spawn(role, incarnation=1)
            self.phase = f"decode engine {engine_id_of(role)} restarting"
        elif self.fault.get("kind") == "restart" and "back_at_s" not in self.fault and \
                self.children[role].ready is not None:
            self.fault["back_at_s"] = round(now - self.t0, 3)
            self.phase = f"decode engine {engine_id_of(role)} back (a new incarnation)"
        elif self.fault.get("kind") == "restart" and "back_at_s" not in self.fault and \
                now - self.fault_at > o.startup_timeout:
            self.errors.append(f"the restarted {engine_id_of(role)} did not start within {o.startup_timeout:g} s")

    def _eviction_pending(self, now: float) -> bool:
        """--kill-decode-at with several decoders: the run lasts until P has
        evicted the dead engine (engine_ttl of silence from the kill at the
        latest, a tick late at most), so the summary shows it."""
        o = self.o
        if o.kill_decode_at is None or o.decode_engines < 2 or self.fault_at is None:
            return False
        until = self.fault_at + o.plane_config().engine_ttl + 2 * SLACK_S
        phase = f"waiting for P to evict {self.fault.get('engine')} (engine_ttl {o.plane_config().engine_ttl:g} s)"
        if now < until and not self._open and self.phase != phase:
            self.phase = phase
            if self.progress is not None:
                self.progress(self)
        return now < until

    def _held_for_restart(self) -> bool:
        """--restart-decode-at: while the restarted engine is not back, the
        stream's last requests (one per decoder, so round robin gives it one)
        wait for it, or a restart slower than the stream (21.6 s on a loaded
        machine, against 15 s of stream) would leave the new incarnation
        nothing to serve."""
        return (self.fault.get("kind") == "restart" and "back_at_s" not in self.fault
                and len(self.reqs) - self._next_unsent <= len(self.decoders))

    def _restart_pending(self) -> bool:
        """A restart still to come, or its engine not back yet: the run goes on."""
        return self.o.restart_decode_at is not None and "back_at_s" not in self.fault

    def _kill_one_decoder(self, role: str) -> list[str]:
        """One decode engine of several dies for good (SIGKILL); the proxy
        routes to the others from now on.  Its requests in flight fail; P
        frees their leases when they expire, and drops the dead engine
        (PeerDisconnected, or engine_ttl of silence)."""
        victim = self.children[role]
        self.fault.update(engine=engine_id_of(role), engines_left=len(self.decoders) - 1)
        in_flight = []
        self.phase = f"decode engine {engine_id_of(role)} killed: the others carry on"
        self._kill(victim)
        for r in self.reqs:
            if r.decoder != role:
                continue
            if r.sent and r.turn1 is None:
                r.turn1, r.detail = "failed", "decode killed"
                in_flight.append(r.lid)
            if r.hold and r.turn2 is None:
                r.turn2, r.turn2_due = "skipped", None  # its hold died with it
        self._advance()
        return in_flight

    def _inject_rank(self, kind: str, rank: int) -> None:
        """One decode worker rank dies (SIGKILL) or hangs (SIGSTOP); the
        engine lives on.  Its scheduler fails the recvs waiting on the rank
        (a hung one once it has been silent too long, then killed), they
        are recomputed, and P frees every rank's lease on its own terms."""
        d = self.children["D"]
        assert d.ready is not None
        self.fault["rank"] = rank
        pid = d.ready.rank_pids[rank]
        self.phase = f"decode rank {rank} {'killed' if kind == 'kill' else 'hung'}: the rest goes on"
        try:
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        except ProcessLookupError:
            pass

    def _fault_settled(self) -> bool:
        """Kill: until P holds no lease blocks.  Hang: the same, then SIGCONT
        D and go on until every request is resolved."""
        d = self.children["D"]
        if d.stopped:
            # (--hang-decode-at runs with one prefill engine: options.py.)
            st = self._ask("P")
            # P's timers fire at its first loop tick after they are due: a P
            # whose loop stalls (a loaded machine) reclaims that much later.
            bound = self.fault_at + self.o.lease + 2 * SLACK_S + 1.0 + (st.max_loop_gap_s if st else 0.0)
            if (st is not None and st.lease_blocks == 0) or time.monotonic() > bound:
                self.fault["p_reclaimed_before_resume"] = st is not None and st.lease_blocks == 0
                self.fault["resumed_at_s"] = round(self.elapsed(), 3)
                _signal_engine(d, signal.SIGCONT)
                d.stopped = False
                self.phase = "decode resumed: draining"
            return False
        return all(self.by_lid[lid].turn1 == "skipped" for lid in self._open)

    def _ask(self, role: str, timeout: float = 2.0) -> Status | None:
        c = self.children[role]
        c.status = None
        if not self.send(role, StatusRequest()):
            return None
        deadline = time.monotonic() + timeout
        while c.status is None and time.monotonic() < deadline and not c.dead:
            self.pump(0.05)
        return c.status

    def _drain_blocks(self, hard_deadline: float) -> None:
        """Wait until both sides hold no blocks (leases expire, holds time out)."""
        self.phase = "draining"
        o = self.o
        limit = min(hard_deadline, time.monotonic() + o.lease + o.hold_ttl + o.plane_config().recv_timeout + 5)
        while time.monotonic() < limit and not self.errors:
            sts = {role: self._ask(role) for role, c in self.children.items() if not c.dead}
            if all(st is not None and st.held_blocks == 0 and st.waiting == 0 and st.loading == 0
                   for st in sts.values()):
                return
            self.pump(0.1)

    def _collect_summaries(self) -> None:
        self.phase = "collecting"
        for role, c in self.children.items():
            if c.stopped:
                _signal_engine(c, signal.SIGCONT)
                c.stopped = False
            self.send(role, Finish())
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and any(c.summary is None and not c.dead for c in self.children.values()):
            self.pump(0.1)


def _last_counts(c: _Child) -> dict | None:
    """What a side reported giving up: its answer to Release, else to Abandon."""
    answer = c.released or c.abandoned
    return None if answer is None else answer.counts


def progress_unit(opts: RunOptions, reqs: list[Req]) -> str:
    """What the progress count counts: "48 turn-1 + 12 turn-2 requests"."""
    turn2 = sum(r.hold for r in reqs)
    return f"{opts.requests} turn-1 + {turn2} turn-2 requests" if turn2 else f"{opts.requests} requests"


def run_job(opts: RunOptions, *, console=None) -> dict:
    """Run the job; returns the summary (also written under ``opts.out``).
    With --hosts netns, inside a pair of namespaces made for it and removed
    on every way out (netns.HostNet)."""
    opts.validate()
    # Faults the service outlives: requests keep arriving before, during and after them.
    span = None
    if opts.partition_at is not None and opts.partition_for is not None:
        span = opts.partition_at + opts.partition_for + opts.lease
    elif opts.kill_decode_at is not None and opts.decode_engines > 1:
        span = opts.kill_decode_at + opts.lease
    elif opts.restart_decode_at is not None:
        span = opts.restart_decode_at + 2 * opts.lease
    if span is not None:
        opts = attrs.evolve(opts, spacing=max(opts.spacing, span / opts.requests))
    if opts.hosts != "netns":
        return _run_job(opts, console=console)
    with HostNet(roles=(*prefill_roles(opts.prefill_engines), *decode_roles(opts.decode_engines))) as hosts:
        if opts.rate_limit is not None:
            hosts.rate_limit(opts.rate_limit)
        return _run_job(opts, console=console, hosts=hosts)


def _run_job(opts: RunOptions, *, console=None, hosts: HostNet | None = None) -> dict:
    os.makedirs(opts.out, exist_ok=True)
    progress_cm = None
    orch = Orchestrator(opts, hosts=hosts)
    if not opts.quiet:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress_cm = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), console=console,
                               transient=False)
        units = opts.requests + sum(r.hold for r in orch.reqs)
        task = progress_cm.add_task(orch.phase, total=units, unit=progress_unit(opts, orch.reqs))

        live = progress_cm.console.is_terminal
        said: list[str] = []

        def update(o: Orchestrator) -> None:
            n = sum((r.turn1 is not None) + (r.hold and r.turn2 is not None) for r in o.reqs)
            progress_cm.update(task, completed=n, description=o.phase)
            if not live and (not said or said[-1] != o.phase):
                # Off a terminal the bar is not redrawn: each phase is a line.
                said.append(o.phase)
                print(f"kvplane run: {o.phase}", file=sys.stderr, flush=True)

        orch.progress = update
        update(orch)  # the first phase (starting the engines), before anything has started
    try:
        if progress_cm is not None:
            with progress_cm:
                summary = orch.run()
        else:
            summary = orch.run()
    finally:
        orch.stop_all()
    path = os.path.abspath(os.path.join(opts.out, "summary.json"))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, default=str)
    summary["summary_path"] = path
    # Sequence diagrams of a few requests, drawn from the finished event logs.
    from ..sequence_diagrams.command import write_run_samples
    summary["sequence_diagrams"] = write_run_samples(opts.out, summary["logs"]["P"], summary["logs"]["D"])
    return summary


def _writable_out(out: str) -> str | None:
    """Why ``--out`` cannot take the run's files, or None."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        return f"--out {out}: cannot create it: {exc.strerror or exc}"
    if not os.access(out, os.W_OK | os.X_OK):
        return f"--out {out}: not writable"
    return None


def run_json(summary: dict) -> dict:
    """``kvplane run --json``: the summary's outcome in one object (the
    whole summary is summary.json)."""
    keys = ("ok", "checks", "check_reasons", "requests", "bytes_moved", "bytes_verified", "leases", "holds",
            "lifecycle", "engines_evicted", "heartbeats_sent", "heartbeats_received", "blocks_held", "errors",
            "wall_s", "startup_s", "wall_with_startup_s", "summary_path", "logs", "sequence_diagrams")
    return {"command": "run", "schema": 1, **{k: summary.get(k) for k in keys}}


def cmd_run(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    # Start-up lines, progress and errors on stderr (a terminal or not);
    # stdout has the table, or with --json one JSON object.
    err = Console(stderr=True, highlight=False)
    json_out = bool(getattr(args, "json", False))

    def refuse(message: str, code: int = 2) -> int:
        print(message, file=sys.stderr)
        if json_out:
            print(json.dumps({"command": "run", "schema": 1, "ok": False, "error": message}))
        return code

    try:
        opts = RunOptions.from_args(args)
        opts.validate()
    except (RunError, ValueError, TypeError) as exc:
        return refuse(f"kvplane run: {exc}")
    if not torch_installed():
        return refuse(NO_TORCH)
    if not nixl_installed():
        return refuse(NO_NIXL)
    problem = _writable_out(opts.out)
    if problem is not None:
        return refuse(f"kvplane run: {problem}")
    try:
        summary = run_job(opts, console=err)
    except KeyboardInterrupt:
        return refuse("kvplane run: interrupted; engine processes stopped", 130)
    except NetnsUnavailable as exc:
        return refuse(f"kvplane run: {exc}")
    except StartupFailed as exc:
        # run_job stopped every process it started before this reaches us.
        return refuse(f"kvplane run: {exc}; engine processes stopped", 1)
    except OSError as exc:
        return refuse(f"kvplane run: {exc.strerror or exc}: {exc.filename or opts.out}", 2)
    for e in summary["errors"]:
        err.print(f"[red]{escape(str(e))}[/red]", soft_wrap=True)
    failed = [k for k, v in summary["checks"].items() if v is False]
    if json_out:
        print(json.dumps(run_json(summary), default=str))
    else:
        console = Console()
        console.print(summary_table(summary))
        console.print(f"summary: {summary['summary_path']}")
        killed = [e["role"] for e in summary.get("decode_engines") or [] if e["killed"]]
        for role, log in summary["logs"].items():
            cut = " (cut short by the kill)" if role in killed else ""
            console.print(f"{role} event log{cut}: {log}\n  replay: kvplane replay {log}")
    if not summary["ok"]:
        err.print(f"[red]FAILED checks: {', '.join(failed)}[/red]")
        return 1
    return 0


def _signal_engine(c: "_Child", sig: int) -> None:
    """Signal an engine: its scheduler process and every worker rank process."""
    pids = [c.proc.pid] + list(c.ready.rank_pids if c.ready is not None else ())
    for pid in pids:
        if pid is None:
            continue
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
