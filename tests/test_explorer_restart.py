"""The explorer's D restart fault (``RESTART_FAULTS``): D dies and starts
again at once with the same engine id, a new incarnation.  P must reclaim
every lease it granted for the old incarnation (liveness: nothing held at
quiescence), and the new incarnation must never complete one of them."""
from __future__ import annotations

import pytest

from kvplane.statemachines import actions as A
from kvplane.statemachines import events as E
from kvplane.statemachines.explorer import FAULTS, RESTART_FAULTS, explore
from kvplane.statemachines.plane import ControlPlane

RESTART = frozenset({"restart"})


@pytest.mark.parametrize("requests, depth", [(("read",), 14), (("read", "hit"), 10), (("read", "read"), 10),
                                             (("push",), 12)])
def test_p_reclaims_the_old_incarnations_leases(requests, depth):
    r = explore(requests=requests, faults=RESTART, max_depth=depth)
    assert r.ok, r.violations[0].message if r.violations else r
    assert r.states > 100  # the restart was explored, not cut off


def test_restart_with_the_other_faults():
    r = explore(requests=("read",), faults=RESTART_FAULTS, max_faults=2, max_depth=10)
    assert r.ok, r.violations[0].message if r.violations else r
    assert "restart" not in FAULTS  # opt-in: the default explorations are unchanged


def test_a_turn2_read_never_reaches_a_new_incarnation():
    # A turn 2 that reached P before D restarted carries the old
    # incarnation's hold (its expiry still ahead); P handshakes the new
    # incarnation (same engine id): the hold's params name the old one, the
    # handshake the new one, so P reads nothing (decode_request's
    # other_incarnation guard; without it this finds turn2_read_of_expired_blocks).
    r = explore(requests=("read2",), faults=RESTART, max_depth=16)
    assert r.ok, r.violations[0].kind if r.violations else r
    assert r.states > 100


def _plane_waiting_on(engine_incarnation):
    """P's turn-2 request for D's hold of the incarnation "D#0", woken by a
    handshake that names ``engine_incarnation``: the actions of the wake-up."""
    plane = ControlPlane()
    plane.handle(E.NewRequest(request_id="q0", engine_id="D", remote_request_id="d0", remote_block_ids=(1,),
                              remote_expiry=100.0, remote_incarnation="D#0"), 0.0)
    plane.handle(E.BlocksAllocated(request_id="q0", block_ids=(3,), num_remote_tokens=4, awaiting=True), 0.0)
    plane.handle(E.StartLoad(request_id="q0"), 0.0)
    actions = plane.handle(E.HandshakeOk(engine_id="D", samples=((0.0, 0.001),), incarnation=engine_incarnation), 0.1)
    return plane, actions


@pytest.mark.parametrize("incarnation", ["D#1", None])
def test_another_or_an_unnamed_incarnation_is_not_read(incarnation):
    plane, actions = _plane_waiting_on(incarnation)
    assert not any(isinstance(a, A.PostRead) for a in actions)
    assert not any(isinstance(a, A.SendNotif) for a in actions)
    reports = [a for a in actions if isinstance(a, A.ReportRecv)]
    assert [(r.request_id, r.ok) for r in reports] == [("q0", False)]
    assert plane.instances["decode_request"]["q0"].state == "RECV_FAILED"


def test_the_holders_incarnation_is_read():
    plane, actions = _plane_waiting_on("D#0")
    assert [a.request_id for a in actions if isinstance(a, A.PostRead)] == ["q0"]
