"""Helpers shared by the state-machine core tests (tests/test_core_*.py).

Nothing here decides an expected result: the helpers drive machines with
real events and collect what comes out.
"""
from __future__ import annotations

from typing import Iterable

from kvplane.statemachines import actions as A
from kvplane.statemachines import events as E
from kvplane.statemachines.base import Action, ArmTimer, CancelTimer
from kvplane.statemachines.config import PlaneConfig
from kvplane.statemachines.plane import ControlPlane

TIMER_ACTIONS = (ArmTimer, CancelTimer)


def of_type(actions: Iterable[Action], cls: type) -> list:
    return [a for a in actions if isinstance(a, cls)]


def names(actions: Iterable[Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def held_by(plane: ControlPlane, key) -> list:
    """The leak report restricted to machines with this id."""
    return [h for h in plane.held() if h[1] == key]


def run_timers(plane: ControlPlane, until: float) -> list[tuple[float, Action]]:
    """Fire every timer of ``plane`` up to ``until`` in deadline order, each at
    its own deadline; returns (time, action) pairs."""
    out: list[tuple[float, Action]] = []
    while True:
        at = plane.next_deadline()
        if at is None or at > until:
            return out
        out.extend((at, a) for a in plane.fire_due(at))


def new_request(rid: str, engine: str, remote: str, **kw) -> E.NewRequest:
    kw.setdefault("remote_block_ids", (100, 101))
    return E.NewRequest(request_id=rid, engine_id=engine, remote_request_id=remote, **kw)


def connect(plane: ControlPlane, engine: str, now: float, offset: float = 0.0, rtt: float = 0.001) -> list[Action]:
    return plane.handle(E.HandshakeOk(engine_id=engine, samples=((offset, rtt),)), now)


def heartbeats_to_leases(actions: Iterable[Action], peer: ControlPlane, now: float) -> list[Action]:
    """Deliver every SendHeartbeat as the ``HB:`` ids it carries to the peer's leases."""
    out: list[Action] = []
    for hb in of_type(actions, A.SendHeartbeat):
        for rid in hb.request_ids:
            out.extend(peer.handle(E.LeaseHeartbeat(request_id=rid), now))
    return out


def plane(**cfg) -> ControlPlane:
    return ControlPlane(PlaneConfig(**cfg))


def trusting_gate_machine():
    """decode_request with the READ gate's heartbeat-chain condition removed
    (D trusts its last heartbeat whatever the gap before it): the mutant the
    stall tests must catch.  It passes validation, as the real bug would."""
    import attrs

    from kvplane.statemachines.machines import decode_request
    from kvplane.statemachines.machine import compile_machine
    from kvplane.statemachines.spec import Transition

    def trusting(r, ev, cfg, now):
        """the bug: trust the last heartbeat whatever the gap before it"""
        if r.remote_expiry is None:
            return False
        valid = r.remote_expiry - ev.clock_offset
        if r.remote_renewable and ev.heartbeat_at is not None:
            valid = max(valid, ev.heartbeat_at + cfg.lease_extension)
        return valid <= now + min(cfg.expiry_safety_margin, cfg.heartbeat_interval)

    table = tuple(attrs.evolve(t, guard=trusting) if isinstance(t, Transition)
                  and t.guard is decode_request.remote_blocks_expired else t for t in decode_request.TABLE)
    assert table != decode_request.TABLE
    return compile_machine(attrs.evolve(decode_request.SPEC, table=table))
