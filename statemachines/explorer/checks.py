"""Safety checks after every move, and what a quiescent state may not hold.

Safety: no READ posted or executed against a lease that is not held, or
whose expiry (in the reader's clock) is <= now; no WRITE posted or executed
from a lease that is not held; no request holds an engine_ref to an engine
that is gone; no engine STALE within stale_after (engine_ttl / 2) of observed activity; no
protocol violation.  (FreeBlocks at most once and ReportRecv only when
awaited, at most once, are checked where the model executes those actions.)
"""
from __future__ import annotations

from .world import Clocks, World

HELD_LEASE = ("LEASED", "PARTIALLY_READ")


class Found(Exception):
    """A violation of kind ``kind`` (a safety check failed)."""

    def __init__(self, kind: str, message: str):
        super().__init__(kind, message)
        self.kind, self.message = kind, message


class Checks:
    def __init__(self, clocks: Clocks, holds: dict[str, dict[str, frozenset]], stale_after: float):
        self.clocks = clocks
        self.holds = holds  # machine kind -> state -> resources held there
        self.ttl = stale_after  # silence before an engine may be STALE

    def lease_problem(self, w: World, src: str, dst: str, rrid: str) -> str | None:
        """Why ``src`` may not read ``dst``'s lease ``rrid`` now, or None."""
        if dst == "P" and w.crashed:
            return None
        lease = w.planes[dst].instances["lease"].get(rrid)
        if lease is None or lease.state not in HELD_LEASE:
            return "which is " + (lease.state if lease is not None else "gone (released or expired)")
        # Held, but its expiry (in the reader's clock) has come: the owner
        # reclaims the blocks as soon as its timer runs.
        skew = self.clocks.skew
        expiry = lease.expiry - skew[dst] + skew[src]
        now = self.clocks.now(w, src)
        if expiry <= now:
            return f"whose expiry t={expiry:g} ({src}'s clock) is <= now t={now:g}"
        return None

    def check_read(self, w: World, src: str, dst: str, rrid: str, what: str) -> None:
        problem = self.lease_problem(w, src, dst, rrid)
        if problem is not None:
            if dst == "D":
                raise Found("turn2_read_of_expired_blocks", f"turn-2 READ {what} against D's held blocks {rrid}, "
                            f"{problem}")
            raise Found("read_of_unheld_lease", f"READ {what} against P lease {rrid}, {problem}")

    @staticmethod
    def check_write(w: World, src: str, req: str, what: str) -> None:
        """A WRITE reads the writer's own lease of the same request: it must
        be held (P's clock and timers decide; no offset is involved)."""
        if src == "P" and w.crashed:
            return
        lease = w.planes[src].instances["lease"].get(req)
        if lease is None or lease.state not in HELD_LEASE:
            state = lease.state if lease is not None else "gone (released, expired or aborted)"
            raise Found("write_from_unheld_lease", f"WRITE {what} from {src} lease {req}, which is {state}: "
                        f"the push outlived the blocks it writes from")

    def check_invariants(self, w: World) -> None:
        ttl = self.ttl
        owned = w.owned
        for pname, plane in w.planes.items():
            # A plane the move left alone (shared with the world it came
            # from) passed these checks there; time only moves forward, which
            # no STALE verdict can turn into a violation.
            if pname not in owned:
                continue
            if plane.anomalies:
                for what, kind, key, ev, detail in plane.anomalies:
                    if what == "protocol_violation":
                        raise Found("protocol_violation", f"{pname} {kind}:{key} {ev}: {detail}")
                plane.anomalies.clear()
            engines = plane.instances["remote_engine"]
            for kind in ("decode_request", "push_write"):
                holds = self.holds[kind]
                for key, inst in plane.instances[kind].items():
                    if "engine_ref" in holds[inst.state]:
                        e = engines.get(inst.engine_id)
                        # Gone, or evicted and since re-created without this reference.
                        if e is None or (kind, key) not in e.refs:
                            raise Found("evicted_while_referenced",
                                        f"{pname} {kind}:{key} in {inst.state} holds a reference to engine "
                                        f"{inst.engine_id}, which was evicted under it")
            now = self.clocks.now(w, pname)
            for key, e in engines.items():
                if e.state == "STALE":
                    seen = w.activity.get((pname, key))
                    if seen is not None and seen + ttl > now:
                        raise Found("stale_despite_activity",
                                    f"{pname} marked engine {key} STALE at t={now:g}, but saw activity at "
                                    f"t={seen:g} (STALE after {ttl:g} s of silence)")

    def quiescent_problems(self, w: World) -> list[str]:
        """What a state where nothing more happens must not have: anything
        held, a request alive, an awaited recv never reported."""
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
