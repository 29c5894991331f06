"""``kvplane run``: a prefill and a decode process exchanging KV over real NIXL.

The parent is the proxy and the orchestrator: it starts P and D (multiprocessing
'spawn'), sends P a synthetic request stream, forwards P's kv_transfer_params
to D (and D's held-block params back to P for a bidirectional turn 2),
injects the requested faults, waits until both sides hold no blocks, and
prints and writes a summary.  It imports neither torch nor NIXL.

Every wait has a timeout and the children are always stopped in ``finally``
(SIGCONT, then terminate, then kill), so a crashed or hung child cannot hang
the parent, and Ctrl-C cleans up.
"""
from __future__ import annotations

import heapq
import json
import math
import multiprocessing as mp
import os
import random
import signal
import time
from multiprocessing.connection import wait as mp_wait
from typing import Any

import attrs

from kvplane.statemachines.base import is_finite_number

ENGINE_IDS = {"P": "prefill-0", "D": "decode-0"}
MIN_LEASE = 6.0  # heartbeat interval = lease // 6 must be >= 1 s
# Request kinds of the synthetic stream, one cycle (shuffled per cycle).
KINDS = ("normal", "prefix", "normal", "multiturn", "full_awaited", "normal",
         "prefix", "multiturn_late", "full_notify", "normal", "multiturn", "prefix")
# Timer slack: loops poll every ~1 ms; allow for scheduling on a busy 2-core box.
SLACK_S = 0.5
# D's plane clock is monotonic() + skew: far beyond any real skew is a typo,
# and a float clock that large loses its resolution (at 1e16 s it stops).
MAX_CLOCK_SKEW = 1e6


class RunError(ValueError):
    """Invalid run options (a clear message for the command line)."""


class StartupFailed(RuntimeError):
    """An engine process did not come up (in time); the job stops them all."""


