"""An engine's incarnation: a restarted engine keeps its engine id, not the
blocks (nor the leases) of its predecessor.  The params a holder hands out
name the incarnation of each of its ranks (signed with the rest), its
handshake replies name the same token, and a reader reads only from the
incarnation its params name (decode_request's guards): an older one
connected is dropped and handshaken afresh (once), any other fails the recv
without a READ or a notification."""
from __future__ import annotations

import pytest

from kvplane.connector.param_auth import RefusedParams, sign, verify
from kvplane.connector.params import BadTransferParams, RemoteKV
from kvplane.connector.secret import keys_from_text
from kvplane.statemachines import actions as A
from kvplane.statemachines import events as E
from kvplane.statemachines.plane import ControlPlane

OLD, NEW = "0000018c2f000000-aa", "0000018c2f100000-bb"


def _waiting(plane: ControlPlane, rid: str, incarnation: str | None, now: float = 0.0) -> list:
    acts = plane.handle(E.NewRequest(request_id=rid, engine_id="P", remote_request_id=f"lease-{rid}",
                                     remote_block_ids=(1,), remote_incarnation=incarnation), now)
    acts += plane.handle(E.BlocksAllocated(request_id=rid, block_ids=(5,), num_remote_tokens=16, awaiting=True), now)
    return acts + plane.handle(E.StartLoad(request_id=rid), now)


def _kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_params_of_a_newer_incarnation_drop_the_older_one_and_read_the_new():
    plane = ControlPlane()
    assert "StartHandshake" in _kinds(_waiting(plane, "r1", OLD))
    assert "PostRead" in _kinds(plane.handle(E.HandshakeOk(engine_id="P", incarnation=OLD), 0.1))
    plane.handle(E.ReadDone(request_id="r1"), 0.2)
    # P restarts under the same engine id; its next params name the new incarnation.
    acts = _waiting(plane, "r2", NEW, 1.0)
    assert "RemoveRemoteAgent" in _kinds(acts) and "StartHandshake" in _kinds(acts)
    assert "PostRead" not in _kinds(acts)
    assert plane.instances["decode_request"]["r2"].state == "HANDSHAKING"
    acts = plane.handle(E.HandshakeOk(engine_id="P", incarnation=NEW), 1.1)
    reads = [a for a in acts if isinstance(a, A.PostRead)]
    assert [(a.request_id, a.remote_request_id) for a in reads] == [("r2", "lease-r2")]


def test_an_older_incarnation_twice_fails_the_recv_without_a_read():
    plane = ControlPlane()
    _waiting(plane, "r1", NEW)
    acts = plane.handle(E.HandshakeOk(engine_id="P", incarnation=OLD), 0.1)  # dropped, handshaken again
    assert "StartHandshake" in _kinds(acts) and "PostRead" not in _kinds(acts)
    acts = plane.handle(E.HandshakeOk(engine_id="P", incarnation=OLD), 0.2)  # the same old one answers
    assert "PostRead" not in _kinds(acts) and "SendNotif" not in _kinds(acts)
    assert [(a.request_id, a.ok) for a in acts if isinstance(a, A.ReportRecv)] == [("r1", False)]
    assert plane.instances["decode_request"]["r1"].state == "RECV_FAILED"


def test_a_newer_incarnation_than_the_params_is_not_read():
    plane = ControlPlane()
    _waiting(plane, "r1", OLD)
    acts = plane.handle(E.HandshakeOk(engine_id="P", incarnation=NEW), 0.1)
    assert "PostRead" not in _kinds(acts)
    assert [(a.request_id, a.ok) for a in acts if isinstance(a, A.ReportRecv)] == [("r1", False)]


def test_params_that_name_no_incarnation_are_read_as_before():
    plane = ControlPlane()
    _waiting(plane, "r1", None)
    assert "PostRead" in _kinds(plane.handle(E.HandshakeOk(engine_id="P", incarnation=OLD), 0.1))


BASE = {"remote_engine_id": "prefill-0", "remote_host": "10.0.0.1", "remote_port": 5600, "remote_request_id": "l1",
        "remote_block_ids": [1, 2], "tp_size": 2, "remote_rank_ports": [5600, 5601]}


def test_params_carry_one_incarnation_per_rank():
    rk = RemoteKV.from_dict(dict(BASE, remote_rank_incarnations=[OLD, NEW]))
    assert (rk.incarnation_of(0), rk.incarnation_of(1)) == (OLD, NEW)
    assert RemoteKV.from_dict(rk.to_dict()) == rk
    assert RemoteKV.from_dict(BASE).incarnation_of(1) is None  # not said: not checked


@pytest.mark.parametrize("bad", [[OLD], [OLD, 7], [OLD, ""], "ab", [OLD, "x" * 300]])
def test_malformed_incarnations_are_refused_by_name(bad):
    with pytest.raises(BadTransferParams, match="remote_rank_incarnations"):
        RemoteKV.from_dict(dict(BASE, remote_rank_incarnations=bad))


def test_the_incarnations_are_signed():
    keys = keys_from_text("ab" * 32)
    params = sign(dict(BASE, remote_rank_incarnations=[OLD, OLD], remote_num_tokens=32, remote_expiry=30.0),
                  prompt_sha256="0" * 64, issued=0.0, key=keys.signing)
    assert verify(params, keys).fields["remote_rank_incarnations"] == [OLD, OLD]
    with pytest.raises(RefusedParams, match="bad signature"):
        verify(dict(params, remote_rank_incarnations=[OLD, NEW]), keys)
