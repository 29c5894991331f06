"""The explorer's D restart fault (``RESTART_FAULTS``): D dies and starts
again at once with the same engine id, a new incarnation.  P must reclaim
every lease it granted for the old incarnation (liveness: nothing held at
quiescence), and the new incarnation must never complete one of them."""
from __future__ import annotations

import pytest

from kvplane.statemachines.explorer import FAULTS, RESTART_FAULTS, explore

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


@pytest.mark.xfail(strict=True, reason="known gap: a turn-2 request that reached P before D restarted carries the old "
                                       "incarnation's hold (its expiry still ahead); P handshakes the new incarnation "
                                       "(same engine id) and READs blocks it does not hold. Needs an incarnation id "
                                       "in the hold's params, checked against the handshake.")
def test_a_turn2_read_never_reaches_a_new_incarnation():
    r = explore(requests=("read2",), faults=RESTART, max_depth=16)
    assert r.ok, r.violations[0].kind