@attrs.frozen(kw_only=True)
class RunOptions:
    requests: int = 48
    out: str = "runs/latest"
    lease: float = MIN_LEASE
    hold_ttl: float = 4.0
    push: bool = False
    kill_decode_at: float | None = None
    hang_decode_at: float | None = None
    drop_notifications: float = 0.0
    clock_skew: float = 0.0
    overload: float = 2.0  # long enough for heartbeats to extend leases in the default demo
    seed: int = 0
    timeout: float = 120.0
    # Spawning a process that imports torch and NIXL takes ~5 s here idle and
    # over a minute at load average 10 on 2 cores.
    startup_timeout: float = 300.0
    quiet: bool = False
    spacing: float = 0.02  # seconds between request arrivals
    num_blocks: int = 768
    block_elems: int = 32 * 1024  # 128 KiB float32 blocks
    min_blocks: int = 2
    max_blocks: int = 24
    expiry_margin: float = 1.0  # turn-2 gate safety margin (demo-sized)

    @classmethod
    def from_args(cls, args) -> "RunOptions":
        kw = {}
        for f in attrs.fields(cls):
            v = getattr(args, f.name, None)
            if v is not None:
                kw[f.name] = v
        return cls(**kw)

    def validate(self) -> None:
        # Every number first: NaN passes no comparison (a NaN fault time is
        # never due, a NaN lease never expires) and inf never arrives, so each
        # one would hang the job or crash a child instead of failing here.
        for name in ("lease", "hold_ttl", "drop_notifications", "clock_skew", "overload", "timeout",
                     "startup_timeout", "kill_decode_at", "hang_decode_at", "spacing", "expiry_margin"):
            v = getattr(self, name)
            if v is None and name in ("kill_decode_at", "hang_decode_at"):
                continue
            if not is_finite_number(v):
                raise RunError(f"--{name.replace('_', '-')} must be a finite number, got {v!r}")
        for name in ("requests", "seed", "num_blocks", "block_elems", "min_blocks", "max_blocks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise RunError(f"--{name.replace('_', '-')} must be an integer, got {v!r}")
        if abs(self.clock_skew) > MAX_CLOCK_SKEW:
            raise RunError(f"--clock-skew must be within +-{MAX_CLOCK_SKEW:g} s, got {self.clock_skew:g}")
        if self.timeout <= 0:
            raise RunError(f"--timeout must be > 0, got {self.timeout:g}")
        if self.startup_timeout <= 0:
            raise RunError(f"--startup-timeout must be > 0, got {self.startup_timeout:g}")
        if self.lease < MIN_LEASE:
            raise RunError(f"--lease must be >= {MIN_LEASE:g} s (heartbeat interval = lease // 6 must be >= 1 s), "
                           f"got {self.lease:g}")
        if self.requests < 1:
            raise RunError("--requests must be >= 1")
        if not 0.0 <= self.drop_notifications < 1.0:
            raise RunError(f"--drop-notifications must be in [0, 1), got {self.drop_notifications:g}")
        if self.hold_ttl <= self.expiry_margin:
            raise RunError(f"--hold-ttl must be > the {self.expiry_margin:g} s turn-2 safety margin")
        if self.kill_decode_at is not None and self.hang_decode_at is not None:
            raise RunError("--kill-decode-at and --hang-decode-at are exclusive")
        for name in ("kill_decode_at", "hang_decode_at"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise RunError(f"--{name.replace('_', '-')} must be >= 0")
        if self.overload < 0:
            raise RunError("--overload must be >= 0")
        if self.max_blocks > self.num_blocks // 2:
            raise RunError("requests must fit the KV cache twice over")

    # Derived, demo-sized timeouts.
    @property
    def interval(self) -> float:
        return self.lease // 6

    @property
    def extension(self) -> float:
        return self.lease * 2 // 3

    def plane_config(self) -> dict:
        # A READ must be over (done or cancelled) before P can reclaim a lease
        # whose last heartbeat preceded it: transfer timeout <= extension - interval.
        transfer = max(1.0, self.extension - self.interval)
        return dict(
            kv_lease_duration=self.lease, decoder_kv_blocks_ttl=self.hold_ttl,
            expiry_safety_margin=self.expiry_margin, engine_ttl=max(30.0, 4 * self.lease),
            handshake_timeout=2.0, handshake_backoff=0.5, handshake_max_attempts=3,
            transfer_timeout=transfer, recv_timeout=transfer + 10.0,
            push_registration_timeout=self.overload + transfer + 10.0,
        )


@attrs.define
class Req:
    lid: str
    kind: str
    nblocks: int
    prefix: int
    arrive: float
    push: bool
    hold: bool = False
    late: bool = False
    turn1: str | None = None  # ok | recomputed | corrupt | failed
    detail: str = ""
    turn2: str | None = None  # ok | recomputed | corrupt | failed | skipped
    hold_at: float | None = None
    hold_params: dict | None = None
    turn2_due: float | None = None
    sent: bool = False

    @property
    def done(self) -> bool:
        return self.turn1 is not None and (not self.hold or self.turn2 is not None)


def make_stream(opts: RunOptions) -> list[Req]:
    rng = random.Random(opts.seed)
    kinds: list[str] = []
    while len(kinds) < opts.requests:
        cycle = list(KINDS)
        rng.shuffle(cycle)
        kinds += cycle
    reqs = []
    for i, kind in enumerate(kinds[: opts.requests]):
        n = rng.randint(opts.min_blocks, opts.max_blocks)
        prefix = {"prefix": rng.randint(1, n - 1), "full_awaited": n, "full_notify": n}.get(kind, 0)
        reqs.append(Req(lid=f"req{i:04d}", kind=kind, nblocks=n, prefix=prefix, arrive=i * opts.spacing,
                        push=opts.push and prefix < n, hold=kind.startswith("multiturn"),
                        late=kind == "multiturn_late"))
    return reqs


def run_keys() -> dict[str, dict]:
    """A CURVE keypair per node for this run; each node gets its own secret
    and the other's public key (its server key and its allow-list entry)."""
    import zmq

    pairs = {role: zmq.curve_keypair() for role in ENGINE_IDS}
    return {role: {"keypair": pairs[role], "peers": {ENGINE_IDS[o]: pairs[o][0] for o in ENGINE_IDS if o != role}}
            for role in ENGINE_IDS}


class _Child:
    def __init__(self, role: str, proc, conn):
        self.role, self.proc, self.conn = role, proc, conn
        self.ready: dict | None = None
        self.summary: dict | None = None
        self.status: dict | None = None
        self.dead = False  # exited (or killed on purpose)
        self.stopped = False
        self.abandoned: dict | None = None  # its answer to "abandon" (what it gave up)
        self.released: dict | None = None  # its answer to "release"


class Orchestrator:
    def __init__(self, opts: RunOptions, progress=None):
        self.o = opts
        self.progress = progress
        self.reqs = make_stream(opts)
        self.by_lid = {r.lid: r for r in self.reqs}
        self.children: dict[str, _Child] = {}
        self.t0 = 0.0
        self.fault: dict[str, Any] = {}
        self.fault_at: float | None = None
        self.errors: list[str] = []
        self.phase = "starting"
        self.startup_s: float | None = None
        self.abandoning: str | None = None  # why the run is being given up (timeout, a crash)
        self.abandoned: dict | None = None
        self._open = {r.lid for r in self.reqs}  # requests not done yet
        self._next_unsent = 0  # reqs are in arrival order
        self._turn2_heap: list[tuple[float, int, str]] = []  # (due, seq, lid)
        self._seq = 0
        self._progress_at = 0.0

    # ------------------------------------------------------------ processes
    def start(self) -> None:
        ctx = mp.get_context("spawn")
        node_opts = {
            "engine_ids": ENGINE_IDS, "plane": self.o.plane_config(), "out": os.path.abspath(self.o.out),
            "clock_skew": self.o.clock_skew, "drop_notifications": self.o.drop_notifications, "seed": self.o.seed,
            "num_blocks": self.o.num_blocks, "block_elems": self.o.block_elems, "overload": self.o.overload,
            # D's fences (see mainjob_node): a stall or params this old may have outlived P's lease.
            "stall_limit": max(0.5, self.o.extension - self.o.interval - SLACK_S),
        }
        from .node import node_main  # noqa: F401  (fail here, not in a child, if it cannot import)

        saved = {k: os.environ.get(k) for k in ("UCX_NET_DEVICES", "NIXL_LOG_LEVEL")}
        os.environ["UCX_NET_DEVICES"] = "lo"
        os.environ["NIXL_LOG_LEVEL"] = "ERROR"
        keys = run_keys()
        try:
            for role in ("P", "D"):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=node_main, args=(role, child, {**node_opts, "curve": keys[role]}),
                                   name=f"kvplane-{role}", daemon=True)
                proc.start()
                child.close()
                self.children[role] = _Child(role, proc, parent)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        started = time.monotonic()
        deadline = started + self.o.startup_timeout
        while any(c.ready is None for c in self.children.values()):
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

    def stop_all(self) -> None:
        for c in self.children.values():
            p = c.proc
            if p.pid is None:
                continue
            if c.stopped:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
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
                    if not (c.role == "D" and self.fault.get("kind") == "kill") and c.summary is None:
                        self.errors.append(f"{c.role} exited unexpectedly (exit code {c.proc.exitcode})")

    def _drain(self, c: _Child) -> None:
        try:
            while c.conn.poll(0):
                kind, body = c.conn.recv()
                getattr(self, f"on_{kind}")(c, body)
        except (EOFError, OSError):
            c.dead = True

    def send(self, role: str, kind: str, body: dict | None = None) -> bool:
        c = self.children[role]
        if c.dead:
            return False
        try:
            c.conn.send((kind, body or {}))
            return True
        except (BrokenPipeError, OSError):
            c.dead = True
            return False

    def on_ready(self, c: _Child, body: dict) -> None:
        c.ready = body

    def on_error(self, c: _Child, body: dict) -> None:
        self.errors.append(f"{c.role} crashed:\n{body['traceback']}")

    def on_status(self, c: _Child, body: dict) -> None:
        c.status = body

    def on_summary(self, c: _Child, body: dict) -> None:
        c.summary = body

    def on_abandoned(self, c: _Child, body: dict) -> None:
        c.abandoned = body

    def on_released(self, c: _Child, body: dict) -> None:
        c.released = body

    def on_prefilled(self, c: _Child, body: dict) -> None:
        r = self.by_lid[body["lid"]]
        if self.fault_at is not None or self.abandoning:
            # The proxy routes nothing to a decoder it knows is down (P's
            # lease expires), nor after a timeout (P releases it).
            why = "not routed: decode down" if self.abandoning is None else f"not routed: {self.abandoning}"
            r.turn1, r.detail = ("failed" if self.abandoning is None else "abandoned"), why
            if r.hold:
                r.turn2 = "skipped" if self.abandoning is None else "abandoned"
            self._advance(r)
            return
        params = dict(body["params"])
        if r.push:
            params["push"] = True
        self.send("D", "decode", {"lid": r.lid, "did": f"d-{r.lid}", "nblocks": r.nblocks, "prefix": r.prefix,
                                  "await_full": r.kind == "full_awaited", "hold": r.hold, "params": params,
                                  "granted_at": body["granted_at"]})

    def on_decoded(self, c: _Child, body: dict) -> None:
        r = self.by_lid[body["lid"]]
        r.turn1, r.detail = body["outcome"], body["detail"]
        if r.hold:
            if body["hold"] is None:
                r.turn2 = "skipped"
            else:
                r.hold_params, r.hold_at = body["hold"], time.monotonic()
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

    def on_turn2_done(self, c: _Child, body: dict) -> None:
        r = self.by_lid[body["lid"]]
        r.turn2 = body["outcome"]
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
        self.phase = "streaming"
        timed_out = False
        while True:
            now = time.monotonic()
            if now > hard_deadline:
                self.errors.append(f"timed out after {o.timeout:g} s in phase {self.phase!r}")
                timed_out = True
                break
            if fault_kind and self.fault_at is None and now - self.t0 >= fault_time:
                self._inject(fault_kind)
            if self.fault_at is None:
                self._send_due(now)
            if self.fault_at is not None and self._fault_settled():
                break
            if self.fault_at is None and not self._open:
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
        return self._summary()

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
            r.sent = self.send("P", "prefill", {"lid": r.lid, "pid": f"p-{r.lid}", "nblocks": r.nblocks,
                                                "push": r.push})
            if not r.sent:
                break
            self._next_unsent += 1
        while self._turn2_heap and self._turn2_heap[0][0] <= now:
            _, _, lid = heapq.heappop(self._turn2_heap)
            r = self.by_lid[lid]
            if r.turn2_due is None or r.turn2 is not None:
                continue  # skipped meanwhile
            r.turn2_due = None
            self.send("P", "turn2", {"lid": r.lid, "p2id": f"p2-{r.lid}", "nblocks": r.nblocks,
                                     "params": r.hold_params})

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
                os.kill(c.proc.pid, signal.SIGCONT)
                c.stopped = False
        not_sent = set()
        for r in self.reqs:
            if not r.sent:
                r.turn1, r.sent, r.detail = "abandoned", True, f"not sent: {why}"
                not_sent.add(r.lid)
        live = [role for role, c in self.children.items() if not c.dead]
        self._round(live, "abandon", "abandoned")
        # Only once the reader has stopped: P's leases when D has abandoned
        # (or died), D's holds when P has.
        safe = [role for role, other in (("P", "D"), ("D", "P"))
                if role in live and (self.children[other].dead or self.children[other].abandoned is not None)]
        self._round(safe, "release", "released")
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
        self._drain_blocks(time.monotonic() + cfg["transfer_timeout"] + 2 * SLACK_S + 5.0)
        self.abandoned = {
            "reason": why, "requests_not_sent": len(not_sent), "in_flight_turn1": unresolved["turn1"],
            "in_flight_turn2": unresolved["turn2"],
            **{role: (c.released or c.abandoned or {}).get("counts") for role, c in self.children.items()},
        }

    def _round(self, roles: list[str], kind: str, reply: str, timeout: float = 15.0) -> None:
        """Send ``kind`` to ``roles`` and wait, bounded, until each one that is
        still alive answered ``reply``."""
        waiting = [r for r in roles if self.send(r, kind)]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(getattr(self.children[r], reply) is not None or self.children[r].dead for r in waiting):
                return
            self.pump(0.05)

    def _inject(self, kind: str) -> None:
        d = self.children["D"]
        self.fault_at = time.monotonic()
        self.fault = {"kind": kind, "at_s": round(self.fault_at - self.t0, 3)}
        self.phase = f"decode {'killed' if kind == 'kill' else 'hung'}: P reclaims"
        if kind == "kill":
            os.kill(d.proc.pid, signal.SIGKILL)
            d.proc.join(timeout=5.0)
            self._drain(d)  # outcomes D sent before it died are still in the pipe
            d.dead = True
            for r in self.reqs:
                if r.sent and r.turn1 is None:
                    r.turn1, r.detail = "failed", "decode killed"
        else:
            os.kill(d.proc.pid, signal.SIGSTOP)
            d.stopped = True
        for r in self.reqs:  # the proxy routes nothing more to a decoder it knows is down
            if not r.sent:
                r.turn1, r.sent = "skipped", True
            if r.hold and r.turn2 is None and r.turn2_due is not None:
                r.turn2, r.turn2_due = "skipped", None
            elif r.hold and r.turn2 is None and r.turn1 in ("failed", "skipped"):
                r.turn2 = "skipped"
        self._advance()

    def _fault_settled(self) -> bool:
        """Kill: until P holds no lease blocks.  Hang: the same, then SIGCONT
        D and go on until every request is resolved."""
        d = self.children["D"]
        if d.stopped:
            st = self._ask("P")
            # P's timers fire at its first loop tick after they are due: a P
            # whose loop stalls (a loaded machine) reclaims that much later.
            bound = self.fault_at + self.o.lease + 2 * SLACK_S + 1.0 + (st or {}).get("max_loop_gap_s", 0.0)
            if (st is not None and st["lease_blocks"] == 0) or time.monotonic() > bound:
                self.fault["p_reclaimed_before_resume"] = st is not None and st["lease_blocks"] == 0
                self.fault["resumed_at_s"] = round(self.elapsed(), 3)
                os.kill(d.proc.pid, signal.SIGCONT)
                d.stopped = False
                self.phase = "decode resumed: draining"
            return False
        return all(self.by_lid[lid].turn1 == "skipped" for lid in self._open)

    def _ask(self, role: str, timeout: float = 2.0) -> dict | None:
        c = self.children[role]
        c.status = None
        if not self.send(role, "status"):
            return None
        deadline = time.monotonic() + timeout
        while c.status is None and time.monotonic() < deadline and not c.dead:
            self.pump(0.05)
        return c.status

    def _drain_blocks(self, hard_deadline: float) -> None:
        """Wait until both sides hold no blocks (leases expire, holds time out)."""
        self.phase = "draining"
        o = self.o
        limit = min(hard_deadline, time.monotonic() + o.lease + o.hold_ttl + o.plane_config()["recv_timeout"] + 5)
        while time.monotonic() < limit and not self.errors:
            sts = {role: self._ask(role) for role, c in self.children.items() if not c.dead}
            if all(st is not None and st["held_blocks"] == 0 and st["waiting"] == 0 and st["loading"] == 0
                   for st in sts.values()):
                return
            self.pump(0.1)

    def _collect_summaries(self) -> None:
        self.phase = "collecting"
        for role, c in self.children.items():
            if c.stopped:
                os.kill(c.proc.pid, signal.SIGCONT)
                c.stopped = False
            self.send(role, "finish")
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and any(c.summary is None and not c.dead for c in self.children.values()):
            self.pump(0.1)

    # ------------------------------------------------------------ summary
    def _summary(self) -> dict:
        o = self.o
        P, D = (self.children[r].summary for r in ("P", "D"))
        t1 = {k: 0 for k in ("ok", "recomputed", "corrupt", "failed", "skipped", "abandoned", "pending")}
        t2 = dict(t1)
        for r in self.reqs:
            t1[r.turn1 or "pending"] += 1
            if r.hold:
                t2[r.turn2 or "pending"] += 1
        late = [r for r in self.reqs if r.late and r.turn2 not in (None, "skipped", "abandoned")]
        on_time = [r for r in self.reqs if r.hold and not r.late and r.turn2 not in (None, "skipped", "abandoned")]
        moved = sum(s["bytes_moved"] for s in (P, D) if s)
        busy = sum(s["busy_s"] for s in (P, D) if s)
        verified = sum(s["verified_bytes"] for s in (P, D) if s)
        wall = self.elapsed()
        # Only a run without faults, drops or a timeout must read everything.
        clean = o.drop_notifications == 0 and self.fault_at is None and self.abandoned is None
        checks: dict[str, Any] = {}
        checks["no_errors"] = not self.errors
        checks["p_blocks_held_zero"] = bool(P) and P["held_blocks"] == 0
        killed = self.fault.get("kind") == "kill"
        checks["d_blocks_held_zero"] = None if killed else bool(D) and D["held_blocks"] == 0
        checks["no_corrupt_bytes"] = t1["corrupt"] == 0 and t2["corrupt"] == 0
        checks["all_requests_resolved"] = t1["pending"] == 0 and t2["pending"] == 0
        checks["late_turn2_declined"] = all(r.turn2 == "recomputed" for r in late)
        checks["on_time_turn2_read"] = all(r.turn2 == "ok" for r in on_time) if clean else None
        if clean:
            checks["all_turn1_ok"] = t1["ok"] == o.requests
        expired_early = None
        if P:
            recs = P["lease_records"]
            cut = self.fault_at if self.fault_at is not None else math.inf
            if o.drop_notifications == 0:
                # Heartbeats flowed until the fault (if any): no lease may expire before it.
                expired_early = [r["id"] for r in recs if r["reason"] == "expired" and r["freed"] < cut]
                checks["no_lease_expired_while_heartbeats_flowed"] = not expired_early
        if self.fault_at is not None and P:
            self.fault.update(self._reclaim(P))
            checks["p_reclaimed_within_bound"] = self.fault.get("within_bound", False)
        summary = {
            "options": attrs.asdict(o), "plane_config": o.plane_config(), "wall_s": round(wall, 3),
            "requests": {"turn1": t1, "turn2": t2, "total": o.requests,
                         "multiturn": sum(r.hold for r in self.reqs), "late_turn2": len(late)},
            "bytes_moved": moved, "bytes_verified": verified, "transfer_busy_s": round(busy, 4),
            "gbps_in_flight": round(moved / busy / 1e9, 3) if busy > 0 else None,
            "gbps_wall": round(moved / wall / 1e9, 4) if wall > 0 else None,
            "leases": (P or {}).get("leases"), "holds": (D or {}).get("holds"),
            "heartbeats_sent": sum(s["heartbeats_sent"] for s in (P, D) if s),
            "heartbeats_received": sum(s["heartbeats_received"] for s in (P, D) if s),
            "engines_evicted": sum(s["engines_evicted"] for s in (P, D) if s),
            "blocks_held": {"P": P["held_blocks"] if P else None, "D": D["held_blocks"] if D else None},
            "clock_skew": o.clock_skew,
            "p_estimated_offset_of_d": (P or {}).get("clock_offsets", {}).get(ENGINE_IDS["D"]),
            "fault": self.fault or None, "errors": self.errors, "checks": checks,
            "startup_s": None if self.startup_s is None else round(self.startup_s, 3),
            # What a timeout (or a crashed side) made the job give up; None when it ran to the end.
            "abandoned": self.abandoned,
            # Why reads were recomputed: turn 1 is D reading P, turn 2 P reading D.
            "recompute_reasons": {"turn1": (D or {}).get("recompute_reasons"),
                                  "turn2": (P or {}).get("recompute_reasons")},
            # Each side's step loop: its longest gap between ticks (how late a timer can fire).
            "loop": {role: _loop_brief(side) for role, side in (("P", P), ("D", D))},
            "expired_before_fault": expired_early,
            "sides": {"P": _slim(P), "D": _slim(D)},
            # Written by each side as it runs; a killed side's log ends where it died.
            "logs": {role: os.path.join(os.path.abspath(o.out), f"{name}.events.jsonl")
                     for role, name in (("P", "prefill"), ("D", "decode"))},
            "requests_detail": [attrs.asdict(r, filter=lambda a, v: a.name != "hold_params") for r in self.reqs],
        }
        summary["ok"] = all(v is not False for v in checks.values())
        return summary

    def _reclaim(self, P: dict) -> dict:
        """P's reclaim after the fault, against the lease promise: a lease is
        freed by max(grant + lease, last heartbeat + extension)."""
        o = self.o
        recs = [r for r in P["lease_records"] if r["granted"] is not None]
        last_hb = P["last_hb_at"]
        after = [r for r in recs if r["freed"] is not None and r["freed"] >= self.fault_at]
        live = [r for r in recs if r["freed"] is None]
        out: dict[str, Any] = {"lease_extension_s": o.extension, "leases_reclaimed_after_fault": len(after),
                               "leases_expired_after_fault": sum(r["reason"] == "expired" for r in after),
                               "leases_still_live": len(live)}
        if last_hb is not None:
            out["p_last_heartbeat_s"] = round(last_hb - self.t0, 3)
        if not after:
            out["within_bound"] = not live
            return out
        last_free = max(r["freed"] for r in after)
        out["p_all_reclaimed_s"] = round(last_free - self.t0, 3)
        # P frees a lease at its first loop tick after the expiry: the slack
        # is SLACK_S plus the longest gap of P's loop in the reclaim window
        # (a loaded machine, not the protocol, makes that late).
        stall = _loop_stall_between(P.get("loop"), self.fault_at, last_free)
        slack = SLACK_S + stall
        out["p_loop_stall_s"] = round(stall, 3)
        out["slack_s"] = round(slack, 3)
        late = []
        for r in after:
            due = max(r["granted"] + o.lease, (r["hb"] or -math.inf) + o.extension)
            if r["freed"] > due + slack:
                late.append(r["id"])
        out["late_leases"] = late
        if last_hb is not None:
            reclaim = last_free - last_hb
            # Leases granted shortly before the fault may still be inside their initial term.
            bound = max(o.extension, max(r["granted"] + o.lease for r in after) - last_hb)
            out["reclaim_after_last_heartbeat_s"] = round(reclaim, 3)
            out["bound_s"] = round(bound, 3)
            out["within_one_extension"] = reclaim <= o.extension + slack
            out["within_bound"] = not late and not live and reclaim <= bound + slack
        else:
            out["within_bound"] = not late and not live
        return out


def _loop_stall_between(loop: dict | None, start: float, end: float) -> float:
    """The longest gap of a side's loop that overlaps [start, end] (its
    monotonic clock, the one every process here shares)."""
    if not loop:
        return 0.0
    if loop["gaps_over_report"] > len(loop["long_gaps"]):
        return loop["max_gap_s"]  # the list was capped: assume the worst
    worst = loop["report_over_s"]  # gaps shorter than this are not listed
    for gap_end, gap in loop["long_gaps"]:
        if gap_end >= start and gap_end - gap <= end:
            worst = max(worst, gap)
    return worst


def _loop_brief(side: dict | None) -> dict | None:
    if not side or "loop" not in side:
        return None
    lp = side["loop"]
    calls = (side.get("nixl_calls") or {}).get("max_s") or {}
    slowest = max(calls.items(), key=lambda kv: kv[1], default=None)
    return {"max_gap_s": lp["max_gap_s"], f"gaps_over_{lp['report_over_s']:g}s": lp["gaps_over_report"],
            "stalls": len(lp["stalls"]), "stall_limit_s": lp["stall_limit_s"],
            "slowest_nixl_call": None if slowest is None else {"call": slowest[0], "s": slowest[1]}}


def _slim(s: dict | None) -> dict | None:
    if s is None:
        return None
    return {k: v for k, v in s.items() if k != "lease_records"}


# ---------------------------------------------------------------- output
def _table(summary: dict):
    from rich.table import Table

    t = Table(title="kvplane run", show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    r1, r2 = summary["requests"]["turn1"], summary["requests"]["turn2"]
    t.add_row("requests (turn 1): ok / recomputed / failed",
              f"{r1['ok']} / {r1['recomputed']} / {r1['failed'] + r1['corrupt'] + r1['pending']}"
              + (f"  (+{r1['skipped']} not sent)" if r1["skipped"] else "")
              + (f"  (+{r1['abandoned']} abandoned)" if r1["abandoned"] else ""))
    t.add_row("turn 2 (P reads D's held blocks): ok / recomputed / failed",
              f"{r2['ok']} / {r2['recomputed']} / {r2['failed'] + r2['corrupt'] + r2['pending']}"
              + (f"  (+{r2['skipped']} skipped)" if r2["skipped"] else "")
              + (f"  (+{r2['abandoned']} abandoned)" if r2["abandoned"] else ""))
    t.add_row("late turn 2 declined by the expiry gate", f"{summary['requests']['late_turn2']}")
    for turn, reasons in (summary.get("recompute_reasons") or {}).items():
        if reasons:
            t.add_row(f"{turn.replace('turn', 'turn ')} recomputed because",
                      "; ".join(f"{why}: {n}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])))
    mib = summary["bytes_moved"] / 2**20
    t.add_row("bytes moved (verified)", f"{mib:.1f} MiB ({summary['bytes_verified'] / 2**20:.1f} MiB)")
    g = summary["gbps_in_flight"]
    t.add_row("GB/s while transfers in flight / over the run",
              f"{g if g is not None else '-'} / {summary['gbps_wall']}")
    le = summary["leases"] or {}
    t.add_row("P leases granted / extended / expired / consumed",
              f"{le.get('granted', '-')} / {le.get('extended', '-')} / {le.get('expired', '-')} / {le.get('consumed', '-')}")
    ho = summary["holds"] or {}
    t.add_row("D holds granted / consumed / expired",
              f"{ho.get('granted', 0)} / {ho.get('consumed', 0)} / {ho.get('expired', 0)}")
    t.add_row("heartbeats sent / received", f"{summary['heartbeats_sent']} / {summary['heartbeats_received']}")
    t.add_row("engines evicted", str(summary["engines_evicted"]))
    bh = summary["blocks_held"]
    t.add_row("blocks still held P / D", f"{bh['P']} / {bh['D'] if bh['D'] is not None else 'n/a (killed)'}")
    f = summary["fault"]
    if f:
        if "reclaim_after_last_heartbeat_s" in f:
            t.add_row(f"decode {f['kind']} at {f['at_s']} s: P reclaimed after last heartbeat",
                      f"{f['reclaim_after_last_heartbeat_s']} s (extension {f['lease_extension_s']:g} s, "
                      f"bound {f['bound_s']} s)")
        t.add_row("leases reclaimed after the fault (expired)",
                  f"{f['leases_reclaimed_after_fault']} ({f['leases_expired_after_fault']})")
    loop = summary.get("loop") or {}
    t.add_row("longest loop stall P / D (gaps > 0.1 s)",
              " / ".join("-" if loop.get(r) is None else f"{loop[r]['max_gap_s']:.3f} s ({loop[r]['gaps_over_0.1s']})"
                         for r in ("P", "D")))
    t.add_row("slowest NIXL call P / D",
              " / ".join("-" if not (loop.get(r) or {}).get("slowest_nixl_call") else
                         f"{loop[r]['slowest_nixl_call']['call']} {loop[r]['slowest_nixl_call']['s'] * 1e3:.1f} ms"
                         for r in ("P", "D")))
    ab = summary.get("abandoned")
    if ab:
        t.add_row(f"abandoned ({ab['reason']}): not sent / in flight (turn 1, turn 2)",
                  f"{ab['requests_not_sent']} / {ab['in_flight_turn1']}, {ab['in_flight_turn2']}")
        for role in ("P", "D"):
            if ab.get(role):
                t.add_row(f"  {role} gave up", ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in ab[role].items()))
    t.add_row("wall time", f"{summary['wall_s']} s")
    for name, v in summary["checks"].items():
        if v is not None:
            t.add_row(f"check: {name}", "[green]pass[/green]" if v else "[red]FAIL[/red]")
    return t


def run_job(opts: RunOptions, *, console=None) -> dict:
    """Run the job; returns the summary (also written under ``opts.out``)."""
    opts.validate()
    os.makedirs(opts.out, exist_ok=True)
    progress_cm = None
    if not opts.quiet:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress_cm = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), console=console, transient=False)
        orch = Orchestrator(opts)
        units = opts.requests + sum(r.hold for r in orch.reqs)
        task = progress_cm.add_task("starting", total=units)

        def update(o: Orchestrator) -> None:
            n = sum((r.turn1 is not None) + (r.hold and r.turn2 is not None) for r in o.reqs)
            progress_cm.update(task, completed=n, description=o.phase)

        orch.progress = update
    else:
        orch = Orchestrator(opts)
    try:
        if progress_cm is not None:
            with progress_cm:
                summary = orch.run()
        else:
            summary = orch.run()
    finally:
        orch.stop_all()
    path = os.path.join(opts.out, "summary.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, default=str)
    summary["summary_path"] = path
    return summary


def cmd_run(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    try:
        opts = RunOptions.from_args(args)
        opts.validate()
    except (RunError, ValueError, TypeError) as exc:
        console.print(f"[red]kvplane run: {escape(str(exc))}[/red]", soft_wrap=True)
        return 2
    try:
        summary = run_job(opts, console=console)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; engine processes stopped[/yellow]")
        return 130
    except StartupFailed as exc:
        # run_job stopped every process it started before this reaches us.
        console.print(f"[red]kvplane run: {escape(str(exc))}; engine processes stopped[/red]", soft_wrap=True)
        return 1
    console.print(_table(summary))
    for e in summary["errors"]:
        console.print(f"[red]{e}[/red]")
    console.print(f"summary: {summary['summary_path']}")
    for role, log in summary["logs"].items():
        cut = " (cut short by the kill)" if role == "D" and (summary["fault"] or {}).get("kind") == "kill" else ""
        console.print(f"{role} event log{cut}: {log}\n  replay: kvplane replay {log}")
    if not summary["ok"]:
        failed = [k for k, v in summary["checks"].items() if v is False]
        console.print(f"[red]FAILED checks: {', '.join(failed)}[/red]")
        return 1
    return 0
